"""The node side of the control plane: a daemon integration that joins this node to the control
plane its settings name (`controlplane_url`, `auth_token`, `cluster_id`). It connects out, never
listens: it registers (host, versions, `stasis check`), then heartbeats every
`controlplane_heartbeat_s` with its live jobs, and takes the commands queued for it: leased,
carried out, acknowledged. What it did is kept by command id in the daemon's database (table
`controlplane_done`) before it is acknowledged, so a command leased again (the acknowledgement
was lost: the connection dropped, the control plane restarted) is answered, not done twice.
The intents, the answers not yet acknowledged and the migrations restored are kept as files
too (stasis.daemon.records): a corrupt database is rebuilt with them (the outbox is not: it
only informs).
Commands run one at a time in a worker thread of their own, never in the heartbeat: a dump that
takes minutes does not silence the node (it would be shown lost), and every heartbeat renews
the lease of the command under way, so it is not given out again while the node works on it.
Registered again whenever the control plane no longer knows the node. The token is never logged.

Identity: the cluster's token (`auth_token`) only joins. Joining answers with the node's own
credential, kept in `<state_dir>/controlplane-node.json` (0600, root's, bound to the control
plane's URL, the cluster and the node name); every later request carries that credential, and
the control plane lets it lease, renew and acknowledge only this node's commands, quoting the
lease. A credential the control plane no longer knows (an admin reset the node) is dropped and
the node joins again with the cluster token.

A restore command is carried out only as the second half of a migration, for the checkpoint
that migration took, never for an arbitrary id: the node that took it answers the checkpoint
half with a seal, a MAC with its signing key (the site key) over (migration command, checkpoint,
job, target node), which the target verifies with the keys it trusts for manifests; the
checkpoint's signed manifest must also name the migration's job, label and owner. Whoever holds
no such key (a stolen cluster token, a node joined with it) cannot make one. A seal is carried
out once: the migrations this node restored are kept in its database (`controlplane_restored`),
and a seal given again under another command id is refused, naming the job it became.

Fencing: a restore's tree is resumed only once the control plane committed it (the command's
`fence`): restored and stopped at the daemon's gate (stasis.daemon.restoring), the node asks
POST .../commands/{id}/commit quoting its lease, and resumes only on a yes; from then on the
control plane never re-targets that restore. A node cut off past `--lost-after` whose restore
was failed and re-targeted meanwhile is refused (fenced): its tree is killed unresumed, and the
job runs once, where it was re-targeted. A control plane it cannot reach within
`controlplane_commit_timeout_s` is no yes either: the tree is killed, the checkpoint stays, and the restore is
retried or re-targeted as any failed one.

A verify command (a `verify` policy's: stasis.controlplane.policies) names one checkpoint: the
node answers with the verdict the store holds for it already (signed, a background
verification's), else runs `stasis verify` on it in a thread of its own at the lowest CPU
priority and idle I/O (stasis.daemon.verifying), between its other commands (one at a time,
like them). The verdict goes back in the command's result; every verdict the node reaches (the
background ones of `verify_new_checkpoints` too) goes in its heartbeats (`verdicts`), as its
checkpoints do (`activity`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict
from importlib.metadata import version
from typing import Any, cast

from sqlalchemy import (
    Boolean,
    Column,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    delete,
    func,
    insert,
    select,
    update,
)

from stasis import faults, wire
from stasis.atomicfile import write_atomically
from stasis.controlplane import commands
from stasis.controlplane import wire as wire_cp
from stasis.controlplane.client import ControlPlaneClient
from stasis.daemon import records
from stasis.daemon.activity import Activity
from stasis.daemon.integration import Integration, Task
from stasis.daemon.jobs import JobManager
from stasis.daemon.users import Caller
from stasis.errors import (
    NotFoundError,
    PermissionDeniedError,
    StasisError,
    StoreError,
    UnauthenticatedError,
    UsageError,
)

log = logging.getLogger("stasis.daemon")
_ROOT = Caller(pid=0, uid=0, gid=0)
# Every this many heartbeats the node's check runs again and is reported (a register).
_CHECK_EVERY = 30
_ALIVE = ("running", "restored")
CREDENTIAL_FILE = "controlplane-node.json"
SEAL_PURPOSE = "controlplane-migration"  # what a migration's seal MACs (never a manifest)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,99}")
_CHECKPOINT = r"[A-Za-z0-9._-]{1,64}"  # a checkpoint id, as the store has them

# What the node did (stasis.daemon.activity) until a heartbeat has carried it to the control
# plane: kept here so that a control plane that is down for a while still hears of it all.
outbox_table = Table(
    "controlplane_outbox",
    MetaData(),
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("body", Text, nullable=False),  # JSON of an Activity
)
_OUTBOX_MAX = 10_000  # beyond that the oldest are dropped: a control plane gone for days
_PER_BEAT = 500

done_table = Table(
    "controlplane_done",
    MetaData(),
    Column("command_id", String(40), primary_key=True),
    Column("ok", Boolean, nullable=False),
    Column("result", Text, nullable=False),
    Column("at", Integer, nullable=False),
    info={records.KEY: records.UNTIL_DROPPED},  # its file until the control plane took it
)

# The migrations whose sealed restore half this node carried out (or began: `job` is None until
# the restore is done), kept for good in the daemon's own database (root's, 0600): a seal
# replayed under a new command id (a compromised control plane, a command copied) is answered
# from here, never restored twice. Bounded: beyond _RESTORED_MAX the rows of the oldest
# checkpoints go, and the newest creation time among them stays as the row _WATERMARK, under
# which a seal is refused unseen (its checkpoint's signed manifest says when it was taken).
restored_table = Table(
    "controlplane_restored",
    MetaData(),
    Column("migration", String(100), primary_key=True),
    Column("checkpoint", String(100), nullable=False),
    Column("job", String(100), nullable=True),
    Column("created", Float, nullable=False),  # the checkpoint's, from its signed manifest
    Column("at", Integer, nullable=False),
    info={records.KEY: records.ALL},
)
_RESTORED_MAX = 100_000

# The intent of each command this node began carrying out, written before it acts and gone
# with the command's record in controlplane_done: a command leased again after this daemon
# died carrying it out is answered from what was done (the checkpoint already taken, the job
# already restored) instead of being done again (a stopped job checkpointed twice fails "not
# running", a migration restored twice runs twice).
intent_table = Table(
    "controlplane_intent",
    MetaData(),
    Column("command_id", String(40), primary_key=True),
    Column("kind", String(40), nullable=False),
    Column("job", String(100), nullable=False),  # the job (checkpoint) or migration (restore)
    Column("at", Float, nullable=False),  # time.time() before acting, this node's own clock
    info={records.KEY: records.ALL},
)
_WATERMARK = "(forgotten before)"
# Each try of a restore's commit (the whole wait: controlplane_commit_timeout_s).
_COMMIT_TRY_S = 5.0
_INTENT_KEPT_S = 7 * 86400
_ALTERNATES = 3  # nodes beside the target a migration's checkpoint half seals for


class FencedError(PermissionDeniedError):
    """The control plane refused a restore's commit: the command is no longer this node's (it
    was failed and re-targeted while the node was cut off)."""


class _Unanswered(StoreError):
    """A command that cannot be answered now: what was done is unknown until the store is back
    (it is leased again, and answered from what is found then)."""


class UnconfirmedError(StasisError):
    """The control plane could not be asked for a restore's commit within the bound."""


