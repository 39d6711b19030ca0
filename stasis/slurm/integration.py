"""The Slurm integration of the node daemon: its routes, its table, its housekeeping.

    GET  /slurm/health                      is a daemon here (the SPANK helper asks first)
    POST /slurm/jobs                        the launcher registers its workload's namespace init
    GET  /slurm/jobs/{id}                   the registration (owner or root)
    POST /slurm/jobs/{id}/checkpoint        {"leave_running": bool}; without leave_running the
                                            workload is killed once the checkpoint is published
                                            and the job is requeued (`scontrol requeue`)
    POST /slurm/jobs/{id}/interval          {"requested": "auto" | "<seconds>" | "default"}:
                                            how long to wait for the next periodic checkpoint,
                                            and why ("default": the node's `interval` setting;
                                            stasis.slurm.intervals)
    GET  /slurm/intervals                   the jobs' current intervals (root: all, a user:
                                            their own)
    POST /slurm/jobs/{id}/finish            {"exit_code": n, "stopped": bool}: the workload
                                            ended; a genuine success (0, nothing stopped, no stop
                                            asked or failed in the run) retires the label's
                                            checkpoints, anything else (no exit_code too) keeps them

Who calls is the socket's peer (SO_PEERCRED); see stasis.slurm.registrations for who may do what.

With `slurm_remote_port` set, the integration also listens on TCP (every address, or
`slurm_remote_address`) for the same requests from other nodes of the cluster, each carrying a
munge credential (stasis.slurm.remote: who asks is munge's uid, never the request's):

    POST /slurm/remote/jobs/{id}/checkpoint  {"credential", "leave_running", "reason"}
    POST /slurm/remote/drain                 {"credential", "reason"}: root only; the node is
                                             drained in Slurm and its protected jobs
                                             checkpointed and requeued
    POST /slurm/remote/parts/{id}            {"credential", "command", "cwd"}: a part of a job
                                             on several nodes started here (stasis.slurm.parts,
                                             for the launch agent stasis-rsh)
    POST /slurm/remote/parts/{id}/{part}/output  {"credential", "offset"}: its output, state
    POST /slurm/remote/parts/{id}/{part}/signal  {"credential", "signal"}
    POST /slurm/remote/parts/{id}/{part}/freeze  {"credential", "timeout_s"}   a cut across
    POST /slurm/remote/parts/{id}/{part}/dump    {"credential", "label", "reason"}  nodes,
    POST /slurm/remote/parts/{id}/{part}/thaw    {"credential", "stop"}      root only
    POST /slurm/remote/parts/{id}/checkpoints/{checkpoint}/delete  {"credential"}
    POST /slurm/remote/parts/{id}/list     {"credential"}: the job's live parts here   root
    POST /slurm/remote/parts/{id}/net      {"credential", "held"}  a cut restored    only
    POST /slurm/remote/parts/{id}/restore  {"credential", "checkpoint", "part"}  on requeue

Only those routes are served there, with the unix socket's limits: `request_timeout_s`
for the headers and again for the body, `max_connections_per_uid` connections from the network
at once (they all count as one unknown user), a body of at most 16 KiB.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

from aiohttp import web
from sqlalchemy import Table

from stasis import routes, wire
from stasis.daemon.activity import JobSource, ReportedJob
from stasis.daemon.connections import ConnectionGuard, raise_open_files_limit
from stasis.daemon.http import Call, add_routes, errors
from stasis.daemon.integration import Integration, Task
from stasis.daemon.jobs import JobManager
from stasis.daemon.users import Caller
from stasis.engine import proctree
from stasis.errors import PermissionDeniedError, SlurmError, StasisError, UsageError
from stasis.slurm import held, interruptions, mirrors, parts, remote, scontrol
from stasis.slurm import models as slurm_models
from stasis.slurm.intervals import Intervals, job_interval
from stasis.slurm.mirrors import Mirrors
from stasis.slurm.models import CheckpointRequest
from stasis.slurm.partnames import part_of
from stasis.slurm.parts import SlurmParts
from stasis.slurm.registrations import SlurmJobs, slurm_jobs_table

log = logging.getLogger("stasis.daemon")
_ROOT = Caller(pid=0, uid=0, gid=0)  # what the control plane asks is the node admin's doing

# Registrations of workloads that ended without telling the daemon (scancel) are forgotten.
_SWEEP_INTERVAL_S = 60.0
# A remote request is a credential (~400 characters) and a few fields; a part's command (an
# MPI daemon's, with its options) 1 to 3 KiB.
_REMOTE_MAX_BODY = 16 * 1024
# The part operations' names in their credentials' payloads.
_PART_OPS: dict[routes.AnyRoute, str] = {
    routes.SLURM_REMOTE_PART_START: "part-start",
    routes.SLURM_REMOTE_PART_OUTPUT: "part-output",
    routes.SLURM_REMOTE_PART_SIGNAL: "part-signal",
    routes.SLURM_REMOTE_PART_FREEZE: "part-freeze",
    routes.SLURM_REMOTE_PART_DUMP: "part-dump",
    routes.SLURM_REMOTE_PART_THAW: "part-thaw",
    routes.SLURM_REMOTE_PART_DELETE: "part-delete",
    routes.SLURM_REMOTE_PART_LIST: "part-list",
    routes.SLURM_REMOTE_PART_NET: "part-net",
    routes.SLURM_REMOTE_PART_RESTORE: "part-restore",
}


class _GuardedSockSite(web.SockSite):
    """aiohttp's SockSite, with every connection going through a ConnectionGuard."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, guard: ConnectionGuard) -> None:
        super().__init__(runner, sock)
        self._guard = guard

    async def start(self) -> None:
        self._runner._reg_site(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.wrap(server), sock=self._sock, backlog=self._backlog
        )


