"""The node's containers under stasis as the control plane sees them: a JobSource
(stasis.daemon.activity) of kind "container".

    jobs        every registered container that runs: its label, owner `k8s:<namespace>`,
                the namespace as its partition, the resident memory of its processes
    checkpoint  leave-running; or stop: the checkpoint the kubelet's stop would take, then its
                pod is evicted, so that its controller makes it again (restored from that
                checkpoint, on whatever node the scheduler picks)
    drain       this node: cordoned, every protected container stop-checkpointed, their pods
                evicted (the Eviction API: disruption budgets hold)
    state       the node as `kubectl get nodes` shows it, "+DRAIN" while it is cordoned; ""
                where the API does not answer

Drain and state need the Kubernetes API: from the `kubeconfig` setting, else the pod's service
account (the daemon runs in the node agent's pod; the chart's role lets it cordon the node and
evict pods). A node without either has no drain here: its scheduler is another (Slurm) or none.
The node's name in the API is the daemon's node name (STASIS_NODE_NAME; the chart sets it from
spec.nodeName).
"""

from __future__ import annotations

import logging
from typing import Any

from stasis.daemon.activity import JobSource, ReportedJob
from stasis.daemon.users import Caller
from stasis.engine import proctree
from stasis.errors import ContainerError, StasisError, UsageError
from stasis.k8s import kube
from stasis.k8s.containers import Containers
from stasis.k8s.models import CheckpointRequest, ContainerInfo

log = logging.getLogger("stasis.daemon")

KIND = "container"
_ROOT = Caller(pid=0, uid=0, gid=0)  # the control plane's asking is the node admin's


class ContainerJobs:
    def __init__(self, containers: Containers, node: str, api: Any | None) -> None:
        self.containers = containers
        self.node = node
        self.api = api  # a CoreV1Api, or None: no Kubernetes API from this node

    def source(self) -> JobSource:
        if self.api is None:
            return JobSource(KIND, self.jobs, self.checkpoint)
        return JobSource(KIND, self.jobs, self.checkpoint, self.drain, self.state)

    def _live(self) -> list[tuple[ContainerInfo, str, int]]:
        out = []
        for info in self.containers.all(_ROOT):
            running = self.containers.running(info)
            if running is not None:
                out.append((info, *running))
        return out

    def jobs(self) -> list[ReportedJob]:
        # The control plane takes ids and owners of up to 100 characters (a kubelet's
        # container ids have 64, namespaces at most 63); a longer one would cost the node
        # its whole report.
        return [
            ReportedJob(
                job=info["container_id"],
                label=info["label"],
                user=f"k8s:{info['namespace']}",
                state=status,
                restored_from=info["restored_from"],
                started=info["registered"],
                kind=KIND,
                partition=info["namespace"],
                rss_bytes=_rss(pid),
            )
            for info, status, pid in self._live()
            if len(info["container_id"]) <= 100 and len(info["namespace"]) <= 96
        ]

    def checkpoint(self, job: str, leave_running: bool, reason: str) -> dict[str, object]:
        done: dict[str, object] = dict(
            self.containers.checkpoint(
                job,
                CheckpointRequest(reason="manual" if leave_running else "stop"),
                _ROOT,
                why=reason,
            )
        )
        if not leave_running:
            pods = self._pods({job})
            if job in pods:
                try:
                    kube.evict(self.api, *pods[job])
                except kube.KubeError as e:
                    raise ContainerError(
                        f"checkpoint {done['checkpoint']} of container {job} was taken but its "
                        f"pod could not be evicted ({e}); the kubelet starts the container "
                        "again on this node, restored from it"
                    ) from None
                done["evicted"] = "/".join(pods[job])
            # Evicted: its controller makes it again, restored; else the kubelet restarts it
            # here (restartPolicy), restored all the same.
            done["requeued"] = job in pods
        return done

    def _pods(self, containers: set[str]) -> dict[str, tuple[str, str]]:
        """container id -> (namespace, pod), of those whose pod is known: from the runtime's
        annotations (a kubelet's container), else from the pods bound to this node."""
        if self.api is None:
            return {}
        found: dict[str, tuple[str, str]] = {}
        for info in self.containers.all(_ROOT):
            if info["container_id"] in containers and info["pod"]:
                found[info["container_id"]] = (info["namespace"], info["pod"])
        if containers - set(found):
            bound = kube.pods_of_containers(self.api, self.node)
            found.update({c: bound[c] for c in containers - set(found) if c in bound})
        return found

    def state(self) -> str:
        if self.api is None:
            return ""
        try:
            return kube.node_state(self.api, self.node)
        except kube.KubeError as e:
            log.debug("node %s: no state from the Kubernetes API: %s", self.node, e)
            return ""

    def drain(self, reason: str) -> dict[str, object]:
        """Kubernetes gives this node no new pod; every protected container on it is
        checkpointed as at its stop and its pod evicted: they start again on other nodes,
        restored from those checkpoints. A container whose checkpoint failed keeps running
        (its pod is not evicted); it is named in `failed`."""
        if self.api is None:
            raise UsageError("this node has no Kubernetes API to drain it in")
        kube.cordon(self.api, self.node)
        requeued: list[dict[str, str]] = []
        failed: list[str] = []
        taken: dict[str, dict[str, str]] = {}
        for info, _, _ in self._live():
            cid = info["container_id"]
            try:
                done = self.containers.checkpoint(
                    cid, CheckpointRequest(reason="stop"), _ROOT, why=reason
                )
                taken[cid] = {"job": cid, "checkpoint": done["checkpoint"], "label": done["label"]}
            except StasisError as e:
                failed.append(f"{cid}: {e}")
        try:
            pods = self._pods(set(taken))
        except kube.KubeError as e:
            pods = {}
            failed.append(str(e))
        evicted: list[str] = []
        for cid, item in taken.items():
            if cid not in pods:
                failed.append(
                    f"{cid}: checkpoint {item['checkpoint']} taken, but no pod on "
                    f"node {self.node} has this container: not evicted"
                )
                continue
            pod = "/".join(pods[cid])
            requeued.append({**item, "pod": pod})
            if pod in evicted:
                continue
            try:
                kube.evict(self.api, *pods[cid])
                evicted.append(pod)
            except kube.KubeError as e:
                failed.append(f"{cid}: checkpoint {item['checkpoint']} taken: {e}")
        log.info(
            "Kubernetes node %s drained (%s): %d container(s) checkpointed, %d pod(s) " "evicted%s",
            self.node,
            reason,
            len(taken),
            len(evicted),
            f", {len(failed)} failed" if failed else "",
        )
        return {"k8s_node": self.node, "requeued": requeued, "evicted": evicted, "failed": failed}


def _rss(pid: int) -> int:
    try:
        return proctree.resident_bytes(pid)
    except OSError:
        return 0
