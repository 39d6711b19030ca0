"""Wire formats of the daemon's HTTP/JSON API (requests in, answers out)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stasis.errors import UsageError
from stasis.store import CompressionRequest

JOB_ID = re.compile(r"^[0-9a-f]{12}$")

JobState = Literal["running", "restored", "checkpointed", "exited"]


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


class RestoreRequest(_Model):
    checkpoint: str | None = None
    label: str | None = None
    # Whose label (name or uid; root only, for another user's): the caller's own by default.
    user: str | None = None
    lazy: bool | None = None  # None: the daemon's setting (lazy_restore)


class KillRequest(_Model):
    # A name (TERM, SIGTERM, term) or a number; stasis/daemon/signals.py reads it.
    signal: str | int = "SIGTERM"
    # How long the job has to end on `signal` before SIGKILL; None: the daemon's
    # kill_timeout_s. 0: SIGKILL at once.
    timeout_s: float | None = Field(default=None, ge=0, le=3600)


class Job(_Model):
    job: str
    pid: int | None
    state: JobState
    label: str
    exit_code: int | None
    command: list[str]
    user: str
    uid: int
    cwd: str
    log: str
    checkpoint: str | None = None  # the checkpoint this job was restored from
    created: str


class RunAnswer(_Model):
    job: str
    pid: int
    label: str


class KillAnswer(_Model):
    job: str
    state: JobState
    # What ended the job: the signal asked for, or SIGKILL once the timeout passed. None: it
    # was not running when asked (`state` says how it is).
    ended_by: str | None
    exit_code: int | None
    signal: str  # the signal sent first
    timeout_s: float  # how long it was given to end on it


class DumpAnswer(_Model):
    checkpoint: str
    label: str
    job: str
    size_bytes: int
    duration_s: float  # CRIU's dump
    elapsed_s: float = 0.0  # the daemon's whole answer: CRIU, publishing, the kill
    # The images went to node memory first (leave-running dumps), then to the store.
    staged: bool = False
    # Every way the dump differs from what was asked, and why: an --incremental dump taken in
    # full, a dump not staged in memory, `--compress auto` storing it uncompressed. Never silent.
    notes: list[str] = []


class DumpCheckAnswer(_Model):
    job: str
    # What makes a dump of the job fail as it is now, each with what to do about it.
    obstacles: list[str] = []
    # What a dump would not bring back as it was (a timed wait cut short by EINTR).
    notes: list[str] = []


class RestoreAnswer(_Model):
    job: str
    pid: int
    checkpoint: str
    # Newer checkpoints of the label that failed verification and were passed over, with why.
    skipped: list[str] = []
    lazy: bool = False  # the job runs while its memory is still coming back
    # Every way the restore differs from what was asked, and why (a lazy restore done in full).
    notes: list[str] = []
    duration_s: float = 0.0  # CRIU's restore, until the job ran again
    elapsed_s: float = 0.0  # the daemon's whole answer: verification, supervisor, CRIU