def _listen(address: str, port: int) -> socket.socket:
    """The remote listener's socket, bound now: a port taken is the daemon's start failing."""
    try:
        if address:
            family = socket.getaddrinfo(
                address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0][0]
            return socket.create_server((address, port), family=family)
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", port))
    except OSError as e:
        raise UsageError(
            f"cannot listen for remote Slurm commands on "
            f"{address or '*'}:{port} (slurm_remote_port): "
            f"{e.strerror or e}"
        ) from None


class SlurmIntegration(Integration):
    """Its handlers are its methods named after the routes of stasis.routes.SLURM (the unix
    socket) and SLURM_REMOTE (the remote listener)."""

    name = "slurm"
    models = slurm_models.BY_WIRE

    def __init__(self, manager: JobManager) -> None:
        super().__init__(manager)
        self.mirrors = Mirrors(manager.settings, remote.this_node(manager.settings))
        self.jobs = SlurmJobs(manager, self.mirrors)
        self.parts = SlurmParts(manager, remote.this_node(manager.settings))
        manager.add_job_source(
            JobSource("slurm", self._reported, self._checkpoint, self._drain, self._state)
        )
        self._partitions: dict[str, str] = {}  # Slurm job id -> its partition, asked once
        self.intervals = Intervals(manager.settings)
        manager.activity.add(self.intervals.heard)
        self._listener: asyncio.Task[None] | None = None

    def _reported(self) -> list[ReportedJob]:
        running = self.jobs.registrations.running()
        live = {r["slurm_job"] for r in running}
        for gone in set(self._partitions) - live:
            del self._partitions[gone]
        return [
            ReportedJob(
                job=r["slurm_job"],
                label=r["label"],
                user=r["user"],
                state="running",
                restored_from=r.get("restored_from"),
                started=r["registered"],
                kind="slurm",
                partition=self._partition(r["slurm_job"]),
                rss_bytes=proctree.resident_bytes(r["pid"])
                if proctree.alive(r["pid"], r["pid_start"])
                else 0,
            )
            for r in running
        ]

    def _partition(self, job_id: str) -> str | None:
        if job_id not in self._partitions:
            try:
                self._partitions[job_id] = scontrol.job_info(job_id).partition
            except SlurmError:
                return None
        return self._partitions[job_id] or None

    def _checkpoint(self, job_id: str, leave_running: bool, reason: str) -> dict[str, object]:
        """For the control plane: a checkpoint of Slurm job `job_id` (stopped: requeued)."""
        done = self.jobs.checkpoint(
            job_id, CheckpointRequest(leave_running=leave_running, reason=reason), _ROOT
        )
        return dict(done)

    def _node(self) -> str:
        return remote.this_node(self.manager.settings)

    def _state(self) -> str:
        """Slurm's state of this node; "" where Slurm does not know it (no Slurm here)."""
        if not self.manager.settings.slurm_conf_present:
            return ""  # scontrol without a configuration may hang on DNS SRV lookups
        try:
            return scontrol.node_state(self._node())
        except SlurmError:
            return ""

    def _drain(self, reason: str) -> dict[str, object]:
        """Slurm gives this node no new job, then every protected job on it is checkpointed
        and requeued: they resume on other nodes from those checkpoints."""
        node = self._node()
        scontrol.drain_node(node, reason)
        requeued, failed = [], []
        for r in self.jobs.registrations.running():
            try:
                done = self.jobs.checkpoint(
                    r["slurm_job"], CheckpointRequest(leave_running=False, reason=reason), _ROOT
                )
                requeued.append({"job": r["slurm_job"], "checkpoint": done["checkpoint"]})
            except StasisError as e:
                failed.append(f"{r['slurm_job']}: {e}")
        # A job on several nodes whose batch tree runs on another node: its parts here go with
        # the whole job, checkpointed by its batch node's daemon (stasis.slurm.jobcut).
        for job_id in self._parts_of_jobs_elsewhere():
            try:
                done = self._checkpoint_elsewhere(job_id, reason)
                requeued.append({"job": job_id, "checkpoint": done["checkpoint"]})
            except StasisError as e:
                failed.append(f"{job_id}: {e}")
        log.info(
            "Slurm node %s drained (%s): %d job(s) checkpointed and requeued%s",
            node,
            reason,
            len(requeued),
            f", {len(failed)} failed" if failed else "",
        )
        return {"slurm_node": node, "requeued": requeued, "failed": failed}

    def _parts_of_jobs_elsewhere(self) -> list[str]:
        """The Slurm jobs with a live part on this node and no registration here."""
        here = {r["slurm_job"] for r in self.jobs.registrations.running()}
        jobs = {
            of[0]
            for j in self.manager.jobs(_ROOT)
            if j["state"] in ("running", "restored") and (of := part_of(j["label"]))
        }
        return sorted(jobs - here, key=int)

    def _checkpoint_elsewhere(self, job_id: str, reason: str) -> wire.SlurmCheckpointAnswer:
        """Have the batch node of Slurm job `job_id` checkpoint and requeue it (root's munge
        credential, its remote listener)."""
        settings = self.manager.settings
        batch = scontrol.job_info(job_id).batch_host
        if not batch:
            raise SlurmError(f"Slurm job {job_id} runs on no batch node now")
        target = remote.remote_node(settings, batch, scontrol.node_address(batch))
        return remote.checkpoint(settings, target, job_id, leave_running=False, reason=reason)

    def tables(self) -> Sequence[Table]:
        return [slurm_jobs_table]

    def prepare(self) -> None:
        self.jobs.registrations.upgrade()
        moved = self.jobs.registrations.migrate(self.manager.settings.layout.legacy_slurm)
        if moved:
            log.info("moved %d Slurm registration(s) of an older daemon into its database", moved)
        # Stops a killed daemon left half done: finished in the background (scontrol, CRIU),
        # so that the socket opens at once (the jobs' launchers wait for it).
        threading.Thread(target=self.jobs.recover, name="slurm-recover", daemon=True).start()
        settings = self.manager.settings
        if settings.slurm_remote_port:
            sock = _listen(settings.slurm_remote_address, settings.slurm_remote_port)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not in a daemon (a test's integration): nothing to serve
                sock.close()
                return
            self._listener = loop.create_task(self._serve_remote(sock))

    def close(self) -> None:
        # Its cleanup (closing the listener) runs as the daemon's loop winds down.
        if self._listener is not None:
            self._listener.cancel()
        self.mirrors.close()

    # -- the remote listener -------------------------------------------------------------------

    def remote_app(self, middlewares: Sequence[Any] = ()) -> web.Application:
        """What the remote listener serves: stasis.routes.SLURM_REMOTE, nothing of the unix
        socket's; `middlewares` run inside the error handler."""
        app = web.Application(middlewares=[errors, *middlewares], client_max_size=_REMOTE_MAX_BODY)
        add_routes(app, routes.SLURM_REMOTE, self, slurm_models.BY_WIRE, self._identify)
        return app

    async def _serve_remote(self, sock: socket.socket) -> None:
        settings = self.manager.settings
        guard = ConnectionGuard(
            settings.max_connections_per_uid, settings.request_timeout_s, raise_open_files_limit()
        )
        runner = web.AppRunner(
            self.remote_app([guard.middleware]),
            access_log=None,
            keepalive_timeout=settings.request_timeout_s or 75.0,
        )
        try:
            await runner.setup()
            await _GuardedSockSite(runner, sock, guard).start()
            host, port = sock.getsockname()[:2]
            log.info(
                "listening for remote Slurm commands on %s port %d (munge identifies "
                "the caller)",
                host or "*",
                port,
            )
            await asyncio.Event().wait()  # until cancelled by close()
        except Exception:
            log.exception(
                "the remote listener for Slurm commands failed; only the local "
                "socket serves them"
            )
        finally:
            await runner.cleanup()
            with suppress(OSError):
                sock.close()

    def _remote_caller(
        self, request: web.Request, credential: str, op: str, fields: dict[str, object]
    ) -> Caller:
        """Who asks `op` (blocking: munge): munge's uid and gid, once the credential decoded
        here and names this very request, node and cluster."""
        conf = remote.slurm_conf(self.manager.settings)
        # An IPv4 peer of the dual-stack socket reads as ::ffff:a.b.c.d.
        peer_address = (request.remote or "?").removeprefix("::ffff:")
        try:
            identity = remote.verify_credential(credential, conf.munge_socket)
            remote.check_payload(
                identity, remote.request_payload(op, self._node(), conf.cluster, **fields)
            )
        except PermissionDeniedError as e:
            log.warning("refused a remote Slurm %s from %s: %s", op, peer_address, e)
            raise
        # An agent follows its part by asking for its output every fraction of a second.
        log.log(
            logging.DEBUG if op == "part-output" else logging.INFO,
            "remote Slurm %s %s asked by uid %d from %s",
            op,
            " ".join(f"{k}={v}" for k, v in fields.items()),
            identity.uid,
            peer_address,
        )
        return Caller(pid=-1, uid=identity.uid, gid=identity.gid)  # no process of this node

    def _identify(self, route: routes.AnyRoute, request: web.Request, body: Any) -> Caller:
        """The remote listener's caller: munge's identity, for this very request."""
        if route is routes.SLURM_REMOTE_CHECKPOINT:
            job_id = scontrol.validate_slurm_job_id(request.match_info["job"])
            fields = {"job": job_id, "leave_running": body.leave_running, "reason": body.reason}
            return self._remote_caller(request, body.credential, "checkpoint", fields)
        if route in _PART_OPS:
            # The path's parameters and the body's fields, all bound by the credential.
            fields = {**request.match_info, **body.model_dump(exclude={"credential"})}
            scontrol.validate_slurm_job_id(fields["job"])
            return self._remote_caller(request, body.credential, _PART_OPS[route], fields)
        return self._remote_caller(request, body.credential, "drain", {"reason": body.reason})

    def slurm_remote_part_start(self, call: Call[slurm_models.PartStartRequest]) -> wire.RunAnswer:
        return self.parts.start(call.args["job"], call.body, call.caller)

    def slurm_remote_part_output(
        self, call: Call[slurm_models.PartOutputRequest]
    ) -> wire.SlurmPartOutput:
        return self.parts.output(call.args["job"], call.args["part"], call.body, call.caller)

    def slurm_remote_part_signal(
        self, call: Call[slurm_models.PartSignalRequest]
    ) -> wire.SlurmPartSignalled:
        return self.parts.signal(call.args["job"], call.args["part"], call.body, call.caller)

    def slurm_remote_part_freeze(
        self, call: Call[slurm_models.PartFreezeRequest]
    ) -> wire.FreezeAnswer:
        return self.parts.freeze(call.args["job"], call.args["part"], call.body, call.caller)

    def slurm_remote_part_dump(self, call: Call[slurm_models.PartDumpRequest]) -> wire.DumpAnswer:
        return self.parts.dump(call.args["job"], call.args["part"], call.body, call.caller)

    def slurm_remote_part_thaw(self, call: Call[slurm_models.PartThawRequest]) -> wire.ThawAnswer:
        return self.parts.thaw(call.args["job"], call.args["part"], call.body, call.caller)

    def slurm_remote_part_delete(self, call: Call[slurm_models.PartDeleteRequest]) -> wire.Deleted:
        return self.parts.delete(call.args["checkpoint"], call.caller)

    def slurm_remote_part_list(
        self, call: Call[slurm_models.PartListRequest]
    ) -> wire.SlurmPartList:
        return self.parts.listing(call.args["job"], call.caller)

    def slurm_remote_part_net(self, call: Call[slurm_models.PartNetRequest]) -> wire.SlurmPartNet:
        return self.parts.net(call.args["job"], call.body, call.caller)

    def slurm_remote_part_restore(
        self, call: Call[slurm_models.PartRestoreRequest]
    ) -> wire.RestoreAnswer:
        return self.parts.restore(call.args["job"], call.body, call.caller)

    def slurm_remote_checkpoint(
        self, call: Call[slurm_models.RemoteCheckpointRequest]
    ) -> wire.SlurmCheckpointAnswer:
        req = call.body
        return self.jobs.checkpoint(
            scontrol.validate_slurm_job_id(call.args["job"]),
            CheckpointRequest(leave_running=req.leave_running, reason=req.reason),
            call.caller,
        )

    def slurm_remote_drain(self, call: Call[slurm_models.RemoteDrainRequest]) -> dict[str, object]:
        return self._drain(call.body.reason)

    def tasks(self) -> Sequence[Task]:
        return [
            Task("forget ended Slurm workloads", _SWEEP_INTERVAL_S, self.jobs.sweep),
            # States of stops carried out (trees killed) that the database refused.
            Task("record Slurm stops", 1.0, self.jobs.record_pending),
            Task(
                "record srun steps in Slurm",
                mirrors.POLL_S,
                lambda: self.mirrors.poll(self.jobs.registrations.running()),
            ),
            Task("release Slurm jobs held here", held.RECHECK_S, self._release_held),
            *(
                [
                    Task(
                        "read interruption rates (sacct)",
                        interruptions.REFRESH_S,
                        self.intervals.rates.refresh,
                    )
                ]
                if self.manager.settings.slurm_conf_present
                else []
            ),
            Task("forget intervals of ended Slurm jobs", _SWEEP_INTERVAL_S, self._forget_intervals),
            Task("kill parts of ended Slurm jobs", parts.SWEEP_S, self.parts.sweep),
        ]

    def _forget_intervals(self) -> None:
        self.intervals.forget_except({r["slurm_job"] for r in self.jobs.registrations.running()})

    def _interval(self, job_id: str, requested: str, caller: Caller) -> dict[str, object]:
        """Blocking (scontrol, perhaps sacct): the owner's (or root's) ask for its job's
        interval."""
        reg = self.jobs.get(job_id, caller)
        rss = (
            proctree.resident_bytes(reg["pid"])
            if proctree.alive(reg["pid"], reg["pid_start"])
            else 0
        )
        return self.intervals.ask(
            reg["slurm_job"], requested, dict(reg), self._partition(reg["slurm_job"]), rss
        )

    def _release_held(self) -> None:
        def store_answers(label: str, uid: int) -> bool:
            try:
                self.manager.store.list(label, uid=uid)
            except StasisError:
                return False
            return True

        held.release_over(self.manager.settings.layout.slurm_held, store_answers)

    # -- the unix socket's routes (stasis.routes.SLURM) ------------------------------------------

    def routes(self) -> Sequence[routes.AnyRoute]:
        return routes.SLURM

    def slurm_health(self, call: Call[None]) -> wire.Health:
        return wire.Health(ok=True)

    def slurm_register(self, call: Call[slurm_models.RegisterRequest]) -> wire.Registration:
        return self.jobs.register(call.body, call.caller)

    def slurm_job(self, call: Call[None]) -> wire.Registration:
        return self.jobs.get(call.args["job"], call.caller)

    def slurm_checkpoint(
        self, call: Call[slurm_models.CheckpointRequest]
    ) -> wire.SlurmCheckpointAnswer:
        return self.jobs.checkpoint(call.args["job"], call.body, call.caller)

    def slurm_interval(self, call: Call[slurm_models.IntervalRequest]) -> dict[str, object]:
        return self._interval(call.args["job"], call.body.requested, call.caller)

    def slurm_intervals(self, call: Call[None]) -> list[dict[str, Any]]:
        return self.intervals.listing(call.caller)

    def job_intervals(self, caller: Caller) -> list[wire.JobInterval]:
        return [job_interval(e) for e in self.intervals.listing(caller)]

    def slurm_finish(self, call: Call[slurm_models.FinishRequest]) -> wire.FinishAnswer:
        return self.jobs.finish(call.args["job"], call.body, call.caller)
