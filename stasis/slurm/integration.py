"""The Slurm integration of the node daemon: its routes, its table, its housekeeping.

    GET  /slurm/health                      is a daemon here (the SPANK helper asks first)
    POST /slurm/jobs                        the launcher registers its workload's namespace init
    GET  /slurm/jobs/{id}                   the registration (owner or root)
    POST /slurm/jobs/{id}/checkpoint        {"leave_running": bool}; without leave_running the
                                            workload is killed once the checkpoint is published
                                            and the job is requeued (`scontrol requeue`)
    POST /slurm/jobs/{id}/finish            {"exit_code": n}: the workload ended; 0 retires the
                                            label's checkpoints (COMPLETED), anything else keeps them

Who calls is the socket's peer (SO_PEERCRED); see stasis.slurm.registrations for who may do what.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence

from aiohttp import web
from sqlalchemy import Table

from stasis.daemon.activity import JobSource, ReportedJob
from stasis.daemon.http import answer, peer, read_body
from stasis.daemon.integration import Integration, Task
from stasis.daemon.jobs import JobManager
from stasis.daemon.users import Caller
from stasis.engine import proctree
from stasis.errors import SlurmError, StasisError
from stasis.slurm import scontrol
from stasis.slurm.models import CheckpointRequest, FinishRequest, RegisterRequest
from stasis.wire import Health
from stasis.slurm.registrations import SlurmJobs, slurm_jobs_table

log = logging.getLogger("stasis.daemon")
_ROOT = Caller(pid=0, uid=0, gid=0)  # what the control plane asks is the node admin's doing

# Registrations of workloads that ended without telling the daemon (scancel) are forgotten.
_SWEEP_INTERVAL_S = 60.0


class SlurmIntegration(Integration):
    name = "slurm"

    def __init__(self, manager: JobManager) -> None:
        super().__init__(manager)
        self.jobs = SlurmJobs(manager)
        manager.add_job_source(JobSource("slurm", self._reported, self._checkpoint,
                                         self._drain, self._state))
        self._partitions: dict[str, str] = {}  # Slurm job id -> its partition, asked once

    def _reported(self) -> list[ReportedJob]:
        running = self.jobs.registrations.running()
        live = {r["slurm_job"] for r in running}
        for gone in set(self._partitions) - live:
            del self._partitions[gone]
        return [ReportedJob(job=r["slurm_job"], label=r["label"], user=r["user"],
                            state="running", restored_from=None, started=r["registered"],
                            kind="slurm", partition=self._partition(r["slurm_job"]),
                            rss_bytes=proctree.resident_bytes(r["pid"])
                            if proctree.alive(r["pid"], r["pid_start"]) else 0)
                for r in running]

    def _partition(self, job_id: str) -> str | None:
        if job_id not in self._partitions:
            try:
                self._partitions[job_id] = scontrol.job_info(job_id).partition
            except SlurmError:
                return None
        return self._partitions[job_id] or None

    def _checkpoint(self, job_id: str, leave_running: bool, reason: str) -> dict[str, object]:
        """For the control plane: a checkpoint of Slurm job `job_id` (stopped: requeued)."""
        done = self.jobs.checkpoint(job_id, CheckpointRequest(leave_running=leave_running,
                                                              reason=reason), _ROOT)
        return dict(done)

    def _node(self) -> str:
        return self.manager.settings.slurm_node_name or socket.gethostname().split(".")[0]

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
                done = self.jobs.checkpoint(r["slurm_job"], CheckpointRequest(
                    leave_running=False, reason=reason), _ROOT)
                requeued.append({"job": r["slurm_job"], "checkpoint": done["checkpoint"]})
            except StasisError as e:
                failed.append(f"{r['slurm_job']}: {e}")
        log.info("Slurm node %s drained (%s): %d job(s) checkpointed and requeued%s", node,
                 reason, len(requeued), f", {len(failed)} failed" if failed else "")
        return {"slurm_node": node, "requeued": requeued, "failed": failed}

    def tables(self) -> Sequence[Table]:
        return [slurm_jobs_table]

    def prepare(self) -> None:
        moved = self.jobs.registrations.migrate(self.manager.settings.layout.legacy_slurm)
        if moved:
            log.info("moved %d Slurm registration(s) of an older daemon into its database",
                     moved)

    def tasks(self) -> Sequence[Task]:
        return [Task("forget ended Slurm workloads", _SWEEP_INTERVAL_S, self.jobs.sweep)]

    def routes(self) -> Sequence[web.RouteDef]:
        jobs = self.jobs

        async def health(request: web.Request) -> web.StreamResponse:
            return answer(Health(ok=True))

        async def register(request: web.Request) -> web.StreamResponse:
            req = await read_body(request, RegisterRequest)
            return answer(await asyncio.to_thread(jobs.register, req, peer(request)))

        async def get_job(request: web.Request) -> web.StreamResponse:
            return answer(await asyncio.to_thread(jobs.get, request.match_info["job"],
                                                  peer(request)))

        async def checkpoint(request: web.Request) -> web.StreamResponse:
            req = await read_body(request, CheckpointRequest)
            return answer(await asyncio.to_thread(jobs.checkpoint, request.match_info["job"],
                                                  req, peer(request)))

        async def finish(request: web.Request) -> web.StreamResponse:
            req = await read_body(request, FinishRequest)
            return answer(await asyncio.to_thread(jobs.finish, request.match_info["job"], req,
                                                  peer(request)))

        return [
            web.get("/slurm/health", health),
            web.post("/slurm/jobs", register),
            web.get("/slurm/jobs/{job}", get_job),
            web.post("/slurm/jobs/{job}/checkpoint", checkpoint),
            web.post("/slurm/jobs/{job}/finish", finish),
        ]
