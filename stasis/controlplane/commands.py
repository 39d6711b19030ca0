"""The commands a control plane gives its nodes: their kinds and each kind's arguments, as the
server queues them (registry, policies, dashboard) and the node side carries them out
(stasis.controlplane.node). Typed dicts (JSON on the wire, in the `commands` table's `args`),
so that both sides are checked by mypy against one declaration; this module imports only
`typing`.

    kind        args             what the node does                          queued by
    checkpoint  CheckpointArgs   checkpoints a job (then_restore_on: the     queue, migrate_job,
                                 first half of a migration, sealed for its   policies, dashboard
                                 targets)
    restore     RestoreArgs      restores the checkpoint its migration took  stasis.controlplane.
                                 (sealed for this node), fenced by commit    migration
    drain       DrainArgs        drains the node in its scheduler            drain
    retain      RetainArgs       deletes the checkpoints past a policy's     policies (retain)
                                 keep / older_than_s / completed
    verify      VerifyArgs       `stasis verify` of one checkpoint           verify_checkpoint,
                                                                             policies (verify)

What the node sends back is a CommandResult: `error` (one line) when it failed, `permanent`
when no retry would change that.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict, get_args

Kind = Literal["checkpoint", "restore", "drain", "retain", "verify"]
KINDS: tuple[Kind, ...] = get_args(Kind)
# What a command's row goes through: queued -> leased -> done | failed, never back.
State = Literal["queued", "leased", "done", "failed"]


class _Why(TypedDict, total=False):
    reason: str  # said in the checkpoint's manifest and the node's log (60 characters)
    policy: str  # the policy that queued it


class CheckpointArgs(_Why, total=False):
    job: str
    kind: str  # the job's source on its node: daemon | slurm | kubernetes | ...
    leave_running: bool
    label: str | None
    user: str | None
    # A migration's first half: stop it, then restore it there (or on or_on, in order).
    then_restore_on: str
    or_on: list[str]


class Alternate(TypedDict):
    node: str
    seal: dict[str, str] | None  # the seal the migration's source made for that node


# (functional form: `try` is a keyword) `try` (1 when absent): the tries on this node;
# `tried`: the nodes tried before it; `fence`: commit before resuming (registry: commit).
RestoreArgs = TypedDict(
    "RestoreArgs",
    {
        "reason": str,
        "policy": str,
        "checkpoint": str,
        "migrated_from": str,  # the checkpoint command that took it
        "job": str,
        "label": str | None,
        "user": str | None,
        "from_node": str,
        "seal": dict[str, str] | None,
        "alternates": list[Alternate],
        "fence": bool,
        "try": int,
        "tried": list[str],
    },
    total=False,
)


class DrainArgs(_Why, total=False):
    pass


class RetainArgs(_Why, total=False):
    label: str  # a pattern (fnmatch), "*" for all
    user: str | None
    keep: int | None
    older_than_s: int | None
    completed: bool
    live: list[tuple[str, str]]  # (user, label) of jobs running on the cluster's other nodes


class VerifyArgs(_Why, total=False):
    checkpoint: str
    label: str
    user: str


Args = CheckpointArgs | RestoreArgs | DrainArgs | RetainArgs | VerifyArgs


class CommandResult(TypedDict, total=False):
    error: str
    permanent: bool
    next: str  # the command that follows it (a migration's restore, a retry)


class Command(TypedDict):
    """A command as the API shows it (the `lease` answer adds its `lease_id`)."""

    id: str
    cluster_id: str
    node: str
    kind: Kind
    args: dict[str, Any]
    state: State
    attempts: int
    lease_until: int | None
    result: dict[str, Any] | None
    created: str
    finished: str | None
    lease_id: NotRequired[str]


def kind_of(value: object) -> Kind | None:
    """`value` as a command kind, None for one this side does not know (a newer server's)."""
    return next((k for k in KINDS if k == value), None)
