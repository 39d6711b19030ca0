"""The control plane's API on the wire: the JSON body of every request and answer, as typed
dicts, for the routes of stasis.controlplane.routes. The server validates each request with the
pydantic model of the same name (stasis.controlplane.models; tests hold the two to the same
fields); its answers are these dicts. This module imports only `typing` (and the
commands' typed dicts): the node side and the CLI import it at no cost.

An error, on any route, is {"error": {"type": <a StasisError class>, "message": <one line>}}.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

from stasis.controlplane.commands import Command

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


NodeState = Literal["pending", "lost", "ready", "not-ready"]


class Node(TypedDict):
    """A node as GET /api/v1/nodes shows it (its row: stasis.controlplane.schema.nodes)."""

    cluster_id: str
    name: str
    host: str
    stasis_version: str
    criu_version: str | None
    slurm_version: str | None
    check_ok: bool
    problems: list[str]
    registered: str
    last_heartbeat: int  # unix seconds
    jobs: int  # running
    mem_total_bytes: int | None
    scheduler_state: str | None
    lost_since: int | None
    approved: bool
    cluster: str  # its cluster's name
    credential_since: str | None  # None: no credential of its own (yet, or reset)
    state: NodeState
    last_heartbeat_age_s: float


class Registered(TypedDict):
    """A node's join (or report again): `node_token`, its own credential, shown once when it
    joined with the cluster's token."""

    cluster_id: str
    name: str
    registered: bool
    approved: bool
    node_token: NotRequired[str]


class Heard(TypedDict):
    name: str
    ok: bool


class NodeWasReset(TypedDict):
    cluster_id: str
    name: str
    reset: bool  # False: it had no credential


class NodeApproved(TypedDict):
    cluster_id: str
    name: str
    approved: bool
    was_pending: bool


class Job(JobReport):
    """A job a node last reported, with its node and cluster, the newest live checkpoint of
    its (user, label), and its checkpoint interval (`interval`, when a policy or its node
    sets one: stasis.controlplane.intervals)."""

    node: str
    cluster: str
    cluster_id: str
    last_checkpoint: str | None
    last_checkpoint_age_s: float | None
    last_checkpoint_verified: str | None  # ok | failed: REASON | not verified
    interval: NotRequired[dict[str, Any]]
    # A Slurm job on several nodes (stasis.controlplane.jobgroups): its parts per node, the
    # nodes it runs on, and its batch node (None while no node reports its registration).
    parts: NotRequired[list[JobPart]]
    nodes: NotRequired[list[str]]
    batch_node: NotRequired[str | None]


class JobPart(TypedDict):
    """A part of a Slurm job on one of its nodes: the daemon job labelled
    `slurm-<job>-part-<key>` there."""

    node: str
    job: str  # the daemon job's id on that node
    key: str  # the part's key (kept by every restore of it, on whichever node)
    label: str
    state: str
    rss_bytes: int


class Handled(TypedDict):
    job: str
    kind: str
    label: str | None


class Drained(TypedDict):
    """What draining a node queued: a migration per daemon job, the scheduler's drain (None
    without a scheduler), and the scheduler's jobs that drain handles."""

    node: str
    cluster_id: str
    migrations: list[Command]
    drain: Command | None
    handled: list[Handled]


class Event(TypedDict):
    id: int
    at: str  # ISO 8601
    cluster_id: str | None
    node: str | None
    kind: str  # node-joined, command-done, migration-retry, ...
    message: str


class Cluster(TypedDict):
    id: str
    name: str
    kind: ClusterKind
    created: str
    approve_joins: bool


class ClusterAdded(TypedDict):
    """A new cluster, with its token (shown once)."""

    cluster_id: str
    name: str
    kind: ClusterKind
    token_id: str
    token: str
    expires: int | None  # unix seconds; None: until revoked
    approve_joins: bool


class Rotated(TypedDict):
    """A cluster's new token (shown once); its older ones are revoked."""

    cluster_id: str
    token_id: str
    token: str
    expires: int | None


class ClusterApproval(TypedDict):
    cluster_id: str
    approve_joins: bool


class Token(TypedDict):
    """A token as listed (its SHA-256 never)."""

    id: str
    kind: Literal["admin", "cluster"]
    cluster_id: str | None
    created: str
    revoked: str | None
    expires: int | None


class Revoked(TypedDict):
    token_id: str
    revoked: bool


class Verdict(TypedDict):
    """The newest verdict of `stasis verify` on a checkpoint (stasis.controlplane.verdicts)."""

    ok: bool
    reason: str
    node: str  # the node that reported it
    at: str  # ISO 8601
    duration_s: float
    processes: int


class Checkpoint(TypedDict):
    """A checkpoint a node reported (GET /api/v1/checkpoints)."""

    id: str
    cluster_id: str
    node: str
    job: str
    label: str
    user: str
    size_bytes: int
    stored_size_bytes: int
    duration_s: float
    frozen_s: float
    work_s: float
    leave_running: bool
    reason: str
    store: str
    created: float  # unix seconds
    deleted: float | None
    cluster: str  # its cluster's name
    verdict: Verdict | None  # None: never verified
    verified: str  # ok | failed: REASON | not verified
    age_s: float


class Policy(NewPolicy):
    """A policy as the API shows it, every field of NewPolicy given (its hook token's hash
    never: whether it has one)."""

    enabled: bool
    last_run: int  # unix seconds
    created: str
    hook_created: str | None
    hook: bool
    hook_token: NotRequired[str]  # shown once, when it is made


class PolicyRemoved(TypedDict):
    name: str
    removed: bool


class HookRotated(TypedDict):
    name: str
    hook_token: str  # shown once


class PolicyRun(TypedDict):
    name: str
    queued: int  # the commands it queued


class ClusterHours(TypedDict):
    cluster: str
    node_hours: float


class UserHours(TypedDict):
    user: str
    node_hours: float


class DayHours(TypedDict):
    day: str  # YYYY-MM-DD, UTC
    node_hours: float


class Kept(TypedDict):
    """Node-hours of work kept by restores instead of reruns: in all, per cluster, per user,
    per day (UTC)."""

    node_hours: float
    restores: int
    clusters: list[ClusterHours]
    users: list[UserHours]
    days: list[DayHours]


class ClusterSavings(TypedDict):
    cluster: str
    kept_node_hours: float
    spent_node_hours: float
    net_node_hours: float
    interruptions: int
    node_hours_seen: float
    rate_per_node_hour: float


class Savings(Kept):
    """What restores kept against what checkpointing cost (stasis.controlplane.savings)."""

    spent_node_hours: float
    net_node_hours: float
    spent_days: list[DayHours]
    per_cluster: list[ClusterSavings]
