"""A migration, from start to end: its checkpoint half (a checkpoint command that stops the job,
`then_restore_on` a target and sealed by its node for `or_on` alternates), then its restore
half on the target, retried and re-targeted until it is done or given up. What each answer
moves it to is decided here, one step at a time:

    checkpoint done          -> restore queued on the target, try 1 (restore_half)
    checkpoint failed        -> over: the job goes on where it was
    restore failed           -> the same node again after a backoff, while tries are left
                                (RESTORE_TRIES_PER_NODE; a lost node is not tried again)
                             -> else the next alternate that is ready and was not tried
                             -> else over: failed, naming the checkpoint it leaves
    restore refused          -> over (`permanent`: no retry changes a refusal)
    restore done             -> over: the job runs on its new node

`next_try` is that decision, on what is known (pure); `after_failed_restore` reads what it
needs and applies it (a new restore command, an event). The command queue
(stasis.controlplane.commandqueue) calls these from `ack` and `recover`, in its transaction,
handing in how to queue a restore and which nodes are ready: no SQL of its own here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from stasis.controlplane import events as event_log
from stasis.controlplane.commands import Alternate, RestoreArgs, kind_of
from stasis.controlplane.commands import Kind as CommandKind
from stasis.controlplane.verdicts import CHECKPOINT_ID
from stasis.errors import UsageError

# A migration's restore half that fails is tried again on its node after a backoff (doubled at
# each try, at most RETRY_BACKOFF_MAX_S), then on the other ready nodes its source sealed it
# for (ALTERNATES at most), then reported failed naming the checkpoint it leaves.
RESTORE_TRIES_PER_NODE = 2
RETRY_BACKOFF_S = 1.0
RETRY_BACKOFF_MAX_S = 60.0
ALTERNATES = 3

# Queues a restore in the caller's transaction: (cluster id, node, args, delay_s) -> its id.
QueueRestore = Callable[[str, str, dict[str, Any], float], str]


@dataclass(frozen=True)
class Again:
    """The restore once more, as a new command: on `node`, with `args`, after `delay_s`."""

    node: str
    args: dict[str, Any]
    delay_s: float
    how: str  # said in the failed one's result and the event


def restore_half(
    row: dict[str, Any], result: dict[str, Any], queue_restore: QueueRestore
) -> dict[str, Any]:
    """The second half of the migration whose checkpoint half `row` answered `result`: the
    restore, on the target node, of the checkpoint it took, bound to the job, label and owner
    it was for. The checkpoint's result, naming the restore as `next`."""
    args = json.loads(row["args"])
    ckpt = str(result["checkpoint"])
    # (its target made pending meanwhile: queued all the same, it waits in the queue, never
    # leased, until an admin approves that node)
    if not re.fullmatch(CHECKPOINT_ID, ckpt):
        raise UsageError(f"bad checkpoint id {ckpt[:64]!r} in the result")
    seals: dict[str, Any] = result["seals"] if isinstance(result.get("seals"), dict) else {}
    alternates: list[Alternate] = [
        {"node": str(n), "seal": _seal_of({"seal": seals.get(n)})}
        for n in list(args.get("or_on") or [])[:ALTERNATES]
        if isinstance(seals.get(n), dict)
    ]
    # (`try`, 1 when absent, counts the tries on its node; `alternates`: where the restore
    # goes next, with the seal its source made for each)
    restore: RestoreArgs = {
        "checkpoint": ckpt,
        "migrated_from": row["id"],
        "job": args["job"],
        "label": args.get("label"),
        "user": args.get("user"),
        "from_node": row["node"],
        "seal": _seal_of(result),
    }
    if alternates:
        restore["alternates"] = alternates
    nid = queue_restore(row["cluster_id"], args["then_restore_on"], _fenced(dict(restore)), 0.0)
    return {**{k: v for k, v in result.items() if k != "seals"}, "next": nid}


def _fenced(args: dict[str, Any]) -> dict[str, Any]:
    """A restore's args with `fence`: the node commits before resuming (commit); a node older
    than fencing ignores it, and a node never asks a control plane that does not set it."""
    return {**args, "fence": True}


def next_try(args: dict[str, Any], node: str, ready: set[str], node_gone: bool) -> Again | None:
    """Where the failed restore half `args` (on `node`) goes next, None for nowhere: its node
    again while tries are left there (not a node lost), else the next alternate that is ready
    and was not tried."""
    tries = int(args.get("try") or 1)
    tried = [*list(args.get("tried") or [])[:20], node]
    if not node_gone and tries < RESTORE_TRIES_PER_NODE:
        delay = min(RETRY_BACKOFF_S * 2 ** (tries - 1), RETRY_BACKOFF_MAX_S)
        return Again(
            node, {**args, "try": tries + 1}, delay, f"tried again on node {node} in {delay:.0f} s"
        )
    alternates = list(args.get("alternates") or [])
    while alternates:
        alt = alternates.pop(0)
        if alt.get("node") in ready and alt.get("node") not in tried:
            return Again(
                str(alt["node"]),
                {
                    **args,
                    "seal": alt.get("seal"),
                    "try": 1,
                    "alternates": alternates,
                    "tried": tried,
                },
                0.0,
                f"re-targeted to node {alt['node']}",
            )
    return None


