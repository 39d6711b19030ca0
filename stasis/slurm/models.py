"""What the daemon's /slurm routes (and its remote listener's) take, as the daemon validates it (the answers are typed
dicts of stasis/wire.py, which the client's methods type their arguments with too)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from stasis import wire
from stasis.daemon.models import CUT_KEY_PATTERN, CUT_PARTS_MAX
from stasis.slurm.partnames import PART_KEY_PATTERN
from stasis.slurm.remote import MAX_CREDENTIAL_CHARS


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterRequest(_Model):
    slurm_job: str
    pid: int = Field(gt=1)
    label: str
    explicit_label: bool = False
    restored_from: str | None = None  # the checkpoint the workload was restored from


_REASON = Field(default="asked", max_length=60, pattern=r"^[A-Za-z0-9 ._:-]*$")


class CheckpointRequest(_Model):
    leave_running: bool = False
    reason: str = _REASON


class FinishRequest(_Model):
    # Absent or null: the launcher could not tell how the workload ended; not a success.
    exit_code: int | None = None
    stopped: bool = False  # the launcher was warned or signalled (preemption, time limit, ...)


class IntervalRequest(_Model):
    # "default": the job set no STASIS_INTERVAL; the node's `interval` setting decides.
    requested: str = Field(max_length=20, pattern=r"^(auto|default|[0-9]{1,9}(\.[0-9]{1,6})?)$")


class RemoteCheckpointRequest(_Model):
    credential: str = Field(max_length=MAX_CREDENTIAL_CHARS)
    leave_running: bool = False
    reason: str = _REASON


class RemoteDrainRequest(_Model):
    credential: str = Field(max_length=MAX_CREDENTIAL_CHARS)
    reason: str = _REASON


class PartStartRequest(_Model):
    credential: str = Field(max_length=MAX_CREDENTIAL_CHARS)
    command: list[str] = Field(min_length=1, max_length=4096)
    cwd: str = Field(min_length=1, max_length=4096, pattern=r"^/")


class PartOutputRequest(_Model):
    credential: str = Field(max_length=MAX_CREDENTIAL_CHARS)
    offset: int = Field(default=0, ge=0)


class PartSignalRequest(_Model):
    credential: str = Field(max_length=MAX_CREDENTIAL_CHARS)
    signal: Literal["TERM", "HUP", "INT", "KILL"] = "TERM"


class PartFreezeRequest(_Model):
    credential: str = Field(max_length=MAX_CREDENTIAL_CHARS)
    timeout_s: float = Field(default=60.0, gt=0, le=3600)


class PartDumpRequest(_Model):
    credential: str = Field(max_length=MAX_CREDENTIAL_CHARS)
    label: str = Field(min_length=1, max_length=128)
    reason: str = _REASON
    cut_parts: int | None = Field(default=None, ge=2, le=CUT_PARTS_MAX)
    cut_key: str | None = Field(default=None, pattern=CUT_KEY_PATTERN)


class PartThawRequest(_Model):
    credential: str = Field(max_length=MAX_CREDENTIAL_CHARS)
    stop: bool = False


class PartDeleteRequest(_Model):
    credential: str = Field(max_length=MAX_CREDENTIAL_CHARS)


class PartListRequest(_Model):
    credential: str = Field(max_length=MAX_CREDENTIAL_CHARS)


class PartNetRequest(_Model):
    credential: str = Field(max_length=MAX_CREDENTIAL_CHARS)
    held: bool


class PartRestoreRequest(_Model):
    credential: str = Field(max_length=MAX_CREDENTIAL_CHARS)
    checkpoint: str = Field(min_length=1, max_length=128)
    part: str = Field(pattern=PART_KEY_PATTERN)


# The model that validates each request typed dict of Slurm's routes (stasis.routes.SLURM and
# SLURM_REMOTE).
BY_WIRE: dict[object, type[BaseModel]] = {
    wire.RegisterRequest: RegisterRequest,
    wire.SlurmCheckpointRequest: CheckpointRequest,
    wire.SlurmIntervalRequest: IntervalRequest,
    wire.FinishRequest: FinishRequest,
    wire.SlurmRemoteCheckpointRequest: RemoteCheckpointRequest,
    wire.SlurmRemoteDrainRequest: RemoteDrainRequest,
    wire.SlurmPartStartRequest: PartStartRequest,
    wire.SlurmPartOutputRequest: PartOutputRequest,
    wire.SlurmPartSignalRequest: PartSignalRequest,
    wire.SlurmPartFreezeRequest: PartFreezeRequest,
    wire.SlurmPartDumpRequest: PartDumpRequest,
    wire.SlurmPartThawRequest: PartThawRequest,
    wire.SlurmPartDeleteRequest: PartDeleteRequest,
    wire.SlurmPartListRequest: PartListRequest,
    wire.SlurmPartNetRequest: PartNetRequest,
    wire.SlurmPartRestoreRequest: PartRestoreRequest,
}
