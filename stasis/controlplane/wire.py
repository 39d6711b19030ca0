"""The control plane's API on the wire: the JSON body of every request and answer, as typed
dicts, for the routes of stasis.controlplane.routes. The server validates each request with the
pydantic model of the same name (stasis.controlplane.models; tests hold the two to the same
fields); its answers are these dicts. This module imports only `typing`: the node side and
the CLI import it at no cost.

An error, on any route, is {"error": {"type": <a StasisError class>, "message": <one line>}}.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

ClusterKind = Literal["slurm", "kubernetes"]
PolicyAction = Literal["checkpoint", "retain", "migrate", "verify"]
PolicyTrigger = Literal["every", "memory", "drain"]

# -- requests ---------------------------------------------------------------------------------


class NewCluster(TypedDict, total=False):
    name: str  # required
    kind: ClusterKind  # required
    expires_in_s: int | None
    approve_joins: bool  # its nodes wait for an admin's approval once joined


class ClusterSettings(TypedDict):
    approve_joins: bool


class Rotation(TypedDict, total=False):
    expires_in_s: int | None


class NodeReport(TypedDict, total=False):
    """A node joining (or its credential reporting again): its versions and check."""

    name: str  # required
    cluster_id: str | None
    host: str  # required
    stasis_version: str  # required
    criu_version: str | None
    slurm_version: str | None
    check_ok: bool  # required
    problems: list[str]
    jobs: int


class JobReport(TypedDict, total=False):
    job: str  # required
    label: str | None
    user: str | None
    state: str  # required
    restored_from: str | None
    started: str | None
    kind: str  # daemon | slurm | kubernetes | ...
    partition: str | None
    rss_bytes: int
    interval_s: float | None  # its periodic checkpoint interval on the node (GET /intervals)
    interval_why: str | None  # and why (the node's `stasis ps` says the same)


class ActivityReport(TypedDict, total=False):
    """A checkpoint or restore of the node (stasis.daemon.activity.Activity)."""

    kind: Literal["checkpoint", "restore"]  # required
    checkpoint: str  # required
    label: str  # required
    job: str  # required
    user: str  # required
    size_bytes: int  # required
    stored_size_bytes: int
    work_s: float  # required
    duration_s: float  # required
    frozen_s: float
    leave_running: bool
    store: str
    reason: str
    at: float  # required


class VerdictReport(TypedDict, total=False):
    """A verdict of `stasis verify` (stasis.controlplane.verdicts)."""

    checkpoint: str  # required
    ok: bool  # required
    reason: str
    node: str
    at: str  # required; ISO 8601 with its zone
    duration_s: float
    processes: int


class Heartbeat(TypedDict, total=False):
    jobs: list[JobReport]
    activity: list[ActivityReport]
    mem_total_bytes: int | None
    scheduler_state: str | None
    verdicts: list[VerdictReport]


class NewCommand(TypedDict, total=False):
    kind: Literal["checkpoint"]  # required
    job: str  # required
    leave_running: bool
    cluster: str | None  # its id or name
    node: str | None


class Drain(TypedDict, total=False):
    reason: str
    cluster: str | None


class Migration(TypedDict, total=False):
    job: str  # required
    to: str  # required
    cluster: str | None
    node: str | None


class NodeReset(TypedDict, total=False):
    cluster: str | None


class Renewal(TypedDict, total=False):
    lease_id: str


class Ack(TypedDict, total=False):
    lease_id: str
    ok: bool  # required
    result: dict[str, Any]


class NewPolicy(TypedDict, total=False):
    name: str  # required
    every_s: int | Literal["auto"]  # required; 0: only when its webhook is called; auto:
    # each job at its own Young/Daly interval (stasis.controlplane.intervals)
    action: PolicyAction  # required
    filters: dict[str, str]
    keep: int | None
    older_than_s: int | None
    trigger: PolicyTrigger
    threshold_pct: float | None
    stop: bool
    completed: bool


class PolicyEdit(TypedDict, total=False):
    """Only the fields given change; `filters` are merged in, an empty or null value removes
    one."""

    every_s: int | Literal["auto"] | None
    action: PolicyAction | None
    filters: dict[str, str | None] | None
    keep: int | None
    older_than_s: int | None
    trigger: PolicyTrigger | None
    threshold_pct: float | None
    stop: bool | None
    completed: bool | None
    enabled: bool | None


# -- answers ----------------------------------------------------------------------------------


class Health(TypedDict):
    ok: bool


class Renewed(TypedDict):
    id: str
    lease_until: int


class Committed(TypedDict):
    id: str
    committed: bool


# Rows as the registry shows them (their columns: stasis.controlplane.schema).
Cluster = dict[str, Any]
Token = dict[str, Any]
Node = dict[str, Any]
Job = dict[str, Any]
Event = dict[str, Any]
Checkpoint = dict[str, Any]
Policy = dict[str, Any]
Registered = dict[str, Any]  # the node's row, and `node_token` (shown once) when it joined
Drained = dict[str, Any]  # the commands queued, the scheduler's drain, the jobs it handles
Savings = dict[str, Any]
PolicyRun = dict[str, Any]
