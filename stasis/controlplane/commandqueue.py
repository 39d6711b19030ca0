"""The commands a control plane gives its nodes (the `commands` table): queued, leased to their
node, renewed while it works, committed (a restore's fence), answered, and failed when they
would otherwise hang (recover). A command moves only forward: queued -> leased -> done |
failed. Its table's SQL is here; what an answer does beside being recorded (a migration's next
half, a verdict kept, checkpoints marked deleted) goes through the public methods of
stasis.controlplane.migration, .nodes and .reports, in the answer's transaction."""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection, case, insert, select, update

from stasis.controlplane import events as event_log
from stasis.controlplane import migration, wire
from stasis.controlplane.access import Principal, iso_now, stamp, validate_name
from stasis.controlplane.commands import Args, Command, kind_of
from stasis.controlplane.commands import Kind as CommandKind
from stasis.controlplane.nodes import Nodes
from stasis.controlplane.reports import Reports
from stasis.controlplane.schema import commands
from stasis.errors import (
    ConflictError,
    NotFoundError,
    PermissionDeniedError,
    UsageError,
)

# A command leased this many times without an answer (its daemon dies carrying it out, each
# time) is failed rather than given out for ever.
MAX_LEASES = 5
# Leased only when nothing else waits: a checkpoint or a migration asked meanwhile goes first.
_LAST: tuple[CommandKind, ...] = ("verify",)
# Queued for a lost node, failed rather than kept for its return: a restore (re-targeted) and
# a verify (the policy that asked it picks again).
_NOT_WAITING: tuple[CommandKind, ...] = ("restore", "verify")


class _Raced(Exception):
    """A command's row changed between reading and failing it."""