class ControlPlaneNode(Integration):
    name = "controlplane"

    def __init__(self, manager: JobManager) -> None:
        super().__init__(manager)
        s = manager.settings
        self.client: ControlPlaneClient | None = None
        if s.controlplane_url:
            try:
                self.client = ControlPlaneClient(
                    s.controlplane_url,
                    s.auth_token,
                    timeout_s=10,
                    allow_plain_http=s.controlplane_allow_plain_http,
                )
            except UsageError as e:  # the node goes on protecting its jobs, unjoined
                log.error("not joining the control plane: %s", e)
        self._credential_path = s.state_dir / CREDENTIAL_FILE
        self._records = records.Records(manager.db, s.layout.records)
        self._credential: str | None = None
        if self.client is not None:
            self._credential = self._load_credential()
            if self._credential is not None:
                self.client.token = self._credential
        self._beats = 0
        self._unready: list[str] = []  # the readiness problems last reported
        self._registered = False
        self._failing: str | None = None
        self._pending_said = False
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        # The command under way and its lease id (the lease is renewed with it).
        self._current: tuple[str, str] | None = None
        self._worker_failing: str | None = None
        self._unleased: str | None = None
        self._closing = False
        self._no_verdicts_said = False  # an older control plane refused them (said once)
        # How each kind of command is carried out (stasis.controlplane.commands).
        self._carry: dict[
            commands.Kind,
            Callable[[commands.Command, str, float | None], tuple[bool, dict[str, Any]]],
        ] = {
            "checkpoint": self._checkpoint,
            "restore": self._restore,
            "drain": self._drain,
            "retain": self._retain_command,
            "verify": self._verify_command,
        }

    def tables(self) -> Sequence[Table]:
        return [done_table, outbox_table, restored_table, intent_table]

    # -- the node's own credential ----------------------------------------------------------

    def _bound_to(self) -> dict[str, str]:
        s = self.manager.settings
        assert self.client is not None
        return {"url": self.client.url, "cluster_id": s.cluster_id, "node": s.node}

    def _load_credential(self) -> str | None:
        """The credential this node got when it joined, if it was for this control plane,
        cluster and name; a file that is not root's alone is not trusted (and said so)."""
        try:
            fd = os.open(self._credential_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning(
                "control plane: cannot read %s (%s): joining with the cluster token",
                self._credential_path,
                e.strerror,
            )
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                log.warning(
                    "control plane: %s is not %d's alone (mode %o): ignored, joining "
                    "with the cluster token",
                    self._credential_path,
                    os.geteuid(),
                    st.st_mode & 0o777,
                )
                return None
            try:
                kept = json.loads(f.read(4096))
            except ValueError:
                return None
        if (
            not isinstance(kept, dict)
            or not isinstance(kept.get("token"), str)
            or {k: kept.get(k) for k in ("url", "cluster_id", "node")} != self._bound_to()
        ):
            return None
        return str(kept["token"])

    def _keep_credential(self, token: str) -> None:
        """Written new (0600, no link followed), then renamed over the old one."""
        write_atomically(
            self._credential_path, json.dumps({**self._bound_to(), "token": token}).encode()
        )

    def _forget_credential(self) -> None:
        assert self.client is not None
        self._credential = None
        self.client.token = self.manager.settings.auth_token
        try:
            self._credential_path.unlink()
        except FileNotFoundError:
            pass

    def _register(self) -> None:
        """Joins with the cluster token (and keeps the credential it answers with), or
        reports itself again with its credential."""
        assert self.client is not None
        joined = self.client.register(cast(wire_cp.NodeReport, self.report()))
        token = joined.get("node_token") if isinstance(joined, dict) else None
        if self._credential is None and isinstance(token, str):
            self._keep_credential(token)
            self._credential = token
            self.client.token = token
            log.info(
                "got this node's own credential from the control plane (kept in %s)",
                self._credential_path,
            )
        pending = isinstance(joined, dict) and joined.get("approved") is False
        if pending and not self._pending_said:
            # said once while it stays pending: it heartbeats, but leases no command
            log.warning(
                "joined the control plane, pending: an admin approves this node "
                "(`stasis controlplane nodes approve %s`) before it is given commands",
                self.manager.settings.node,
            )
        self._pending_said = pending

    def prepare(self) -> None:
        if self.client is not None:
            self.manager.activity.add(self._heard)
            # Every verdict this node reaches, a command's or a background one's.
            self.manager.verifier.listeners.append(self._verdict_heard)

    def _heard(self, activity: Activity) -> None:
        self._to_outbox(asdict(activity))

    def _verdict_heard(self, verdict: wire.VerifyVerdict) -> None:
        self._to_outbox({"kind": "verify", **verdict})

    def _to_outbox(self, body: dict[str, Any]) -> None:
        with self.manager.db.transaction() as conn:
            conn.execute(insert(outbox_table).values(body=json.dumps(body)))
            newest = conn.execute(select(func.max(outbox_table.c.id))).scalar() or 0
            conn.execute(delete(outbox_table).where(outbox_table.c.id <= newest - _OUTBOX_MAX))

    def _outbox(self) -> tuple[list[int], list[dict[str, Any]]]:
        with self.manager.db.transaction() as conn:
            rows = conn.execute(
                select(outbox_table).order_by(outbox_table.c.id).limit(_PER_BEAT)
            ).all()
        return [r.id for r in rows], [json.loads(r.body) for r in rows]

    @staticmethod
    def _report_of(outbox: list[dict[str, Any]]) -> dict[str, Any]:
        """What a heartbeat carries of the outbox: checkpoints and restores as `activity`,
        the verdicts of `stasis verify` as `verdicts` (only when there are some: a control
        plane from before them refuses the key)."""
        verdicts = [
            {k: v for k, v in a.items() if k != "kind"} for a in outbox if a.get("kind") == "verify"
        ]
        return {
            "activity": [a for a in outbox if a.get("kind") != "verify"],
            **({"verdicts": verdicts} if verdicts else {}),
        }

    def _sent(self, ids: list[int]) -> None:
        if ids:
            with self.manager.db.transaction() as conn:
                conn.execute(delete(outbox_table).where(outbox_table.c.id.in_(ids)))

    def tasks(self) -> Sequence[Task]:
        if self.client is None:
            return ()
        return [
            Task(
                "report to the control plane",
                self.manager.settings.controlplane_heartbeat_s,
                self.beat,
            )
        ]

    def report(self) -> dict[str, Any]:
        from stasis.engine.check import run_check

        s = self.manager.settings
        check = run_check(s)
        unready = self._readiness()
        self._unready = unready
        return {
            "name": s.node,
            "cluster_id": s.cluster_id or None,
            "host": socket.gethostname(),
            "stasis_version": version("stasis"),
            "criu_version": check["criu_version"],
            "slurm_version": _slurm_version(),
            "check_ok": check["ok"] and not unready,
            "problems": (unready + [f"{p['what']} ({p['fix']})" for p in check["problems"]])[:50],
            "jobs": sum(1 for j in self._jobs() if j["state"] == "running"),
        }

    def _readiness(self) -> list[str]:
        """Why the daemon cannot protect jobs now (its database unusable, its journal not
        settled...), one line each; [] when it can. Reported as the node's problems, which
        makes it not ready: no migration, drain or policy targets it."""
        try:
            found = self.manager.readiness_problems()[:20]
        except StasisError as e:
            return [f"the daemon cannot tell whether it can protect jobs: {e}"]
        # Each a problem as `stasis check` has them (what, and how to fix it), said as it says
        # the check's.
        return [" ".join(f"{p['what']} ({p['fix']})".split())[:1000] for p in found]

    def _jobs(self) -> list[dict[str, Any]]:
        mine = [
            {
                "job": j["job"],
                "label": j["label"],
                "user": j["user"],
                "state": j["state"],
                "restored_from": j["checkpoint"],
                "started": j["created"],
                "kind": "daemon",
                "partition": None,
                "rss_bytes": _rss(j["pid"]),
            }
            for j in self.manager.jobs(_ROOT)
            if j["state"] in _ALIVE
        ]
        theirs: list[dict[str, Any]] = [dict(j) for j in self.manager.reported_jobs()]
        if theirs:
            shown = self._intervals()
            for j in theirs:
                i = shown.get(str(j["job"]))
                if i is not None:
                    j["interval_s"] = i["interval_s"]
                    j["interval_why"] = " ".join(i["why"].split())[:500]
        return mine + theirs

    def _intervals(self) -> dict[str, wire.JobInterval]:
        """Each periodic job's interval and why, as `stasis ps` shows them: the daemon's own
        GET /intervals (it gathers every integration's; this one sees no other), asked as root
        over its socket. None while it cannot answer (the heartbeat goes on without them)."""
        from stasis.client import Client

        try:
            with Client(self.manager.settings.socket, timeout_s=5) as c:
                return {i["job"]: i for i in c.intervals()}
        except (StasisError, OSError) as e:
            log.debug("control plane: no job intervals this heartbeat: %s", e)
            return {}

    def _scheduler_state(self) -> str | None:
        """The state of this node in the first scheduler that knows it (Slurm says "" on a
        Kubernetes node, and the other way round)."""
        for source in self.manager.job_sources():
            if source.state is not None:
                try:
                    state = source.state()[:60]
                except StasisError:
                    continue
                if state:
                    return state
        return None

    def _drains(self) -> list[Callable[[str], dict[str, object]]]:
        """The drains of the schedulers that know this node."""
        found = []
        for source in self.manager.job_sources():
            if source.drain is None or source.state is None:
                continue
            try:
                if source.state():
                    found.append(source.drain)
            except StasisError:
                continue
        return found

    def beat(self) -> None:
        assert self.client is not None
        try:
            # A change in readiness is reported at once (a register), not at the next check.
            if (
                not self._registered
                or self._beats % _CHECK_EVERY == 0
                or self._readiness() != self._unready
            ):
                self._register()
                if not self._registered:
                    log.info(
                        "joined the control plane at %s as node %s",
                        self.client.url,
                        self.manager.settings.node,
                    )
                self._registered = True
            else:
                ids, outbox = self._outbox()
                body = {
                    "jobs": self._jobs(),
                    **self._report_of(outbox),
                    "mem_total_bytes": _mem_total(),
                    "scheduler_state": self._scheduler_state(),
                }
                node = self.manager.settings.node
                try:
                    self.client.heartbeat(node, cast(wire_cp.Heartbeat, body))
                except UsageError as e:
                    if "verdicts" not in body or "verdicts" not in str(e):
                        raise
                    # A control plane older than verdicts refuses the key: the node is not
                    # to look lost to it for that. Its verdicts are dropped, said once.
                    if not self._no_verdicts_said:
                        log.warning(
                            "control plane: it takes no verdicts of `stasis verify` "
                            "(%s): this node's are not reported to it",
                            e,
                        )
                        self._no_verdicts_said = True
                    self.client.heartbeat(
                        node,
                        cast(wire_cp.Heartbeat, {k: v for k, v in body.items() if k != "verdicts"}),
                    )
                self._sent(ids)
            self._beats += 1
            self._renew()
            self._start_worker()
            if self._failing is not None:
                log.info("the control plane answers again")
                self._failing = None
        except NotFoundError:
            self._registered = False  # it forgot us: register at the next beat
        except UnauthenticatedError as e:
            if self._credential is not None:
                # Reset by an admin, or a control plane that lost it: join again.
                log.info(
                    "control plane: this node's credential is no longer known (%s): "
                    "joining again with the cluster token",
                    e,
                )
                self._forget_credential()
                self._registered = False
            elif str(e) != self._failing:
                log.warning("control plane: %s", e)
                self._failing = str(e)
        except StasisError as e:
            if str(e) != self._failing:  # once per new problem, not every heartbeat
                log.warning("control plane: %s", e)
                self._failing = str(e)

    def close(self) -> None:
        self._closing = True  # the command under way ends; no other is leased

    def _renew(self) -> None:
        assert self.client is not None
        with self._lock:
            current = self._current
        if current is None:
            return
        command_id, lease_id = current
        try:
            self.client.renew(self.manager.settings.node, command_id, {"lease_id": lease_id})
        except UsageError:
            # Acknowledged meanwhile, or its lease ran out (the control plane was away): it
            # is answered from controlplane_done if it comes again.
            if self._unleased != command_id:
                log.info("control plane command %s is no longer leased to this node", command_id)
                self._unleased = command_id

    def _start_worker(self) -> None:
        if self._closing or (self._worker is not None and self._worker.is_alive()):
            return
        self._worker = threading.Thread(
            target=self._commands, name="controlplane commands", daemon=True
        )
        self._worker.start()

    def _commands(self) -> None:
        """The worker: every command queued for this node, one after another, until none is
        left (the next heartbeat starts it again)."""
        assert self.client is not None
        try:
            while not self._closing:
                if self._credential is None:
                    break  # not joined yet: the cluster token leases nothing
                cmd = self.client.lease(self.manager.settings.node)
                if cmd is None:
                    break
                lease_id = str(cmd.get("lease_id") or "")
                with self._lock:
                    self._current = (cmd["id"], lease_id)
                try:
                    ok, result = self._done(cmd["id"]) or self._carry_out(cmd)
                finally:
                    with self._lock:
                        self._current = None
                faults.point("cp.before-ack")
                self.client.ack(cmd["id"], {"lease_id": lease_id, "ok": ok, "result": result})
                self._records.drop(done_table, cmd["id"])  # taken: never leased again
            self._worker_failing = None
        except NotFoundError:
            self._registered = False  # it forgot us: register at the next beat
        except StasisError as e:
            # Not acknowledged: the command is leased again once its lease runs out and
            # answered from what was kept.
            if str(e) != self._worker_failing:
                log.warning("control plane commands: %s", e)
                self._worker_failing = str(e)

    def _done(self, command_id: str) -> tuple[bool, dict[str, Any]] | None:
        with self.manager.db.transaction() as conn:
            row = conn.execute(
                select(done_table).where(done_table.c.command_id == command_id)
            ).first()
        if row is None:
            return None
        log.info("control plane command %s was carried out already: answered again", command_id)
        return bool(row.ok), json.loads(row.result)

    def _carry_out(self, cmd: commands.Command) -> tuple[bool, dict[str, Any]]:
        import time

        ok = False
        result: dict[str, Any] = {"error": f"unknown command {cmd['kind']!r}"}
        args = cmd["args"]
        reason = str(
            args.get("reason")
            or (f"policy {args['policy']}" if args.get("policy") else "control plane")
        )[:60]
        began = self._intend(cmd)
        faults.point("cp.after-lease")
        kind = commands.kind_of(cmd["kind"])
        if kind is not None:
            try:
                ok, result = self._carry[kind](cmd, reason, began)
            except _Unanswered:
                raise
            except StasisError as e:
                ok, result = False, {"error": str(e)}
        log.info(
            "control plane command %s (%s): %s",
            cmd["id"],
            cmd["kind"],
            "done" if ok else result["error"],
        )
        with self.manager.db.transaction() as conn:
            conn.execute(
                insert(done_table).values(
                    command_id=cmd["id"], ok=ok, result=json.dumps(result), at=int(time.time())
                )
            )
            conn.execute(delete(intent_table).where(intent_table.c.command_id == cmd["id"]))
        self._records.refresh(done_table, cmd["id"])
        self._records.refresh(intent_table, cmd["id"])
        return ok, result

    def _checkpoint(
        self, cmd: commands.Command, reason: str, began: float | None
    ) -> tuple[bool, dict[str, Any]]:
        from stasis.daemon.models import DumpRequest

        args = cast(commands.CheckpointArgs, cmd["args"])
        job, leave = str(args["job"]), bool(args.get("leave_running", True))
        kind = str(args.get("kind") or "daemon")
        try:
            # Leased again after this daemon died carrying it out: the checkpoint it took
            # then, if the job did not run on since (a stop asked: the job is gone).
            # The store unreachable here is not "none taken": the command stays
            # unanswered (StoreError) and comes back.
            taken = (
                self._taken_since(job, began) if began is not None and kind == "daemon" else None
            )
            if taken is not None and (leave or not self._alive(job)):
                log.info(
                    "control plane command %s: checkpoint %s was taken before the "
                    "daemon stopped: answered with it",
                    cmd["id"],
                    taken["checkpoint"],
                )
                answer = taken
            elif kind == "daemon":
                answer = dict(
                    self.manager.dump(job, DumpRequest(leave_running=leave, reason=reason), _ROOT)
                )
            else:  # a scheduler's job: stopped means requeued
                answer = self.manager.job_source(kind).checkpoint(job, leave, reason)
            faults.point("cp.after-checkpoint")
            result: dict[str, Any] = {
                k: answer[k]
                for k in ("checkpoint", "label", "size_bytes", "requeued")
                if k in answer
            }
            then = args.get("then_restore_on")
            if kind == "daemon" and then and "checkpoint" in answer:
                # One seal for the target, and one for each node the control plane may
                # re-target the restore to if the target fails or is lost.
                seals = {}
                for to in [
                    str(then),
                    *[str(n) for n in list(args.get("or_on") or [])[:_ALTERNATES]],
                ]:
                    seals[to] = self.manager.store.keys.sign(
                        SEAL_PURPOSE, _sealed(cmd["id"], str(answer["checkpoint"]), job, to)
                    ).model_dump()
                result["seal"] = seals[str(then)]
                if len(seals) > 1:
                    result["seals"] = seals
            return True, result
        except StoreError as e:
            if began is not None:  # cannot tell what was done: answered when the store is back
                raise _Unanswered(str(e)) from e
            raise

    def _drain(
        self, cmd: commands.Command, reason: str, began: float | None
    ) -> tuple[bool, dict[str, Any]]:
        drained = [drain(reason) for drain in self._drains()]
        if not drained:
            raise UsageError("no scheduler on this node to drain it in")
        return True, {k: v for d in drained for k, v in d.items()}

    def _restore(
        self, cmd: commands.Command, reason: str, began: float | None
    ) -> tuple[bool, dict[str, Any]]:
        from stasis.daemon.models import RestoreRequest

        args = cast(commands.RestoreArgs, cmd["args"])
        try:
            ckpt, created = self._migrated_checkpoint(cmd["args"])
            migration = str(args["migrated_from"])
            restored = self._resumed_restore(migration, ckpt) if began is not None else None
            if restored is None:
                self._claim_restore(migration, ckpt, created)
                try:
                    # Resumed only on the control plane's word that the command is still
                    # this node's (not failed and re-targeted while it was cut off).
                    fence = self._fence(cmd, ckpt) if args.get("fence") else None
                    done = self.manager.restorer.restore(
                        RestoreRequest(checkpoint=ckpt), _ROOT, fence=fence
                    )
                except BaseException:
                    self._unclaim_restore(migration)  # nothing restored: it may come again
                    raise
                restored = str(done["job"])
                faults.point("cp.after-restore")
                self._restored(migration, restored)
            return True, {"job": restored, "checkpoint": ckpt}
        except PermissionDeniedError as e:
            # Refused: no retry changes that (the control plane does not retry it).
            return False, {"error": str(e), "permanent": True}

    def _retain_command(
        self, cmd: commands.Command, reason: str, began: float | None
    ) -> tuple[bool, dict[str, Any]]:
        return True, {"deleted": self._retain(cmd["args"])}

    def _verify_command(
        self, cmd: commands.Command, reason: str, began: float | None
    ) -> tuple[bool, dict[str, Any]]:
        verdict = self._verify(cmd["args"])
        if verdict.get("ok"):
            return True, {"verdict": verdict}
        return False, {
            "verdict": verdict,
            "error": f"checkpoint {verdict.get('checkpoint')} "
            f"does not restore: {verdict.get('reason') or 'no reason given'}",
        }

    def _verify(self, args: dict[str, Any]) -> dict[str, Any]:
        """The verdict on the checkpoint a verify command names: the one recorded (signed) in
        the store already, if any (a background verification reached it), else the verdict
        of `stasis verify` run now."""
        ckpt = str(args.get("checkpoint") or "")
        if not re.fullmatch(_CHECKPOINT, ckpt):
            raise UsageError(f"verify refused: {ckpt[:64]!r} is not a checkpoint id")
        store = self.manager.store
        known = store.verdict(store.get(ckpt))  # the manifest's signature checked
        if known is not None:
            log.info(
                "control plane: checkpoint %s was verified before (%s): answered with "
                "that verdict",
                ckpt,
                "ok" if known.get("ok") else "failed",
            )
            return dict(known)
        # (one at a time on the node, CRIU at nice 19 and idle I/O: stasis.daemon.verifying)
        return dict(self.manager.verify(ckpt, _ROOT))

    def _intend(self, cmd: commands.Command) -> float | None:
        """The intent to carry out `cmd`, written before acting; None when it is new, or when
        this node began it before (then: when, by this node's clock)."""
        import time

        args = cmd["args"]
        # (a restore's intent is known by its migration, a checkpoint's by its job)
        what = str(args.get("migrated_from") or args.get("job") or "")[:100]
        with self.manager.db.transaction() as conn:
            began = conn.execute(
                select(intent_table.c.at).where(intent_table.c.command_id == cmd["id"])
            ).scalar()
            if began is None:
                # Those of commands the control plane gave up on (failed, re-targeted) while
                # this node was away are never leased again: forgotten after a week.
                conn.execute(
                    delete(intent_table).where(intent_table.c.at < time.time() - _INTENT_KEPT_S)
                )
                conn.execute(
                    insert(intent_table).values(
                        command_id=cmd["id"], kind=str(cmd["kind"])[:40], job=what, at=time.time()
                    )
                )
        if began is None:
            self._records.refresh(intent_table, cmd["id"])  # kept before acting
            return None
        log.info(
            "control plane command %s (%s) was begun before the daemon stopped: what it "
            "did is looked up",
            cmd["id"],
            cmd["kind"],
        )
        return float(began)

    def _fence(self, cmd: commands.Command, ckpt: str) -> Callable[[], None]:
        """The commit asked at the restore's gate, its tree restored and stopped: returns once
        the control plane said the command is still this node's lease (it is then never
        re-targeted); raises, and the tree is killed unresumed, when it refused (the command
        was failed and re-targeted while this node was cut off: FencedError) or could not
        be asked within controlplane_commit_timeout_s (UnconfirmedError: the control plane retries or
        re-targets the restore, as for any failed one)."""
        import time

        assert self.client is not None
        client, node = self.client, self.manager.settings.node
        within = self.manager.settings.controlplane_commit_timeout_s
        body: wire_cp.Renewal = {"lease_id": str(cmd.get("lease_id") or "")}
        what = f"restore of checkpoint {ckpt} ({cmd['id']}) not resumed on node {node}"

        def commit() -> None:
            deadline = time.monotonic() + within
            while True:
                left = deadline - time.monotonic()
                try:
                    client.commit(
                        node, cmd["id"], body, timeout_s=max(0.5, min(_COMMIT_TRY_S, left))
                    )
                    return
                except (UsageError, PermissionDeniedError, NotFoundError) as e:
                    # The control plane's no: never asked again, never resumed.
                    # (its line names the node, the command, the checkpoint and why)
                    said = (
                        str(e)
                        if "fenced" in str(e)
                        else f"{what}: the control plane refused its commit ({e})"
                    )
                    log.warning("control plane: fenced: %s", said)
                    raise FencedError(said) from None
                except Exception as e:  # unreachable, a 5xx, a broken answer: asked again
                    why = " ".join(str(e).split())[:300] or type(e).__name__
                if time.monotonic() + 1.0 >= deadline:
                    log.warning("control plane: %s: unconfirmed: %s", what, why)
                    raise UnconfirmedError(
                        f"{what}: the control plane could not confirm within "
                        f"{within:.0f} s that the restore is still this node's "
                        f"({why}); its restored tree was killed, checkpoint {ckpt} is kept, "
                        "and the control plane retries or re-targets the restore"
                    )
                time.sleep(1.0)

        return commit

    def _alive(self, job: str) -> bool:
        return any(j["job"] == job and j["state"] in _ALIVE for j in self.manager.jobs(_ROOT))

    def _taken_since(self, job: str, began: float) -> dict[str, Any] | None:
        """The newest checkpoint of `job` taken since `began` (this node's clock, as the
        manifest's), as a dump's answer."""
        mine = [
            m for m in self.manager.store.list() if m.job == job and m.created.timestamp() >= began
        ]
        if not mine:
            return None
        m = max(mine, key=lambda m: m.created)
        return {"checkpoint": m.id, "label": m.label, "size_bytes": m.size_bytes}

    def _resumed_restore(self, migration: str, ckpt: str) -> str | None:
        """A restore this node began for `migration` before its daemon died: the job it
        became (its restore recorded it before resuming the tree; a tree resumed unrecorded
        is adopted at start), kept as done. None: nothing was restored, it is done now."""
        with self.manager.db.transaction() as conn:
            row = conn.execute(
                select(restored_table).where(restored_table.c.migration == migration)
            ).first()
        if row is None:
            return None  # died before claiming it: nothing was restored
        if row.job:
            return str(row.job)
        became = _newest_first([j for j in self.manager.jobs(_ROOT) if j["checkpoint"] == ckpt])
        if became:
            job = str(became[0]["job"])
            if became[0]["state"] == "failed":
                # Restored, then ended by a signal (or its restore's tree never resumed):
                # not restored again behind anyone's back, nor called a success.
                raise PermissionDeniedError(
                    f"migration {migration}'s restore of checkpoint {ckpt} became job {job} "
                    "here before the daemon stopped, and that job ended by a signal: "
                    f"checkpoint {ckpt} is kept; restore it with `stasis restore {ckpt}`"
                )
            self._restored(migration, job)
            log.info(
                "control plane: migration %s was restored as job %s before the daemon "
                "stopped: answered with it",
                migration,
                job,
            )
            return job
        self._unclaim_restore(migration)  # claimed, nothing became of it: restored now
        return None

    def _claim_restore(self, migration: str, ckpt: str, created: float) -> None:
        """Migration `migration`'s restore recorded before it starts; refused if it was
        recorded before (a replayed seal), or is older than what this node still remembers."""
        import time

        refused = (
            f"restore of checkpoint {ckpt} for migration {migration} refused: a "
            "migration restores once"
        )
        gone: list[str] = []
        with self.manager.db.transaction() as conn:
            row = conn.execute(
                select(restored_table).where(restored_table.c.migration == migration)
            ).first()
            if row is not None:
                when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(row.at))
                what = (
                    f"this node already restored it as job {row.job} on {when}"
                    if row.job
                    else f"this node began restoring it on {when} (the daemon " "stopped meanwhile)"
                )
                raise PermissionDeniedError(
                    f"{refused}, and {what}: migrate the job again to " "move it"
                )
            mark = conn.execute(
                select(restored_table.c.created).where(restored_table.c.migration == _WATERMARK)
            ).scalar()
            if mark is not None and created <= mark:
                raise PermissionDeniedError(
                    f"{refused}, and its checkpoint is older than what "
                    "this node remembers restoring: migrate the job "
                    "again"
                )
            conn.execute(
                insert(restored_table).values(
                    migration=migration,
                    checkpoint=ckpt,
                    job=None,
                    created=created,
                    at=int(time.time()),
                )
            )
            kept = conn.execute(
                select(func.count())
                .select_from(restored_table)
                .where(restored_table.c.migration != _WATERMARK)
            ).scalar_one()
            if kept > _RESTORED_MAX:
                oldest = conn.execute(
                    select(restored_table.c.migration, restored_table.c.created)
                    .where(restored_table.c.migration != _WATERMARK)
                    .order_by(restored_table.c.created)
                    .limit(kept - _RESTORED_MAX)
                ).all()
                newest_gone = max([r.created for r in oldest] + [mark or 0.0])
                conn.execute(
                    delete(restored_table).where(
                        restored_table.c.migration.in_([r.migration for r in oldest] + [_WATERMARK])
                    )
                )
                conn.execute(
                    insert(restored_table).values(
                        migration=_WATERMARK,
                        checkpoint="",
                        job=None,
                        created=newest_gone,
                        at=int(time.time()),
                    )
                )
                gone = [r.migration for r in oldest] + [_WATERMARK]
        for key in [migration, *gone]:
            self._records.refresh(restored_table, key)

    def _unclaim_restore(self, migration: str) -> None:
        with self.manager.db.transaction() as conn:
            conn.execute(delete(restored_table).where(restored_table.c.migration == migration))
        self._records.refresh(restored_table, migration)

    def _restored(self, migration: str, job: str) -> None:
        with self.manager.db.transaction() as conn:
            conn.execute(
                update(restored_table)
                .where(restored_table.c.migration == migration)
                .values(job=job[:100])
            )
        self._records.refresh(restored_table, migration)

    def _migrated_checkpoint(self, args: dict[str, Any]) -> tuple[str, float]:
        """The checkpoint a restore command names, if it is the one its migration took: sealed
        for this node by the node that took it (a key this node trusts), and its signed
        manifest names the migration's job, label and owner. Anything else is refused,
        nothing restored."""
        from pydantic import ValidationError

        from stasis.store.signing import Signature, Verdict

        ckpt, job = str(args.get("checkpoint") or ""), str(args.get("job") or "")
        label, user = str(args.get("label") or ""), str(args.get("user") or "")
        migration = str(args.get("migrated_from") or "")
        refused = (
            f"restore of checkpoint {ckpt[:64] or '(none)'} refused: this node restores "
            "for the control plane only the checkpoint a migration took (`stasis "
            "controlplane migrate`)"
        )
        if (
            not (migration and ckpt and label and user)
            or not _ID.fullmatch(job)
            or not _ID.fullmatch(migration)
        ):
            raise PermissionDeniedError(
                f"{refused}; a checkpoint by id is restored with " "`stasis restore` on the node"
            )
        try:
            seal = Signature.model_validate(args.get("seal"))
        except ValidationError:
            raise PermissionDeniedError(
                f"{refused}, and this one comes without the seal of " "the node that took it"
            ) from None
        verdict = self.manager.store.keys.verify(
            SEAL_PURPOSE, _sealed(migration, ckpt, job, self.manager.settings.node), seal
        )
        if verdict is not Verdict.VALID:
            raise PermissionDeniedError(
                f"{refused}: its seal (key {seal.key_id}) {verdict.value} for migration "
                f"{migration[:40]} of job {job} to this node: give the nodes one site_key "
                "(or each other's keys in trusted_keys), or migrate the job again"
            )
        manifest = self.manager.store.get(ckpt)  # its signature checked, its id's form too
        theirs = (manifest.job, manifest.label, manifest.user)
        if theirs != (job, label, user):
            raise PermissionDeniedError(
                f"{refused}: it is of job {manifest.job[:100]}, label {manifest.label}, user "
                f"{manifest.user[:100]}, not of job {job}, label {label}, user {user}: "
                "migrate the job again"
            )
        return ckpt, manifest.created.timestamp()

    def _completed(self, live: set[tuple[str, str]]) -> set[tuple[int, str]]:
        """(uid, label) whose newest job on this node exited 0, with none of that label running
        here or (by `live`, the control plane's view) anywhere in the cluster."""
        newest: dict[tuple[int, str], Any] = {}
        for j in _newest_first(self.manager.jobs(_ROOT)):
            newest.setdefault((j["uid"], j["label"]), j)
        return {
            key
            for key, j in newest.items()
            if j["state"] == "exited"
            and j["exit_code"] == 0
            and (j["user"], j["label"]) not in live
        }

    def _retain(self, args: dict[str, Any]) -> list[str]:
        """Each matching (owner, label) keeps its newest `keep` checkpoints, and none older
        than `older_than_s` but its newest; the ids deleted."""
        import fnmatch
        from datetime import UTC, datetime, timedelta

        pattern, user = str(args.get("label") or "*"), args.get("user")
        keep = int(args["keep"]) if args.get("keep") else None
        finished = (
            self._completed({(str(u), str(lb)) for u, lb in args.get("live") or ()})
            if args.get("completed")
            else set()
        )
        cutoff = (
            datetime.now(UTC) - timedelta(seconds=int(args["older_than_s"]))
            if args.get("older_than_s")
            else None
        )
        seen: dict[tuple[int, str], int] = {}
        doomed = []
        store = self.manager.store
        for m in store.list():  # newest first
            if not fnmatch.fnmatchcase(m.label, pattern) or (user and m.user != user):
                continue
            key = (m.uid, m.label)
            seen[key] = seen.get(key, 0) + 1
            if key in finished or (
                seen[key] > 1
                and (
                    (keep is not None and seen[key] > keep)
                    or (cutoff is not None and m.created < cutoff)
                )
            ):
                doomed.append(m.id)
        # A restore that pinned one (a node resuming it now) keeps it.
        return store.catalog.retire(doomed)


def _sealed(migration: str, checkpoint: str, job: str, to: str) -> dict[str, str]:
    """What a migration's seal binds: its checkpoint command, the checkpoint it took, the job
    and the node that is to restore it."""
    return {"migration": migration, "checkpoint": checkpoint, "job": job, "to": to}


def _newest_first(jobs: list[Any]) -> list[Any]:
    return sorted(jobs, key=lambda j: j["created"], reverse=True)


def _rss(pid: int | None) -> int:
    from stasis.engine import proctree

    try:
        return proctree.resident_bytes(pid) if pid else 0
    except OSError:
        return 0


def _mem_total() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _slurm_version() -> str | None:
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return None
    try:
        out = subprocess.run(
            [sinfo, "--version"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out[-1] if out else None
