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
from collections.abc import Sequence

from aiohttp import web
from sqlalchemy import Table

from stasis.daemon.activity import ReportedJob
from stasis.daemon.http import answer, peer, read_body
from stasis.daemon.integration import Integration, Task
from stasis.daemon.jobs import JobManager
from stasis.slurm.models import CheckpointRequest, FinishRequest, RegisterRequest
from stasis.wire import Health
from stasis.slurm.registrations import SlurmJobs, slurm_jobs_table

log = logging.getLogger("stasis.daemon")

# Registrations of workloads that ended without telling the daemon (scancel) are forgotten.
_SWEEP_INTERVAL_S = 60.0


class SlurmIntegration(Integration):
    name = "slurm"

    def __init__(self, manager: JobManager) -> None:
        super().__init__(manager)
        self.jobs = SlurmJobs(manager)
        manager.add_job_source(self._reported)

    def _reported(self) -> list[ReportedJob]:
        return [ReportedJob(job=r["slurm_job"], label=r["label"], user=r["user"],
                            state="running", restored_from=None, started=r["registered"],
                            kind="slurm")
                for r in self.jobs.registrations.running()]

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