class CommandQueue:
    """The commands of the nodes (who may lease them: stasis.controlplane.nodes)."""

    def __init__(self, nodes: Nodes, reports: Reports) -> None:
        self.nodes = nodes
        self.reports = reports
        self.db = nodes.db
        # Nodes are judged lost (recover) by their silence since this control plane started:
        # while it was down, nobody could be heard.
        self.started = int(time.time())
        self._answered: dict[
            CommandKind,
            Callable[[Connection, dict[str, Any], bool, dict[str, Any], float], dict[str, Any]],
        ] = {
            "checkpoint": self._checkpoint_answered,
            "restore": self._restore_answered,
            "verify": self._verify_answered,
            "retain": self._retain_answered,
            "drain": self._drain_answered,
        }

    def queue_for_node(self, cluster_id: str, node: str, kind: CommandKind, args: Args) -> Command:
        """A command for node `node`, which must not be pending."""
        with self.db.transaction() as conn:
            self.nodes.refuse_pending(conn, cluster_id, node)
            return shown(self.add(conn, cluster_id, node, kind, dict(args)))

    def add(
        self,
        conn: Connection,
        cluster_id: str,
        node: str,
        kind: CommandKind,
        args: dict[str, Any],
        delay_s: float = 0.0,
    ) -> dict[str, Any]:
        """A command queued in the transaction of `conn`, leased no sooner than `delay_s` from
        now (a retry's backoff): its row."""
        row = {
            "id": "cmd_" + secrets.token_hex(8),
            "cluster_id": cluster_id,
            "node": node,
            "kind": kind,
            "args": json.dumps(args),
            "state": "queued",
            "attempts": 0,
            "lease_until": math.ceil(time.time() + delay_s) if delay_s else None,
            "result": None,
            "created": stamp(),
            "finished": None,
        }
        conn.execute(insert(commands).values(**row))
        return row

    def _restores(self, conn: Connection) -> migration.QueueRestore:
        """How the migration queues its restores, in the transaction of `conn`."""

        def queue(cluster_id: str, node: str, args: dict[str, Any], delay_s: float) -> str:
            return str(self.add(conn, cluster_id, node, "restore", args, delay_s)["id"])

        return queue

    def lease(self, by: Principal, node: str, lease_s: float) -> Command | None:
        """The node's next command, leased to it for `lease_s` (None: nothing to do), with
        the lease's id: renewing and acknowledging quote it. Only the node itself leases its
        commands (its own credential)."""
        validate_name(node, "node name")
        by.node_only(node, "leasing a node's commands")
        now = int(time.time())
        # A queued command's lease_until, if any, is when it may be leased (a retry's backoff).
        free = (
            (commands.c.state == "queued")
            & (commands.c.lease_until.is_(None) | (commands.c.lease_until <= now))
        ) | ((commands.c.state == "leased") & (commands.c.lease_until < now))
        with self.db.transaction() as conn:
            if self.nodes.pending(conn, str(by.cluster_id), node):
                return None  # pending: nothing for it until an admin approves it
            for _ in range(5):  # another leaser may win a row between select and update
                # A verify (low priority) only when nothing else waits: a checkpoint or a
                # migration asked meanwhile goes first.
                row = conn.execute(
                    select(commands.c.id)
                    .where(commands.c.cluster_id == by.cluster_id, commands.c.node == node, free)
                    .order_by(
                        case((commands.c.kind.in_(_LAST), 1), else_=0),
                        commands.c.created,
                        commands.c.id,
                    )
                    .limit(1)
                ).first()
                if row is None:
                    return None
                lease_id = "lease_" + secrets.token_hex(12)
                n = conn.execute(
                    update(commands)
                    .where(commands.c.id == row.id, free)
                    .values(
                        state="leased",
                        lease_until=now + int(lease_s),
                        lease_id=lease_id,
                        attempts=commands.c.attempts + 1,
                    )
                ).rowcount
                if n:
                    got = (
                        conn.execute(select(commands).where(commands.c.id == row.id))
                        .mappings()
                        .first()
                    )
                    if got is None:
                        return None
                    leased = shown(dict(got))
                    leased["lease_id"] = lease_id
                    return leased
        return None

    def _held(
        self, conn: Connection, by: Principal, node: str, command_id: str, lease_id: str
    ) -> dict[str, Any]:
        """Command `command_id` of this node's, read for its lease holder: refused for
        another node's command (403), and for a lease that is not the command's current one
        (409). Its row (a done or failed one too: answered from its record)."""
        row = conn.execute(select(commands).where(commands.c.id == command_id)).mappings().first()
        if row is None or row["cluster_id"] != by.cluster_id:
            raise NotFoundError(f"no command {command_id[:40]} for this cluster")
        if row["node"] != node:
            raise PermissionDeniedError(
                f"command {command_id} is node {row['node']}'s, not "
                f"{node}'s: only the node it is for carries it out"
            )
        if row["state"] in ("done", "failed"):
            return dict(row)
        if row["state"] != "leased" or not lease_id or row["lease_id"] != lease_id:
            raise ConflictError(
                f"command {command_id} is not leased to node {node} under "
                f"lease {lease_id[:40] or '(none)'} (its lease ran out and it "
                "was leased again, or it was never leased): the node answers "
                "the lease it holds now"
            )
        return dict(row)

    def renew(
        self, by: Principal, node: str, command_id: str, lease_s: float, lease_id: str = ""
    ) -> wire.Renewed:
        """The lease of a command `node` is still carrying out, extended to `lease_s` from now
        (a long dump is not given out again while its node works on it): the node holding
        the lease only, quoting it."""
        validate_name(node, "node name")
        by.node_only(node, "renewing a command's lease")
        until = int(time.time()) + int(lease_s)
        with self.db.transaction() as conn:
            row = self._held(conn, by, node, command_id, lease_id)
            if row["state"] != "leased":
                raise NotFoundError(
                    f"command {command_id} was answered already "
                    f"({row['state']}): nothing to renew"
                )
            n = conn.execute(
                update(commands).where(*_under(command_id, lease_id)).values(lease_until=until)
            ).rowcount
        if not n:
            raise ConflictError(f"command {command_id} is no longer leased under {lease_id}")
        return {"id": command_id, "lease_until": until}

    def commit(
        self, by: Principal, node: str, command_id: str, lease_s: float, lease_id: str = ""
    ) -> wire.Committed:
        """The fence of a restore's resume: node `node`, holding restore `command_id`'s lease
        (quoting it), has the job's tree restored and stopped, and may resume it only on this
        answer. Yes while the command is still its lease: the command is marked committed (in
        its result, until answered), and from then on is never re-targeted (the job may run
        there). Refused (409) once the command was failed (the node found lost and the restore
        re-targeted, or given up): an event says the node was fenced, and the node kills its
        tree. One transaction decides between this and a re-target (recover)."""
        validate_name(node, "node name")
        by.node_only(node, "committing a restore")
        now = int(time.time())
        with self.db.transaction() as conn:
            row = self._held(conn, by, node, command_id, lease_id)
            if kind_of(row["kind"]) != "restore":
                raise UsageError(
                    f"command {command_id} is a {row['kind']}: only a restore is "
                    "committed before its job resumes"
                )
            n = 0
            if row["state"] == "leased":
                n = conn.execute(
                    update(commands)
                    .where(*_under(command_id, lease_id))
                    .values(
                        result=json.dumps({"committed": iso_now()}), lease_until=now + int(lease_s)
                    )
                ).rowcount
            if n:
                return {"id": command_id, "committed": True}
            got = (
                conn.execute(select(commands).where(commands.c.id == command_id)).mappings().first()
            )
            done = dict(got or row)
            why = _fenced(done, node)
            event_log.record(conn, done["cluster_id"], node, "command-fenced", why)
        raise ConflictError(why)

    def ack(
        self,
        by: Principal,
        command_id: str,
        ok: bool,
        result: dict[str, Any],
        lease_id: str = "",
        lost_after_s: float = float("inf"),
    ) -> Command:
        """The result of a command, from the node holding its lease (quoting it). A command
        moves only forward (queued -> leased -> done | failed): an answer to a done one is
        given its record, never applied again."""
        if by.kind != "node" or by.node is None:
            by.node_only("?", "acknowledging a command")
        assert by.node is not None
        with self.db.transaction() as conn:
            row = self._held(conn, by, by.node, command_id, lease_id)
            if row["state"] in ("done", "failed"):
                if row["state"] == "failed" and ok:
                    migration.late(conn, dict(row), result)
                return shown(dict(row))  # acknowledged twice: the first one stands
            args = json.loads(row["args"])
            kind = kind_of(row["kind"])
            if kind is not None:  # (a kind this side does not know: recorded as answered)
                result = self._answered[kind](conn, dict(row), ok, result, lost_after_s)
            n = conn.execute(
                update(commands)
                .where(*_under(command_id, lease_id))
                .values(
                    state="done" if ok else "failed",
                    result=json.dumps(result),
                    finished=iso_now(),
                    lease_until=None,
                )
            ).rowcount
            if not n:  # answered meanwhile by a concurrent request: that one stands
                raise ConflictError(f"command {command_id} was answered meanwhile")
            what = f"{row['kind']} {args.get('job') or args.get('label') or ''}".strip()
            event_log.record(
                conn,
                row["cluster_id"],
                row["node"],
                "command-done" if ok else "command-failed",
                f"{what} ({command_id}): "
                + (
                    json.dumps({k: v for k, v in result.items() if k != "next"})
                    if ok
                    else str(result.get("error"))
                ),
            )
            got = (
                conn.execute(select(commands).where(commands.c.id == command_id)).mappings().first()
            )
        return shown(dict(got or row))

    # What an answer to each kind of command does beside recording it (`ack`), in its
    # transaction: the result to record.

    def _checkpoint_answered(
        self, conn: Connection, row: dict[str, Any], ok: bool, result: dict[str, Any], _: float
    ) -> dict[str, Any]:
        if ok and json.loads(row["args"]).get("then_restore_on") and result.get("checkpoint"):
            return migration.restore_half(row, result, self._restores(conn))
        return result

    def _restore_answered(
        self,
        conn: Connection,
        row: dict[str, Any],
        ok: bool,
        result: dict[str, Any],
        lost_after_s: float,
    ) -> dict[str, Any]:
        if ok:
            return result
        return {
            **result,
            **migration.after_failed_restore(
                conn,
                row,
                str(result.get("error") or "failed"),
                bool(result.get("permanent")),
                lambda: self.nodes.ready(conn, row["cluster_id"], lost_after_s),
                self._restores(conn),
            ),
        }

    def _verify_answered(
        self, conn: Connection, row: dict[str, Any], ok: bool, result: dict[str, Any], _: float
    ) -> dict[str, Any]:
        if "verdict" in result:
            self.reports.keep_answered_verdict(
                conn,
                row["id"],
                row["cluster_id"],
                row["node"],
                json.loads(row["args"]).get("checkpoint"),
                result["verdict"],
            )
        return result

    def _retain_answered(
        self, conn: Connection, row: dict[str, Any], ok: bool, result: dict[str, Any], _: float
    ) -> dict[str, Any]:
        if ok and result.get("deleted"):
            self.reports.mark_deleted(conn, row["cluster_id"], [str(i) for i in result["deleted"]])
        return result

    def _drain_answered(
        self, conn: Connection, row: dict[str, Any], ok: bool, result: dict[str, Any], _: float
    ) -> dict[str, Any]:
        return result

    def recover(self, lost_after_s: float) -> int:
        """Commands that would otherwise hang, failed (and a migration's restore half
        re-targeted): a restore queued for, or leased by, a node that is lost; any command
        whose lease ran out on a lost node; any command leased MAX_LEASES times without an
        answer; a verify queued for a lost node (the policy that asked it picks again when
        the node is back, and meanwhile the label is not held up). A queued command of a lost
        node that is neither waits for it (its job is there). How many were failed."""
        now = int(time.time())
        failed = 0
        with self.db.transaction() as conn:
            silent = self.nodes.silent(conn, lost_after_s, self.started)
            rows = [
                dict(r)
                for r in conn.execute(
                    select(commands).where(
                        ((commands.c.state == "leased") & (commands.c.lease_until < now))
                        | ((commands.c.state == "queued") & commands.c.kind.in_(_NOT_WAITING))
                    )
                )
                .mappings()
                .all()
            ]
        for row in rows:
            lost = silent.get((row["cluster_id"], row["node"]))
            expired = row["state"] == "leased"
            if lost is not None and (expired or kind_of(row["kind"]) in _NOT_WAITING):
                why = f"node {row['node']} was lost (silent {lost} s) " + (
                    "while carrying it out" if expired else "before carrying it out"
                )
            elif expired and row["attempts"] >= MAX_LEASES:
                why = (
                    f"node {row['node']} leased it {row['attempts']} times without "
                    "answering (its daemon died carrying it out, or could not tell what "
                    "it had done, each time: see its log)"
                )
            else:
                continue
            try:
                self._fail_held(row, why, lost_after_s, lost is not None)
            except _Raced:
                continue  # answered or leased meanwhile: that stands
            failed += 1
        return failed

    def _fail_held(
        self, row: dict[str, Any], why: str, lost_after_s: float, node_lost: bool = False
    ) -> None:
        committed = (
            json.loads(row["result"] or "{}").get("committed") if row["state"] == "leased" else None
        )
        kind = kind_of(row["kind"])
        with self.db.transaction() as conn:
            if committed:
                # Its node may have resumed the job (commit): a re-target could run it twice.
                args = json.loads(row["args"])
                ckpt = str(args.get("checkpoint"))
                result = {
                    "committed": committed,
                    "error": (
                        f"{why}, after it had begun resuming checkpoint {ckpt} as job "
                        f"{args.get('job')} there (committed {committed}): not re-targeted, so "
                        f"that the job never runs twice; if node {row['node']} is gone for good, "
                        f"checkpoint {ckpt} is kept: `stasis restore {ckpt}` on a node of the "
                        "cluster"
                    ),
                }
                event_log.record(
                    conn,
                    row["cluster_id"],
                    row["node"],
                    "migration-failed",
                    f"restore ({row['id']}): {result['error']}",
                )
            elif kind == "restore":
                result = migration.after_failed_restore(
                    conn,
                    row,
                    why,
                    False,
                    lambda: self.nodes.ready(conn, row["cluster_id"], lost_after_s),
                    self._restores(conn),
                    node_gone=True,
                )
            else:
                # A lost node may only be cut off, its job running on: a restore by hand
                # elsewhere would run it twice.
                args = json.loads(row["args"])
                caution = (
                    (
                        f"; job {args['job']} may still run on node {row['node']} (cut off, "
                        "not stopped): restore it elsewhere only once that node is known "
                        "down"
                    )
                    if node_lost and kind == "checkpoint" and args.get("job")
                    else ""
                )
                newest = (
                    self.reports.newest_known(
                        conn, row["cluster_id"], args["label"], args.get("user")
                    )
                    if args.get("label") and kind != "verify"
                    else ""
                )
                result = {"error": why + newest + caution}
                event_log.record(
                    conn,
                    row["cluster_id"],
                    row["node"],
                    "command-failed",
                    f"{row['kind']} ({row['id']}): {result['error']}",
                )
            # Not if it was answered, leased again or committed since it was read.
            n = conn.execute(
                update(commands)
                .where(
                    commands.c.id == row["id"],
                    commands.c.state == row["state"],
                    commands.c.attempts == row["attempts"],
                    commands.c.result.is_(None)
                    if row["result"] is None
                    else commands.c.result == row["result"],
                )
                .values(
                    state="failed", result=json.dumps(result), finished=iso_now(), lease_until=None
                )
            ).rowcount
            if not n:
                raise _Raced()  # rolls back the restore queued in its place

    def command(self, by: Principal, command_id: str) -> Command:
        with self.db.transaction() as conn:
            row = (
                conn.execute(select(commands).where(commands.c.id == command_id)).mappings().first()
            )
        if row is None or (by.kind != "admin" and row["cluster_id"] != by.cluster_id):
            raise NotFoundError(f"no command {command_id}")
        return shown(dict(row))

    def commands_under_way(
        self, kind: CommandKind | None = None, created_since: float | None = None
    ) -> list[tuple[str, str, dict[str, Any]]]:
        """(cluster id, node, args) of each command queued or leased (of `kind`), and, with
        `created_since`, of each created since then whatever its state."""
        states: Any = commands.c.state.in_(("queued", "leased"))
        if created_since is not None:
            stamp = datetime.fromtimestamp(created_since, UTC).isoformat(timespec="microseconds")
            states = states | (commands.c.created >= stamp)
        q = select(commands.c.cluster_id, commands.c.node, commands.c.args).where(states)
        if kind is not None:
            q = q.where(commands.c.kind == kind)
        with self.db.transaction() as conn:
            rows = conn.execute(q).all()
        return [(c, n, json.loads(args)) for c, n, args in rows]

    def created_since(
        self, kind: CommandKind, since: str
    ) -> list[tuple[str, str, dict[str, Any], str]]:
        """(cluster id, node, args, created) of each command of `kind` created since `since`
        (ISO 8601), oldest first, whatever its state."""
        q = (
            select(commands.c.cluster_id, commands.c.node, commands.c.args, commands.c.created)
            .where(commands.c.kind == kind, commands.c.created >= since)
            .order_by(commands.c.created)
        )
        with self.db.transaction() as conn:
            rows = conn.execute(q).all()
        return [(r.cluster_id, r.node, json.loads(r.args), r.created) for r in rows]

    def list_commands(self, by: Principal) -> list[Command]:
        q = select(commands).order_by(commands.c.created, commands.c.id)
        if by.kind != "admin":
            q = q.where(commands.c.cluster_id == by.cluster_id)
        with self.db.transaction() as conn:
            return [shown(dict(r)) for r in conn.execute(q).mappings().all()]


