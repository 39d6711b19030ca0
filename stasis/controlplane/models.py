"""What the control plane's server accepts: one pydantic model per request typed dict of
stasis.controlplane.wire (same name, same fields; tests/controlplane/test_wire_controlplane.py
holds them to each other), with the constraints the typed dicts cannot say: what nodes send is
checked here, by charset and length, before it reaches a form, a path, a log or a command."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from stasis.controlplane import policies, wire
from stasis.controlplane.registry import CHECKPOINT_ID, JOB_ID, LABEL, USER
from stasis.controlplane.verdicts import VerdictReport
from stasis.errors import UsageError


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NewCluster(_Model):
    name: str = Field(max_length=100)
    kind: Literal["slurm", "kubernetes"]
    expires_in_s: int | None = Field(default=None, ge=1, le=10 * 366 * 86400)
    # Its nodes wait for an admin's approval once joined (stasis.controlplane.registry).
    approve_joins: bool = False


class ClusterSettings(_Model):
    approve_joins: bool


class Rotation(_Model):
    expires_in_s: int | None = Field(default=None, ge=1, le=10 * 366 * 86400)


# Ids: registry's patterns. Free text (problems, hosts, versions): printable characters only.
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
_TEXT = r"^[^\x00-\x1f\x7f]*$"
_WORD = r"^[A-Za-z0-9._:+ -]*$"
# A node's scheduler state: Slurm's (MIXED+DRAIN) or a Kubernetes node's as kubectl shows it
# (Ready,SchedulingDisabled+DRAIN).
_STATE = r"^[A-Za-z0-9._:+, -]*$"


def _seconds_or_auto(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A policy's period: "auto", or seconds, refused as a number is (the union's other
    branch would only add noise to the one line)."""
    if value == "auto":
        return value
    try:
        return handler(value)
    except ValidationError as e:
        first = next(
            (x for x in e.errors() if not str(x["loc"][:1]).startswith("(\"literal")), None
        )
        if first is None:
            raise
        raise PydanticCustomError(first["type"], first["msg"]) from None


# 0: only when its webhook is called; auto: each job at its own interval
_EVERY = Annotated[
    Annotated[int, Field(ge=0, le=366 * 86400)] | Literal["auto"], WrapValidator(_seconds_or_auto)
]


class NodeReport(_Model):
    name: str = Field(pattern=_NAME)
    cluster_id: str | None = Field(default=None, max_length=40, pattern=_NAME)
    host: str = Field(max_length=200, pattern=_TEXT)
    stasis_version: str = Field(max_length=60, pattern=_TEXT)
    criu_version: str | None = Field(default=None, max_length=60, pattern=_TEXT)
    slurm_version: str | None = Field(default=None, max_length=60, pattern=_TEXT)
    check_ok: bool
    problems: list[Annotated[str, Field(max_length=1000, pattern=_TEXT)]] = Field(
        default_factory=list, max_length=50
    )
    jobs: int = Field(default=0, ge=0)


class JobReport(_Model):
    job: str = Field(pattern=JOB_ID)
    label: str | None = Field(default=None, pattern=LABEL)
    user: str | None = Field(default=None, pattern=USER)
    state: str = Field(max_length=40, pattern=_WORD)
    restored_from: str | None = Field(default=None, pattern=CHECKPOINT_ID)
    started: str | None = Field(default=None, max_length=40, pattern=_WORD)
    kind: str = Field(default="daemon", max_length=20, pattern=_NAME)  # daemon | slurm | ...
    partition: str | None = Field(default=None, max_length=100, pattern=_WORD)
    rss_bytes: int = Field(default=0, ge=0)
    interval_s: float | None = Field(default=None, ge=0)
    interval_why: str | None = Field(default=None, max_length=500, pattern=_TEXT)


class ActivityReport(_Model):
    """A checkpoint or restore of the node (stasis.daemon.activity.Activity)."""

    kind: Literal["checkpoint", "restore"]
    checkpoint: str = Field(pattern=CHECKPOINT_ID)
    label: str = Field(pattern=LABEL)
    job: str = Field(pattern=JOB_ID)
    user: str = Field(pattern=USER)
    size_bytes: int = Field(ge=0)
    stored_size_bytes: int = Field(default=0, ge=0)
    work_s: float = Field(ge=0)
    duration_s: float = Field(ge=0)
    frozen_s: float = Field(default=0.0, ge=0)
    leave_running: bool = True
    store: str = Field(default="", max_length=500, pattern=_TEXT)
    reason: str = Field(default="", max_length=60, pattern=_WORD)
    at: float = Field(gt=0)


