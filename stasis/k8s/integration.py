"""The Kubernetes integration of the node daemon: its routes, its table, its tasks.

    GET  /k8s/containers                      the containers under stasis on this node
    POST /k8s/containers                      {runc_root, container_id, bundle[, restored_from]}:
                                              the wrapper registers a started container
    POST /k8s/containers/{id}/checkpoint      {reason: stop|interval|manual|cordon|annotation
                                              [, runc_root, timeout_s]}; stop kills it once
                                              published; annotation (a pod owner's request) is
                                              refused within the floor of the last one
    POST /k8s/containers/{id}/interval        {interval_s}: its leave-running checkpoints'
                                              interval (null = its STASIS_INTERVAL)
    POST /k8s/containers/{id}/forget          the container was deleted
    POST /k8s/restores                        {runc_root, container_id, bundle}: a restore plan
                                              (images ready, writable layer put back) or none
    POST /k8s/restores/{id}/done              {ok, error}: the wrapper's runc restore ended
    POST /k8s/checkpoints/{id}/export         {path}: the checkpoint as an OCI image archive
    POST /k8s/checkpoints/import              {path[, label, namespace]}: one such archive
                                              as a new checkpoint
    GET  /k8s/node                            {node, state, api}: this node in Kubernetes
    POST /k8s/node/drain                      {reason}: cordon, checkpoint, evict (source.py)

All of them are root's (containerd's shim runs the wrapper as root). The containers are also a
JobSource of kind "container" (stasis.k8s.source): the control plane lists, checkpoints and
drains them through it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from aiohttp import web
from sqlalchemy import Table

from stasis.daemon.http import answer, peer, read_body
from stasis.daemon.integration import Integration, Task
from stasis.daemon.jobs import JobManager
from stasis.daemon.users import Caller
from stasis.errors import PermissionDeniedError
from stasis.k8s import kube
from stasis.k8s.containers import Containers, k8s_containers_table
from stasis.k8s.events import ExitFollower
from stasis.k8s.models import (
    CheckpointRequest,
    DrainRequest,
    ExportRequest,
    ImportRequest,
    IntervalRequest,
    NodeInfo,
    RegisterRequest,
    RestoreDoneRequest,
    RestoreRequest,
)
from stasis.k8s.source import ContainerJobs


class K8sIntegration(Integration):
    name = "k8s"

    def __init__(self, manager: JobManager) -> None:
        super().__init__(manager)
        s = manager.settings
        # The daemon's entry point read the environment into its Settings; the floor's
        # variable is read here while stasis.config has no setting for it.
        self.containers = Containers(manager, s.k8s_min_interval_s)
        self.jobs = ContainerJobs(self.containers, s.node, kube.connect_daemon(s.kubeconfig))
        manager.add_job_source(self.jobs.source())
        if self.jobs.api is not None:
            api, node = self.jobs.api, s.node
            self.containers.pod_event = lambda namespace, pod, reason, message: kube.warn(
                api, namespace, pod, reason, message, node
            )
        self.events = ExitFollower(
            manager.settings.containerd_address,
            lambda e: self.containers.ended(e.container_id, e.exit_status),
        )

    def prepare(self) -> None:
        self.events.start()
        # Before any request: what a killed daemon left paused runs (or ends) again.
        self.containers.settle_freezes()

    def tables(self) -> Sequence[Table]:
        return [k8s_containers_table]

    def tasks(self) -> Sequence[Task]:
        return [
            Task("interval checkpoints of containers", 1.0, self.containers.checkpoint_due),
            Task("forget abandoned container restores", 60.0, self.containers.sweep),
            Task(
                "thaw containers a killed daemon left paused", 10.0, self.containers.retry_freezes
            ),
        ]

    def close(self) -> None:
        self.events.close()
        self.containers.close()

    def routes(self) -> Sequence[web.RouteDef]:
        c = self.containers

        async def all_containers(request: web.Request) -> web.StreamResponse:
            return answer(await asyncio.to_thread(c.all, peer(request)))

        async def register(request: web.Request) -> web.StreamResponse:
            req = await read_body(request, RegisterRequest)
            return answer(await asyncio.to_thread(c.register, req, peer(request)))

        async def checkpoint(request: web.Request) -> web.StreamResponse:
            req = await read_body(request, CheckpointRequest)
            return answer(
                await asyncio.to_thread(c.checkpoint, request.match_info["id"], req, peer(request))
            )

        async def interval(request: web.Request) -> web.StreamResponse:
            req = await read_body(request, IntervalRequest)
            return answer(
                await asyncio.to_thread(
                    c.set_interval, request.match_info["id"], req, peer(request)
                )
            )

        async def forget(request: web.Request) -> web.StreamResponse:
            return answer(
                await asyncio.to_thread(c.forget, request.match_info["id"], peer(request))
            )

        async def plan_restore(request: web.Request) -> web.StreamResponse:
            req = await read_body(request, RestoreRequest)
            return answer(await asyncio.to_thread(c.plan_restore, req, peer(request)))

        async def restore_done(request: web.Request) -> web.StreamResponse:
            req = await read_body(request, RestoreDoneRequest)
            return answer(
                await asyncio.to_thread(
                    c.restore_done, request.match_info["id"], req, peer(request)
                )
            )

        async def export(request: web.Request) -> web.StreamResponse:
            req = await read_body(request, ExportRequest)
            return answer(
                await asyncio.to_thread(c.export, request.match_info["id"], req, peer(request))
            )

        async def import_(request: web.Request) -> web.StreamResponse:
            req = await read_body(request, ImportRequest)
            return answer(await asyncio.to_thread(c.import_, req, peer(request)))

        async def node(request: web.Request) -> web.StreamResponse:
            _root_only(peer(request))
            return answer(
                NodeInfo(
                    node=self.jobs.node,
                    state=await asyncio.to_thread(self.jobs.state),
                    api=self.jobs.api is not None,
                )
            )

        async def drain(request: web.Request) -> web.StreamResponse:
            req = await read_body(request, DrainRequest)
            _root_only(peer(request))
            return answer(await asyncio.to_thread(self.jobs.drain, req.reason))

        return [
            web.post("/k8s/checkpoints/{id}/export", export),
            web.post("/k8s/checkpoints/import", import_),
            web.get("/k8s/node", node),
            web.post("/k8s/node/drain", drain),
            web.get("/k8s/containers", all_containers),
            web.post("/k8s/containers", register),
            web.post("/k8s/containers/{id}/checkpoint", checkpoint),
            web.post("/k8s/containers/{id}/interval", interval),
            web.post("/k8s/containers/{id}/forget", forget),
            web.post("/k8s/restores", plan_restore),
            web.post("/k8s/restores/{id}/done", restore_done),
        ]


def _root_only(caller: Caller) -> None:
    if not caller.is_root:
        raise PermissionDeniedError("permission denied: only root drains the node")
