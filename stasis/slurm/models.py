"""What the daemon's /slurm routes take and answer (validated on the daemon's side; the
launcher and the SPANK helper send and read the same shapes as plain JSON, see
`stasis.slurm.client`, so that they start without pydantic)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterRequest(_Model):
    slurm_job: str
    pid: int = Field(gt=1)
    label: str
    explicit_label: bool = False


class CheckpointRequest(_Model):
    leave_running: bool = False


class FinishRequest(_Model):
    exit_code: int


class Registration(_Model):
    slurm_job: str
    pid: int
    pid_start: int | None
    launcher_pid: int
    uid: int
    gid: int
    user: str
    label: str
    explicit_label: bool
    token: str
    stdout: str
    stderr: str
    work_dir: str
    command: list[str]
    state: str = "running"  # running | checkpointed | requeue-failed
    registered: str


class CheckpointAnswer(_Model):
    checkpoint: str
    label: str
    slurm_job: str
    size_bytes: int
    duration_s: float
    requeued: bool


class FinishAnswer(_Model):
    retired: list[str]


class Health(_Model):
    ok: bool = True
