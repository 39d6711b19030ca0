"""The node agent (`stasis k8s agent`) against kmock's Kubernetes API emulator (no API server
runs on these machines) and a real node: containerd, runc and the stasis daemon of `stasis k8s
local-node`, containers started through the stasis runtime. The tests play the cluster's part:
they create the Node and Pod objects, write the pod's container statuses as the kubelet would,
cordon the node, annotate pods."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stasis.daemon import detached
from tests.conftest import STASIS, wait_for
from tests.e2e.containerd_node import Node
from tests.k8s.apiserver import ApiServer

NODE = "node-a"
NS = "stasis"  # the containerd namespace of the local node: the containers' namespace
COUNTER = "i=0; while :; do i=$((i+1)); echo n=$i; sleep 0.1; done"


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Node, ApiServer, Path]]:
    root = Path(tempfile.mkdtemp(prefix="stasis-agent-"))
    node = Node(root, min_interval_s=2)
    api = ApiServer(root)
    agent = None
    try:
        node.up()
        api.start()
        # As the kubelet registers a node with --register-with-taints: tainted until the
        # agent says otherwise; another taint the agent must leave alone.
        api.create("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
                             "spec": {"taints": [
                                 {"key": "stasis.dev/not-ready", "effect": "NoSchedule"},
                                 {"key": "other", "value": "x", "effect": "NoExecute"}]}})
        log = root / "agent.log"
        with log.open("w") as out:
            agent = subprocess.Popen(
                [STASIS, "k8s", "agent", "--node", NODE, "--kubeconfig", str(api.kubeconfig),
                 "--no-daemon"], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "STASIS_CONFIG": node.info["stasis_config"],
                     "STASIS_K8S_CHECK_INTERVAL_S": "0.5"})
        yield node, api, log
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
        api.stop()
        node.down()


def taints(api: ApiServer) -> list[str]:
    return [t["key"] for t in api.get("nodes", NODE)["spec"].get("taints") or []]


def numbers(log: Path) -> list[int]:
    return [int(m) for m in re.findall(r"^n=(\d+)$", log.read_text(), re.M)]


def pod(api: ApiServer, name: str, containers: dict[str, str],
        annotations: dict[str, str] | None = None) -> None:
    """A pod bound to the node, with the container statuses the kubelet would write."""
    api.create("pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "annotations": annotations or {}},
        "spec": {"nodeName": NODE, "runtimeClassName": "stasis",
                 "containers": [{"name": c, "image": "busybox"} for c in containers]},
        "status": {"phase": "Running", "containerStatuses": [
            {"name": c, "containerID": f"containerd://{cid}", "image": "busybox",
             "imageID": "", "ready": True, "restartCount": 0}
            for c, cid in containers.items()]}})


def checkpoints(node: Node, label: str) -> list[dict[str, Any]]:
    r = node.stasis("checkpoints", "--json")
    assert r.returncode == 0, r.stderr
    return [c for c in json.loads(r.stdout) if c["label"] == label]


def registered(node: Node, cid: str) -> dict[str, Any] | None:
    from stasis.client import Client

    with Client(node.lay.stasis_socket) as c:
        found = [x for x in c.request("GET", "/k8s/containers") if x["container_id"] == cid]
    return found[0] if found else None


def test_the_not_ready_taint_follows_the_node_s_stasis_and_other_taints_stay(
        cluster: tuple[Node, ApiServer, Path]) -> None:
    node, api, log = cluster
    wait_for(lambda: taints(api) == ["other"], 30, f"the taint to come off ({log})")
    # The daemon dies: the node cannot checkpoint, so nothing new may land on it.
    detached.stop(detached.read_pid(node.lay.stasis / "daemon.pid"))
    wait_for(lambda: sorted(taints(api)) == ["other", "stasis.dev/not-ready"], 30,
             "the taint to come back")
    assert "stasis is not ready: cannot reach the stasis daemon" in log.read_text()
    node.restart_daemon()
    wait_for(lambda: taints(api) == ["other"], 30, "the taint to come off again")


def test_cordoning_the_node_checkpoints_its_protected_containers_which_go_on(
        cluster: tuple[Node, ApiServer, Path]) -> None:
    node, api, _ = cluster
    label = f"cordon-{secrets.token_hex(3)}"
    out = node.run("c-cordon", COUNTER, env={"STASIS_CHECKPOINT": label})
    plain = node.run("c-cordon-plain", COUNTER)  # not protected: left alone
    wait_for(lambda: registered(node, "c-cordon"), 20, "the container's registration")
    wait_for(lambda: len(numbers(out)) >= 3, 20, "the counter to count")
    api.patch("nodes", NODE, {"spec": {"unschedulable": True}})
    try:
        done: str = wait_for(lambda: api.get("nodes", NODE)["metadata"].get("annotations", {})
                        .get("stasis.dev/cordon-checkpoints"), 60, "the cordon checkpoints")
        taken = json.loads(done)["containers"]
        assert list(taken) == ["c-cordon"], taken
        assert [c["id"] for c in checkpoints(node, label)] == [taken["c-cordon"]["checkpoint"]]
        # Leave-running: it counts on.
        n = len(numbers(out))
        wait_for(lambda: len(numbers(out)) > n + 3, 20, "the counter to go on")
        assert node.status("c-cordon") == "RUNNING"
        assert node.status("c-cordon-plain") == "RUNNING" and numbers(plain)
    finally:
        api.patch("nodes", NODE, {"spec": {"unschedulable": False}})
        for c in ("c-cordon", "c-cordon-plain"):
            node.remove(c)


def test_stasis_k8s_checkpoint_ns_pod_goes_through_the_node_s_agent(
        cluster: tuple[Node, ApiServer, Path]) -> None:
    node, api, _ = cluster
    label = f"byhand-{secrets.token_hex(3)}"
    out = node.run("c-byhand", COUNTER, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: registered(node, "c-byhand"), 20, "the container's registration")
    pod(api, "trainer", {"main": "c-byhand"})
    try:
        r = subprocess.run([STASIS, "k8s", "checkpoint", f"{NS}/trainer", "--kubeconfig",
                            str(api.kubeconfig), "--timeout", "60"],
                           capture_output=True, text=True, timeout=90)
        assert r.returncode == 0, r.stderr
        (ckpt,) = [c["id"] for c in checkpoints(node, label)]
        assert r.stdout.strip() == f"container main: checkpoint {ckpt} (label {label})"
        n = len(numbers(out))
        wait_for(lambda: len(numbers(out)) > n + 3, 20, "the counter to go on")

        # Asked again: a second checkpoint (each new annotation value is a new request).
        r = subprocess.run([STASIS, "k8s", "checkpoint", f"{NS}/trainer", "--kubeconfig",
                            str(api.kubeconfig), "--json"],
                           capture_output=True, text=True, timeout=90)
        assert r.returncode == 0, r.stderr
        assert len(checkpoints(node, label)) == 2
        assert json.loads(r.stdout)["containers"]["main"]["label"] == label
    finally:
        node.remove("c-byhand")


def test_a_pod_with_nothing_under_stasis_or_no_such_pod_is_one_clear_error(
        cluster: tuple[Node, ApiServer, Path]) -> None:
    node, api, _ = cluster
    node.run("c-unprotected", COUNTER)
    pod(api, "web", {"nginx": "c-unprotected"})
    try:
        r = subprocess.run([STASIS, "k8s", "checkpoint", f"{NS}/web", "--kubeconfig",
                            str(api.kubeconfig), "--timeout", "60"],
                           capture_output=True, text=True, timeout=90)
        assert r.returncode == 1
        assert r.stderr.strip() == (f"stasis: error: no container of pod {NS}/web is under "
                                    f"stasis on node {NODE} (runtimeClassName: stasis and "
                                    "STASIS_CHECKPOINT on the container)")
        assert node.status("c-unprotected") == "RUNNING"
    finally:
        node.remove("c-unprotected")
    r = subprocess.run([STASIS, "k8s", "checkpoint", f"{NS}/nope", "--kubeconfig",
                        str(api.kubeconfig)], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr.strip()) == (2, f"stasis: error: no pod {NS}/nope")
    r = subprocess.run([STASIS, "k8s", "checkpoint", "nope", "--kubeconfig",
                        str(api.kubeconfig)], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr.strip()) == (2, "stasis: error: 'nope' is not NAMESPACE/POD")


def test_the_interval_annotation_sets_and_unsets_a_container_s_checkpoint_interval(
        cluster: tuple[Node, ApiServer, Path]) -> None:
    node, api, _ = cluster
    label = f"every-{secrets.token_hex(3)}"
    out = node.run("c-every", COUNTER, env={"STASIS_CHECKPOINT": label})  # no STASIS_INTERVAL
    wait_for(lambda: registered(node, "c-every"), 20, "the container's registration")
    pod(api, "every", {"main": "c-every"}, annotations={"stasis.dev/interval": "1"})
    try:
        wait_for(lambda: len(checkpoints(node, label)) >= 2, 60, "two interval checkpoints")
        # 1 s is below the node's floor (2 s here): raised, said once in the container's log
        # (the pod's later events do not ask again).
        assert (registered(node, "c-every") or {})["interval_s"] == 2
        api.patch("pods", "every", {"metadata": {"labels": {"touched": "yes"}}}, namespace=NS)
        time.sleep(1)
        assert out.read_text().count("is below this node's minimum of 2 s") == 1
        # Taken off: the container's own (none) again.
        api.patch("pods", "every", {"metadata": {"annotations": {"stasis.dev/interval": None}}},
                  namespace=NS)
        wait_for(lambda: (registered(node, "c-every") or {}).get("interval_s") == 0, 30,
                 "the interval to be the container's own again")
        n = len(checkpoints(node, label))
        time.sleep(3)
        assert len(checkpoints(node, label)) == n
    finally:
        node.remove("c-every")


def test_an_agent_without_an_api_says_so_in_one_line() -> None:
    r = subprocess.run([STASIS, "k8s", "agent", "--node", NODE, "--kubeconfig",
                        "/nonexistent/kubeconfig", "--no-daemon"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith("stasis: error: no Kubernetes API from /nonexistent/kubeconfig: ")
    assert len(r.stderr.strip().splitlines()) == 1
