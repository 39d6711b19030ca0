"""The node side of the control plane on a Kubernetes node: the containers under stasis as jobs
of kind "container" (stasis.k8s.source), checkpointed through the control plane, and the node's
drain (cordon, stop checkpoints, evictions). A real node (containerd, runc and the stasis daemon
of `stasis-dev local-node`) whose daemon has the Kubernetes API of kmock's emulator (no API
server runs on these machines) and joins a real control plane. The tests play the cluster's
part: they create the Node and Pod objects and, after an eviction, the pod its Deployment
would make again (the container created again with the same label). The daemon's Kubernetes
API allows it exactly what the chart's RBAC grants the agent's service account (the daemon runs
in the agent's pod)."""

from __future__ import annotations

import json
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.controlplane.conftest import ControlPlane
from tests.e2e.containerd_node import Node, numbers
from tests.k8s.apiserver import ApiServer
from tests.k8s.chart_rbac import agent_rules

NODE = "k8s-node-a"
NS = "stasis"  # the containerd namespace of the local node: the containers' namespace
COUNTER = "i=0; while :; do i=$((i+1)); echo n=$i; sleep 0.1; done"


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Node, ApiServer, ControlPlane]]:
    root = Path(tempfile.mkdtemp(prefix="stasis-k8s-drain-"))
    api = ApiServer(root)
    (root / "cp").mkdir()
    cp = ControlPlane(root / "cp", str(root / "cp" / "controlplane.db"))
    node = Node(root / "node", kubeconfig=root / "kubeconfig-stasis-agent", node_name=NODE)
    try:
        api.start()
        assert api.authorize("stasis-agent", agent_rules()) == root / "kubeconfig-stasis-agent"
        api.add_ready_node(NODE)
        node.up()
        cp.start()
        kube = cp.json("clusters", "add", "kube", "--kind", "kubernetes")
        node.configure(
            {
                "controlplane_url": cp.url,
                "cluster_id": kube["cluster_id"],
                "auth_token": kube["token"],
                "controlplane_heartbeat_s": 0.5,
            }
        )
        yield node, api, cp
    finally:
        cp.stop()
        api.stop()
        node.down()


def pod(api: ApiServer, name: str, containers: dict[str, str]) -> None:
    api.bind_pod(name, containers, namespace=NS, node=NODE)


def daemon(node: Node, method: str, path: str, body: Any = None) -> Any:
    from stasis.client import Client

    with Client(node.lay.stasis_socket) as c:
        return c.request(method, path, body)


def registered(node: Node, cid: str) -> bool:
    return any(c["container_id"] == cid for c in daemon(node, "GET", "/k8s/containers"))


def counting(node: Node, cid: str, label: str) -> Path:
    out = node.run(cid, COUNTER, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: registered(node, cid), 20, f"the registration of {cid}")
    wait_for(lambda: len(numbers(out)) >= 3, 20, f"{cid} to count")
    return out


def resumes(node: Node, cid: str, label: str, checkpoint: str, last: int) -> None:
    """`cid` created again (as the pod's controller makes it anew) goes on from `last`."""
    node.remove(cid)
    out = node.run(cid, COUNTER, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: len(numbers(out)) >= 2, 30, f"{cid} to count again")
    assert f"stasis: restored from checkpoint {checkpoint} (label {label})" in out.read_text()
    assert numbers(out)[0] == last + 1, (last, numbers(out)[:3])


def test_the_control_plane_sees_a_container_and_checkpoints_it_through_its_node(
    cluster: tuple[Node, ApiServer, ControlPlane],
) -> None:
    node, api, cp = cluster
    label = f"cp-{secrets.token_hex(3)}"
    out = counting(node, "c-cp", label)
    pod(api, "trainer", {"main": "c-cp"})
    try:
        (job,) = wait_for(
            lambda: [j for j in cp.json("jobs") if j["job"] == "c-cp"],
            30,
            "the container among the control plane's jobs",
        )
        assert (
            job["kind"],
            job["label"],
            job["user"],
            job["partition"],
            job["node"],
            job["state"],
        ) == ("container", label, f"k8s:{NS}", NS, NODE, "running")
        assert job["rss_bytes"] > 0

        # Leave-running: it counts on.
        done = cp.json("checkpoint", "c-cp")
        assert done["state"] == "done", done
        first = done["result"]["checkpoint"]
        n = len(numbers(out))
        wait_for(lambda: len(numbers(out)) > n + 3, 20, "the counter to go on")
        assert node.status("c-cp") == "RUNNING"

        # Stop: the checkpoint the kubelet's stop would take; the pod is evicted, so that its
        # controller makes it again; the new container resumes from that checkpoint.
        stopped = cp.json("checkpoint", "c-cp", "--stop")
        assert stopped["state"] == "done" and stopped["result"]["requeued"] is True, stopped
        second = stopped["result"]["checkpoint"]
        assert node.status("c-cp") == "STOPPED"
        assert [(e["namespace"], e["pod"]) for e in api.evictions()] == [(NS, "trainer")]
        assert not api.exists("pods", "trainer", NS)
        # The control plane heard of both checkpoints, with why they were taken.
        heard = _reported(cp, {first, second})
        assert {c["label"] for c in heard.values()} == {label}
        resumes(node, "c-cp", label, second, numbers(out)[-1])
    finally:
        node.remove("c-cp")