def after_failed_restore(
    conn: Connection,
    row: dict[str, Any],
    error: str,
    permanent: bool,
    ready_nodes: Callable[[], set[str]],
    queue_restore: QueueRestore,
    node_gone: bool = False,
) -> dict[str, Any]:
    """What follows a migration's restore half `row` that failed with `error` (next_try): a
    new command (its id: `next` in the failed one's result), or the failure, naming the
    checkpoint it leaves. A refusal (`permanent`) is not retried; a node lost (`node_gone`) is
    not tried again. `ready_nodes`: the nodes of its cluster ready now."""
    args = json.loads(row["args"])
    error = " ".join(error.split())[:1000]
    ckpt = str(args.get("checkpoint"))
    if not args.get("migrated_from") or permanent:
        # Not a migration's (refused by the node anyway), or refused: the node's own line
        # says what and why, retrying changes nothing.
        return {"error": error}
    ready = (
        ready_nodes() if node_gone or int(args.get("try") or 1) >= RESTORE_TRIES_PER_NODE else set()
    )
    again = next_try(args, row["node"], ready, node_gone)
    what = (
        f"restore of checkpoint {ckpt} (migration {args['migrated_from']}, job "
        f"{args.get('job')}) on node {row['node']} failed: {error}"
    )
    if again is None:
        tried = [*list(args.get("tried") or [])[:20], row["node"]]
        final = (
            f"{what}; checkpoint {ckpt} is kept and restored nowhere (tried on "
            f"{', '.join(tried)}): restore it with `stasis restore {ckpt}` on a node "
            "of the cluster, or migrate again"
        )
        event_log.record(conn, row["cluster_id"], row["node"], "migration-failed", final)
        return {"error": final}
    nid = queue_restore(row["cluster_id"], again.node, _fenced(again.args), again.delay_s)
    event_log.record(
        conn, row["cluster_id"], row["node"], "migration-retry", f"{what}; {again.how} ({nid})"
    )
    return {"error": f"{what}; {again.how} ({nid})", "next": nid}


def late(conn: Connection, row: dict[str, Any], result: dict[str, Any]) -> None:
    """A node's success, heard after its command was failed (the node was lost): said (for a
    migration's halves: what it means for the job)."""
    kind = kind_of(row["kind"])
    said = _LATE.get(kind) if kind is not None else None
    if said is not None:
        said(conn, row, result)


def _late_restore(conn: Connection, row: dict[str, Any], result: dict[str, Any]) -> None:
    failed = json.loads(row["result"] or "{}")
    if result.get("job"):
        job = str(result["job"])[:100]
        if failed.get("committed"):
            # Committed before the node was lost: never re-targeted (recover).
            event_log.record(
                conn,
                row["cluster_id"],
                row["node"],
                "command-late",
                f"restore {row['id']} was failed after node {row['node']} had "
                f"begun resuming it (committed): that node restored it as job "
                f"{job}, which runs there, once (it was not re-targeted)",
            )
        else:
            # Only a node without fencing (an older stasis) resumes a restore that was
            # not committed: the re-targeted one may run too.
            event_log.record(
                conn,
                row["cluster_id"],
                row["node"],
                "command-late",
                f"restore {row['id']} was failed and re-targeted while node "
                f"{row['node']} was away, and that node restored it as job {job} "
                "all the same, uncommitted (a node older than fencing): the job "
                "may run twice; kill one (`stasis controlplane jobs`)",
            )


def _late_checkpoint(conn: Connection, row: dict[str, Any], result: dict[str, Any]) -> None:
    if result.get("checkpoint"):
        args = json.loads(row["args"])
        stopped = not args.get("leave_running", True)
        event_log.record(
            conn,
            row["cluster_id"],
            row["node"],
            "command-late",
            f"checkpoint {row['id']} of job {str(args.get('job'))[:100]} was "
            f"failed (node {row['node']} lost or silent), and that node took "
            f"checkpoint {str(result['checkpoint'])[:64]} all the same"
            + (
                ", stopping the job: it runs nowhere now (no restore was queued); "
                f"`stasis restore {str(result['checkpoint'])[:64]}` on a node of "
                "the cluster resumes it"
                if stopped
                else ""
            ),
        )


_LATE: dict[CommandKind, Callable[[Connection, dict[str, Any], dict[str, Any]], None]] = {
    "restore": _late_restore,
    "checkpoint": _late_checkpoint,
}


def _seal_of(result: dict[str, Any]) -> dict[str, str] | None:
    """The seal a migration's checkpoint half answered with (the node that took it MACs what
    it took; the restoring node checks it, stasis.controlplane.node), carried as it came."""
    seal = result.get("seal")
    if not isinstance(seal, dict):
        return None
    return {str(k)[:40]: str(v)[:100] for k, v in list(seal.items())[:4]}