def _under(command_id: str, lease_id: str) -> tuple[ColumnElement[bool], ...]:
    """Command `command_id`'s row while it is still leased under `lease_id`: what renew,
    commit and ack change, and only that (a lease given again since is not theirs)."""
    return (
        commands.c.id == command_id,
        commands.c.state == "leased",
        commands.c.lease_id == lease_id,
    )


def shown(row: dict[str, Any]) -> Command:
    """A command's row as the API shows it."""
    # The lease id is the lease holder's alone: only the lease answer carries it.
    return Command(
        id=row["id"],
        cluster_id=row["cluster_id"],
        node=row["node"],
        kind=row["kind"],
        args=json.loads(row["args"]),
        state=row["state"],
        attempts=row["attempts"],
        lease_until=row["lease_until"],
        result=json.loads(row["result"]) if row.get("result") else None,
        created=row["created"],
        finished=row["finished"],
    )


def _fenced(row: dict[str, Any], node: str) -> str:
    """One line: why node `node` may not resume the restore of command `row` (no longer its
    lease), and what became of it."""
    args = json.loads(row["args"])
    result = json.loads(row["result"] or "{}") if row["state"] != "leased" else {}
    what = (
        f"node {node} fenced: restore {row['id']} of checkpoint {args.get('checkpoint')} "
        f"(job {args.get('job')}) may not resume there: "
    )
    if row["state"] == "leased":
        return what + (
            "it is leased again under another lease; the node answers the lease " "it holds now"
        )
    if row["state"] == "done":
        return what + "it was answered already"
    nxt, error = result.get("next"), " ".join(str(result.get("error") or "").split())[:400]
    return (
        what
        + f"the control plane failed it meanwhile ({error})"
        + (f", re-targeted as {nxt}" if nxt and str(nxt) not in error else "")
        + "; its restored tree is killed unresumed, so that the job runs once"
    )
