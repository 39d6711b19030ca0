"""What the daemon's core routes take, as the daemon validates it: pydantic models of the request
shapes of stasis/wire.py (tests/test_wire.py holds them to each other); the answers are the
wire's typed dicts themselves."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stasis import wire
from stasis.errors import UsageError
from stasis.store import CompressionRequest

JOB_ID = re.compile(r"^[0-9a-f]{12}$")
# A cut's record (DumpRequest.cut_parts, cut_key): a few parts per node of a job's nodes; a
# part's key is "batch", a node's name, `node/job` or a Slurm part's key.
CUT_PARTS_MAX = 4096
CUT_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$"

JobState = wire.JobState  # one definition: the wire's


def validate_job_id(job_id: str) -> str:
    if not JOB_ID.match(job_id):
        raise UsageError(f"{job_id!r} is not a job id (12 hex digits; see `stasis ps`)")
    return job_id


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunRequest(_Model):
    command: list[str] = Field(min_length=1)
    label: str | None = None
    log: str | None = None
    cwd: str
    env: dict[str, str] = {}
    user: str | None = None
    private_tmp: bool | None = None  # None: the daemon's setting (private_tmp)
    job_net: int | None = Field(default=None, ge=1, le=(1 << 24) - 1)  # a job network's VNI

    @field_validator("cwd", "log")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or "\0" in v):
            raise ValueError("must be an absolute path")
        return v


class DumpRequest(_Model):
    leave_running: bool = False
    label: str | None = None
    compress: CompressionRequest = "none"
    incremental: bool = False
    encrypt: bool | None = None  # None: the daemon's setting (encrypt)
    # Why it is taken, as reported (to the control plane): a word or a few.
    reason: str = Field(default="asked", max_length=60, pattern=r"^[A-Za-z0-9 ._:-]*$")
    frozen: bool = False  # frozen by POST /jobs/{job}/freeze: dumped as it is, left frozen
    # The record of the cut across nodes it is a part of (with frozen only; both or neither).
    cut_parts: int | None = Field(default=None, ge=2, le=CUT_PARTS_MAX)
    cut_key: str | None = Field(default=None, pattern=CUT_KEY_PATTERN)


class FreezeRequest(_Model):
    timeout_s: float = Field(default=60.0, gt=0, le=3600)


class ThawRequest(_Model):
    stop: bool = False


class RestoreRequest(_Model):
    checkpoint: str | None = None
    label: str | None = None
    # Whose label (name or uid; root only, for another user's): the caller's own by default.
    user: str | None = None
    lazy: bool | None = None  # None: the daemon's setting (lazy_restore)
    # By label: only checkpoints whose recorded `stasis verify` verdict is ok (verifying.py).
    verified: bool = False


class GcRequest(_Model):
    idle_s: float = Field(default=3600.0, ge=0)


class KillRequest(_Model):
    # A name (TERM, SIGTERM, term) or a number; stasis/daemon/signals.py reads it.
    signal: str | int = "SIGTERM"
    # How long the job has to end on `signal` before SIGKILL; None: the daemon's
    # kill_timeout_s. 0: SIGKILL at once.
    timeout_s: float | None = Field(default=None, ge=0, le=3600)


# The model that validates each request typed dict of the core's routes (stasis.routes.CORE).
BY_WIRE: dict[object, type[BaseModel]] = {
    wire.RunRequest: RunRequest,
    wire.KillRequest: KillRequest,
    wire.DumpRequest: DumpRequest,
    wire.RestoreRequest: RestoreRequest,
    wire.GcRequest: GcRequest,
    wire.FreezeRequest: FreezeRequest,
    wire.ThawRequest: ThawRequest,
}
