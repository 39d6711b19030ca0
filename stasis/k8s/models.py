"""What the daemon's /k8s routes take (pydantic, validated) and answer (typed dicts)."""

from __future__ import annotations

from typing import Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field


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


class DrainRequest(_Model):
    reason: str = Field(default="stasis drain", min_length=1, max_length=60)


class NodeInfo(TypedDict):
    node: str  # this node's name in the Kubernetes API
    state: str  # Ready, Ready,SchedulingDisabled+DRAIN, ...; "" = the API did not answer
    api: bool  # whether the daemon has a Kubernetes API at all


class CheckpointAnswer(TypedDict):
    checkpoint: str
    label: str
    container_id: str
    namespace: str
    size_bytes: int
    duration_s: float
    stopped: bool


class RestorePlan(TypedDict):
    checkpoint: str | None  # None: nothing to restore, start fresh
    label: str
    images_dir: str | None
    work_dir: str | None
    notes: list[str]  # what the container's log should say (skipped checkpoints, why fresh)
    # Good checkpoints of the label given up on this node after failed restores: with none
    # left to try, the container starts fresh only if its STASIS_FRESH asks.
    given_up: list[str]


class ContainerInfo(TypedDict):
    container_id: str
    runc_root: str
    bundle: str
    label: str
    namespace: str
    pod: str | None
    interval_s: int
    restored_from: str | None
    last_checkpoint: str | None
    registered: str


class RestoreDone(TypedDict):
    container_id: str
    checkpoint: str | None
    attempts: int  # failed restores of the checkpoint on this node so far
    limit: int  # k8s_restore_attempts (0: never given up)
    log: str  # where the failed restore's log was kept ("" = nowhere)
    record: str  # the file that counts them (removed: its attempts start again)


class Forgotten(TypedDict):
    container_id: str
    forgotten: bool


class ExportRequest(_Model):
    path: str  # where the daemon writes the archive (root only)


class ImportRequest(_Model):
    path: str
    label: str = ""  # "" = the one in the archive
    namespace: str = ""


class ExportAnswer(TypedDict):
    checkpoint: str
    path: str
    digest: str
    size_bytes: int
