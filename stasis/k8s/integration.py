"""The Kubernetes integration of the node daemon: its routes, its table, its tasks.

    GET  /k8s/containers                      the containers under stasis on this node
    POST /k8s/containers                      {runc_root, container_id, bundle[, restored_from]}:
                                              the wrapper registers a started container
    POST /k8s/containers/{id}/checkpoint      {reason: stop|interval|manual|cordon|annotation
                                              [, runc_root, timeout_s]}; stop kills it once
                                              published; annotation (a pod owner's request) is
                                              refused within the floor of the last one
    POST /k8s/containers/{id}/interval        {interval_s, auto}: its leave-running checkpoints'
                                              interval (null = its STASIS_INTERVAL; auto:
                                              Young/Daly's, stasis.k8s.intervals)
    POST /k8s/containers/{id}/forget          the container was deleted
    POST /k8s/restores                        {runc_root, container_id, bundle}: a restore plan
                                              (images ready, writable layer put back) or none
    POST /k8s/restores/{id}/done              {ok, error}: the wrapper's runc restore ended
    POST /k8s/checkpoints/{id}/export         {path}: the checkpoint as an OCI image archive
    POST /k8s/checkpoints/import              {path[, label, namespace]}: one such archive
                                              as a new checkpoint
    GET  /k8s/node                            {node, state, api}: this node in Kubernetes
    POST /k8s/node/drain                      {reason}: cordon, checkpoint, evict (source.py)

All of them are root's (containerd's shim runs the wrapper as root): stasis.routes.K8S declares
them, the daemon's adapter refuses anyone else, and each is served by the method of its name. The containers are also a
JobSource of kind "container" (stasis.k8s.source): the control plane lists, checkpoints and
drains them through it.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Table

from stasis import routes, wire
from stasis.daemon.http import Call
from stasis.daemon.integration import Integration, Task
from stasis.daemon.jobs import JobManager
from stasis.daemon.users import Caller
from stasis.k8s import kube
from stasis.k8s import models as k8s_models
from stasis.k8s.containers import Containers, k8s_containers_table
from stasis.k8s.events import ExitFollower
from stasis.k8s.source import ContainerJobs


class K8sIntegration(Integration):
    name = "k8s"
    models = k8s_models.BY_WIRE

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

    # -- its routes (stasis.routes.K8S) ---------------------------------------------------------

    def routes(self) -> Sequence[routes.AnyRoute]:
        return routes.K8S

    def job_intervals(self, caller: Caller) -> list[wire.JobInterval]:
        return self.containers.job_intervals(caller)

    def k8s_containers(self, call: Call[None]) -> list[wire.ContainerInfo]:
        return self.containers.all(call.caller)

    def k8s_register(self, call: Call[k8s_models.RegisterRequest]) -> wire.ContainerInfo:
        return self.containers.register(call.body, call.caller)

    def k8s_checkpoint(
        self, call: Call[k8s_models.CheckpointRequest]
    ) -> wire.ContainerCheckpointAnswer:
        return self.containers.checkpoint(call.args["container"], call.body, call.caller)

    def k8s_interval(self, call: Call[k8s_models.IntervalRequest]) -> wire.ContainerInfo:
        return self.containers.set_interval(call.args["container"], call.body, call.caller)

    def k8s_forget(self, call: Call[None]) -> wire.Forgotten:
        return self.containers.forget(call.args["container"], call.caller)

    def k8s_plan_restore(self, call: Call[k8s_models.RestoreRequest]) -> wire.RestorePlan:
        return self.containers.plan_restore(call.body, call.caller)

    def k8s_restore_done(self, call: Call[k8s_models.RestoreDoneRequest]) -> wire.RestoreDone:
        return self.containers.restore_done(call.args["container"], call.body, call.caller)

    def k8s_export(self, call: Call[k8s_models.ExportRequest]) -> wire.ExportAnswer:
        return self.containers.export(call.args["checkpoint"], call.body, call.caller)

    def k8s_import(self, call: Call[k8s_models.ImportRequest]) -> wire.ContainerCheckpointAnswer:
        return self.containers.import_(call.body, call.caller)

    def k8s_node(self, call: Call[None]) -> wire.NodeInfo:
        return wire.NodeInfo(
            node=self.jobs.node, state=self.jobs.state(), api=self.jobs.api is not None
        )

    def k8s_drain(self, call: Call[k8s_models.DrainRequest]) -> dict[str, object]:
        return self.jobs.drain(call.body.reason)