def _reported(cp: ControlPlane, ids: set[str]) -> dict[str, dict[str, Any]]:
    def found() -> dict[str, dict[str, Any]] | None:
        mine = {c["id"]: c for c in cp.json("checkpoints") if c["id"] in ids}
        return mine if set(mine) == ids else None

    result: dict[str, dict[str, Any]] = wait_for(found, 30, "the checkpoints reported")
    return result


def test_a_drain_cordons_the_node_checkpoints_its_containers_and_evicts_their_pods(
    cluster: tuple[Node, ApiServer, ControlPlane],
) -> None:
    node, api, _ = cluster
    labels = {cid: f"drain-{secrets.token_hex(3)}" for cid in ("c-d1", "c-d2")}
    outs = {cid: counting(node, cid, label) for cid, label in labels.items()}
    plain = node.run("c-plain", COUNTER)  # not under stasis: left alone
    pod(api, "worker-1", {"main": "c-d1"})
    pod(api, "worker-2", {"main": "c-d2"})
    pod(api, "web", {"nginx": "c-plain"})
    before = len(api.evictions())
    try:
        assert daemon(node, "GET", "/k8s/node") == {"node": NODE, "state": "Ready", "api": True}
        r = node.stasis("k8s", "drain", "--reason", "kernel update", "--json")
        assert r.returncode == 0, r.stderr
        drained = json.loads(r.stdout)
        assert drained["k8s_node"] == NODE and drained["failed"] == [], drained
        taken = {q["job"]: q for q in drained["requeued"]}
        assert sorted(taken) == ["c-d1", "c-d2"]
        assert {q["pod"] for q in taken.values()} == {f"{NS}/worker-1", f"{NS}/worker-2"}
        assert sorted(drained["evicted"]) == [f"{NS}/worker-1", f"{NS}/worker-2"]

        # In the API: the node cordoned, both pods evicted (and gone), the other pod stays.
        assert api.get("nodes", NODE)["spec"]["unschedulable"] is True
        evicted = api.evictions()[before:]
        assert sorted((e["namespace"], e["pod"]) for e in evicted) == [
            (NS, "worker-1"),
            (NS, "worker-2"),
        ]
        assert all(e["body"]["kind"] == "Eviction" for e in evicted)
        assert not api.exists("pods", "worker-1", NS) and api.exists("pods", "web", NS)
        assert daemon(node, "GET", "/k8s/node")["state"] == "Ready,SchedulingDisabled+DRAIN"

        # The protected containers stopped at their checkpoint; the other one runs on.
        assert node.status("c-d1") == node.status("c-d2") == "STOPPED"
        n = len(numbers(plain))
        wait_for(lambda: len(numbers(plain)) > n + 3, 20, "the unprotected one to count on")
        for cid, label in labels.items():
            resumes(node, cid, label, taken[cid]["checkpoint"], numbers(outs[cid])[-1])
    finally:
        api.patch("nodes", NODE, {"spec": {"unschedulable": False}})
        for cid in ("c-d1", "c-d2", "c-plain"):
            node.remove(cid)


def test_the_control_plane_drains_a_kubernetes_node_through_its_daemon(
    cluster: tuple[Node, ApiServer, ControlPlane],
) -> None:
    node, api, cp = cluster
    label = f"cpdrain-{secrets.token_hex(3)}"
    out = counting(node, "c-cpd", label)
    pod(api, "worker-cp", {"main": "c-cpd"})
    before = len(api.evictions())
    try:
        wait_for(
            lambda: any(
                n["name"] == NODE and n.get("scheduler_state") == "Ready" for n in cp.json("nodes")
            ),
            30,
            "the node's scheduler state",
        )
        wait_for(
            lambda: [j for j in cp.json("jobs") if j["job"] == "c-cpd"],
            30,
            "the container in the control plane",
        )
        drained = cp.json("drain", NODE)
        assert [j["job"] for j in drained["handled"]] == ["c-cpd"], drained
        assert not drained.get("migrations") and not drained.get("moved"), drained
        wait_for(lambda: len(api.evictions()) > before, 60, "the pod's eviction")
        assert api.get("nodes", NODE)["spec"]["unschedulable"] is True
        assert [(e["namespace"], e["pod"]) for e in api.evictions()[before:]] == [(NS, "worker-cp")]
        wait_for(lambda: node.status("c-cpd") == "STOPPED", 30, "the container stopped")
        (checkpoint,) = [c["id"] for c in cp.json("checkpoints") if c["label"] == label]
        resumes(node, "c-cpd", label, checkpoint, numbers(out)[-1])
    finally:
        api.patch("nodes", NODE, {"spec": {"unschedulable": False}})
        node.remove("c-cpd")


def test_the_daemon_s_drain_needed_nothing_the_chart_s_rbac_does_not_grant(
    cluster: tuple[Node, ApiServer, ControlPlane],
) -> None:
    _, api, _ = cluster
    assert api.requests(denied=True) == []
    done = {(r["verb"], r["resource"]) for r in api.requests()}
    assert {
        ("get", "nodes"),
        ("patch", "nodes"),
        ("list", "pods"),
        ("create", "pods/eviction"),
    } <= done, done


def test_without_its_api_the_node_has_no_state_and_a_drain_fails_in_one_line(
    cluster: tuple[Node, ApiServer, ControlPlane],
) -> None:
    node, api, _ = cluster
    api.stop()  # the last test of the module: the API server is gone
    assert daemon(node, "GET", "/k8s/node") == {"node": NODE, "state": "", "api": True}
    r = node.stasis("k8s", "drain")
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(
        f"stasis: error: read node {NODE}: the API server cannot be " "reached: "
    ), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
