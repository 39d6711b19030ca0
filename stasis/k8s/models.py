"""What the daemon's /k8s routes take, as the daemon validates it (pydantic); the answers are
typed dicts of stasis/wire.py, named here too."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from stasis import wire

# The answers, as the wire has them (named here as the k8s modules always have).
NodeInfo = wire.NodeInfo
CheckpointAnswer = wire.ContainerCheckpointAnswer
RestorePlan = wire.RestorePlan
ContainerInfo = wire.ContainerInfo
RestoreDone = wire.RestoreDone
Forgotten = wire.Forgotten
ExportAnswer = wire.ExportAnswer


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContainerRef(_Model):
    """A container as the shim names it to runc: the runc root and the container id."""

    runc_root: str
    container_id: str


class RegisterRequest(ContainerRef):
    bundle: str
    restored_from: str | None = None


class RestoreRequest(ContainerRef):
    bundle: str


class RestoreDoneRequest(_Model):
    ok: bool
    error: str = ""
    checkpoint: str = ""  # the plan's; "" = the daemon's own plan says which


class CheckpointRequest(_Model):
    # stop: the container is being stopped; it is killed once the checkpoint is published
    # (and left running when the checkpoint fails). interval / manual / cordon (its node was
    # cordoned, the agent asks) / annotation (its pod's owner asked, through the agent; held to
    # the node's floor on intervals): it goes on running.
    reason: Literal["stop", "interval", "manual", "cordon", "annotation"] = "manual"
    runc_root: str = ""  # "" = where the container was registered
    timeout_s: float = 0  # 0 = the daemon's k8s_stop_timeout_s


class IntervalRequest(_Model):
    # Seconds between leave-running checkpoints, 0 = none; None = the container's own
    # STASIS_INTERVAL again (the agent sets it from the pod's stasis.dev/interval annotation).
    interval_s: int | None = Field(default=None, ge=0, le=7 * 86400)
    # Young/Daly's interval from its measured cost (stasis.k8s.intervals; stasis.dev/interval:
    # auto); interval_s is then not read.
    auto: bool = False


class DrainRequest(_Model):
    reason: str = Field(default="stasis drain", min_length=1, max_length=60)


class ExportRequest(_Model):
    path: str  # where the daemon writes the archive (root only)


class ImportRequest(_Model):
    path: str
    label: str = ""  # "" = the one in the archive
    namespace: str = ""


# The model that validates each request typed dict of the /k8s routes (stasis.routes.K8S).
BY_WIRE: dict[object, type[BaseModel]] = {
    wire.ContainerRegisterRequest: RegisterRequest,
    wire.ContainerCheckpointRequest: CheckpointRequest,
    wire.ContainerIntervalRequest: IntervalRequest,
    wire.ContainerRestoreRequest: RestoreRequest,
    wire.RestoreDoneRequest: RestoreDoneRequest,
    wire.ExportRequest: ExportRequest,
    wire.ImportRequest: ImportRequest,
    wire.K8sDrainRequest: DrainRequest,
}