class Heartbeat(_Model):
    jobs: list[JobReport] = Field(default_factory=list, max_length=10_000)
    activity: list[ActivityReport] = Field(default_factory=list, max_length=1000)
    mem_total_bytes: int | None = Field(default=None, ge=0)
    scheduler_state: str | None = Field(default=None, max_length=60, pattern=_STATE)
    # Verdicts of `stasis verify` the node reached (kept for its own cluster's checkpoints).
    verdicts: list[VerdictReport] = Field(default_factory=list, max_length=1000)


class NewCommand(_Model):
    kind: Literal["checkpoint"]
    job: str = Field(pattern=JOB_ID)
    leave_running: bool = True
    cluster: str | None = Field(default=None, pattern=_NAME)  # its id or name
    node: str | None = Field(default=None, pattern=_NAME)


class Drain(_Model):
    reason: str = Field(default="stasis drain", max_length=60, pattern=r"^[A-Za-z0-9 ._:-]*$")
    cluster: str | None = Field(default=None, pattern=_NAME)


class Migration(_Model):
    job: str = Field(pattern=JOB_ID)
    to: str = Field(pattern=_NAME)
    cluster: str | None = Field(default=None, pattern=_NAME)
    node: str | None = Field(default=None, pattern=_NAME)


class NodeReset(_Model):
    cluster: str | None = Field(default=None, pattern=_NAME)


class Renewal(_Model):
    lease_id: str = Field(default="", max_length=40)


class NewPolicy(_Model):
    name: str = Field(max_length=100)
    every_s: _EVERY
    action: Literal["checkpoint", "retain", "migrate", "verify"]
    filters: dict[str, str] = Field(default_factory=dict, max_length=len(policies.FILTERS))
    keep: int | None = Field(default=None, ge=1, le=100_000)
    older_than_s: int | None = Field(default=None, ge=1)
    trigger: Literal["every", "memory", "drain"] = "every"
    threshold_pct: float | None = Field(default=None, gt=0, le=100)
    stop: bool = False  # checkpoint: and stop the job (a Slurm job: requeued)
    completed: bool = False  # retain: the checkpoints of labels whose job completed


class PolicyEdit(_Model):
    """What PATCH /api/v1/policies/NAME changes: only the fields given (NewPolicy's rules);
    `filters` are merged in, an empty or null value removes one."""

    every_s: _EVERY | None = None
    action: Literal["checkpoint", "retain", "migrate", "verify"] | None = None
    filters: dict[str, str | None] | None = Field(default=None, max_length=len(policies.FILTERS))
    keep: int | None = Field(default=None, ge=1, le=100_000)
    older_than_s: int | None = Field(default=None, ge=1)
    trigger: Literal["every", "memory", "drain"] | None = None
    threshold_pct: float | None = Field(default=None, gt=0, le=100)
    stop: bool | None = None
    completed: bool | None = None
    enabled: bool | None = None

    def changes(self) -> dict[str, Any]:
        """The fields the request gave (null for keep/older_than_s/threshold_pct: unset)."""
        given = self.model_dump(exclude_unset=True)
        for key in ("every_s", "action", "trigger", "stop", "completed", "enabled"):
            if key in given and given[key] is None:
                raise UsageError(f"bad request: {key}: cannot be null")
        return given


class Ack(_Model):
    lease_id: str = Field(default="", max_length=40)
    ok: bool
    result: dict[str, Any] = Field(default_factory=dict)


# The model that validates each request typed dict (stasis.controlplane.wire).
MODELS: dict[object, type[BaseModel]] = {
    wire.NewCluster: NewCluster,
    wire.ClusterSettings: ClusterSettings,
    wire.Rotation: Rotation,
    wire.NodeReport: NodeReport,
    wire.Heartbeat: Heartbeat,
    wire.NewCommand: NewCommand,
    wire.Drain: Drain,
    wire.Migration: Migration,
    wire.NodeReset: NodeReset,
    wire.Renewal: Renewal,
    wire.NewPolicy: NewPolicy,
    wire.PolicyEdit: PolicyEdit,
    wire.Ack: Ack,
}
# Nested shapes, for the tests that hold the typed dicts to the models.
NESTED: dict[object, type[BaseModel]] = {
    wire.JobReport: JobReport,
    wire.ActivityReport: ActivityReport,
    wire.VerdictReport: VerdictReport,
}
