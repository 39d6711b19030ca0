"""The node agent (`stasis k8s agent`) against kmock's Kubernetes API emulator (no API server
runs on these machines) and a real node: containerd, runc and the stasis daemon of `stasis-dev
local-node`, containers started through the stasis runtime. The tests play the cluster's part:
they create the Node and Pod objects, write the pod's container statuses as the kubelet would,
cordon the node, annotate pods. The agent runs with exactly the permissions the chart's RBAC
gives its service account (rendered from charts/stasis, enforced by the emulator): every call it
makes must be allowed there."""

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
from tests.e2e.containerd_node import Node, numbers
from tests.k8s.apiserver import ApiServer
from tests.k8s.chart_rbac import agent_rules

NODE = "node-a"
NS = "stasis"  # the containerd namespace of the local node: the containers' namespace
COUNTER = "i=0; while :; do i=$((i+1)); echo n=$i; sleep 0.1; done"
FLOOR_S = 5  # the node's floor on checkpoint intervals, low for short tests
AGENT_TOKEN = "stasis-agent-token"  # the chart's service account's, in the emulator


class Cluster:
    """The node, the API, the agent (a process of its own, started again at will)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = Node(root, min_interval_s=FLOOR_S)
        self.api = ApiServer(root)
        self.log = root / "agent.log"
        self.agent: subprocess.Popen[bytes] | None = None
        self.kubeconfig = root / "none"

    def __iter__(self) -> Iterator[Any]:
        return iter((self.node, self.api, self.log))

    def start_agent(self) -> None:
        with self.log.open("a") as out:
            self.agent = subprocess.Popen(
                [
                    STASIS,
                    "k8s",
                    "agent",
                    "--node",
                    NODE,
                    "--kubeconfig",
                    str(self.kubeconfig),
                    "--no-daemon",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "STASIS_CONFIG": self.node.info["stasis_config"],
                    "STASIS_K8S_CHECK_INTERVAL_S": "0.5",
                },
            )

    def kill_agent(self) -> None:
        if self.agent is not None:
            self.agent.kill()
            self.agent.wait(timeout=30)
            self.agent = None


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(Path(tempfile.mkdtemp(prefix="stasis-agent-")))
    try:
        c.node.up()
        c.api.start()
        # The agent's service account may do what the chart's RBAC grants it, nothing more.
        c.kubeconfig = c.api.authorize(AGENT_TOKEN, agent_rules())
        # As the kubelet registers a node with --register-with-taints: tainted until the
        # agent says otherwise; another taint the agent must leave alone.
        c.api.create(
            "nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": NODE},
                "spec": {
                    "taints": [
                        {"key": "stasis.dev/not-ready", "effect": "NoSchedule"},
                        {"key": "other", "value": "x", "effect": "NoExecute"},
                    ]
                },
            },
        )
        c.start_agent()
        yield c
    finally:
        if c.agent is not None:
            c.agent.terminate()
            c.agent.wait(timeout=30)
        c.api.stop()
        c.node.down()


def taints(api: ApiServer) -> list[str]:
    return [t["key"] for t in api.get("nodes", NODE)["spec"].get("taints") or []]


def pod(
    api: ApiServer,
    name: str,
    containers: dict[str, str],
    annotations: dict[str, str] | None = None,
    node: str = NODE,
) -> None:
    api.bind_pod(name, containers, namespace=NS, node=node, annotations=annotations or {})


def registered(node: Node, cid: str) -> dict[str, Any] | None:
    from stasis.client import Client

    with Client(node.lay.stasis_socket) as c:
        found = [x for x in c.request("GET", "/k8s/containers") if x["container_id"] == cid]
    return found[0] if found else None


def test_the_not_ready_taint_follows_the_node_s_stasis_and_other_taints_stay(
    cluster: Cluster,
) -> None:
    node, api, log = cluster
    wait_for(lambda: taints(api) == ["other"], 30, f"the taint to come off ({log})")
    # The daemon dies: the node cannot checkpoint, so nothing new may land on it.
    detached.stop(detached.read_pid(node.lay.stasis / "daemon.pid"))
    wait_for(
        lambda: sorted(taints(api)) == ["other", "stasis.dev/not-ready"],
        30,
        "the taint to come back",
    )
    assert "stasis is not ready: cannot reach the stasis daemon" in log.read_text()
    node.restart_daemon()
    wait_for(lambda: taints(api) == ["other"], 30, "the taint to come off again")


def test_cordoning_the_node_checkpoints_its_protected_containers_which_go_on(
    cluster: Cluster,
) -> None:
    node, api, _ = cluster
    label = f"cordon-{secrets.token_hex(3)}"
    out = node.run("c-cordon", COUNTER, env={"STASIS_CHECKPOINT": label})
    plain = node.run("c-cordon-plain", COUNTER)  # not protected: left alone
    wait_for(lambda: registered(node, "c-cordon"), 20, "the container's registration")
    wait_for(lambda: len(numbers(out)) >= 3, 20, "the counter to count")
    api.patch("nodes", NODE, {"spec": {"unschedulable": True}})
    try:
        done: str = wait_for(
            lambda: api.get("nodes", NODE)["metadata"]
            .get("annotations", {})
            .get("stasis.dev/cordon-checkpoints"),
            60,
            "the cordon checkpoints",
        )
        taken = json.loads(done)["containers"]
        assert list(taken) == ["c-cordon"], taken
        assert [c["id"] for c in node.checkpoints(label)] == [taken["c-cordon"]["checkpoint"]]
        # Leave-running: it counts on.
        n = len(numbers(out))
        wait_for(lambda: len(numbers(out)) > n + 3, 20, "the counter to go on")
        assert node.status("c-cordon") == "RUNNING"
        assert node.status("c-cordon-plain") == "RUNNING" and numbers(plain)
    finally:
        api.patch("nodes", NODE, {"spec": {"unschedulable": False}})
        for c in ("c-cordon", "c-cordon-plain"):
            node.remove(c)


def test_stasis_k8s_checkpoint_ns_pod_goes_through_the_node_s_agent(cluster: Cluster) -> None:
    node, api, _ = cluster
    label = f"byhand-{secrets.token_hex(3)}"
    out = node.run("c-byhand", COUNTER, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: registered(node, "c-byhand"), 20, "the container's registration")
    pod(api, "trainer", {"main": "c-byhand"})
    try:
        r = ask(api, "trainer")
        assert r.returncode == 0, r.stderr
        (ckpt,) = [c["id"] for c in node.checkpoints(label)]
        assert r.stdout.strip() == f"container main: checkpoint {ckpt} (label {label})"
        n = len(numbers(out))
        wait_for(lambda: len(numbers(out)) > n + 3, 20, "the counter to go on")

        # Asked again once the node's floor has passed since: a second checkpoint (each new
        # annotation value is a new request).
        time.sleep(FLOOR_S)
        r = ask(api, "trainer", "--json")
        assert r.returncode == 0, r.stderr
        assert len(node.checkpoints(label)) == 2
        assert json.loads(r.stdout)["containers"]["main"]["label"] == label
    finally:
        node.remove("c-byhand")


def ask(api: ApiServer, pod_name: str, *options: str) -> subprocess.CompletedProcess[str]:
    """`stasis k8s checkpoint NS/POD`, as a tenant runs it (the cluster's admin here)."""
    return subprocess.run(
        [
            STASIS,
            "k8s",
            "checkpoint",
            f"{NS}/{pod_name}",
            "--kubeconfig",
            str(api.kubeconfig),
            "--timeout",
            "60",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_a_tenant_asking_again_and_again_gets_no_more_checkpoints_than_the_floor_allows(
    cluster: Cluster,
) -> None:
    node, api, _ = cluster
    label = f"spam-{secrets.token_hex(3)}"
    out = node.run("c-spam", COUNTER, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: registered(node, "c-spam"), 20, "the container's registration")
    pod(api, "spam", {"main": "c-spam"})
    try:
        first = ask(api, "spam")
        assert first.returncode == 0, first.stderr
        taken = time.monotonic()
        # The tenant annotates the pod again and again, as fast as the agent answers.
        answers: list[dict[str, str]] = []
        while time.monotonic() < taken + FLOOR_S - 1.5 and len(answers) < 10:
            token = f"again-{len(answers)}"
            api.patch(
                "pods",
                "spam",
                {"metadata": {"annotations": {"stasis.dev/checkpoint": token}}},
                namespace=NS,
            )
            result = wait_for(lambda: answer(api, "spam", token), 20, "the agent's answer")
            answers.append(result["containers"]["main"])
        assert len(answers) >= 2 and all("error" in a for a in answers), answers
        assert len(node.checkpoints(label)) == 1
        # Each refusal is the pod's answer, one line that says why and what to do.
        refused = answers[0]["error"]
        assert re.fullmatch(
            r"checkpoint of container c-spam refused: its last one was \d+ s "
            rf"ago and this node takes one at most every {FLOOR_S} s \(its "
            r"admin's minimum, k8s_min_interval_s\): ask again in \d+ s",
            refused,
        ), refused
        # As `kubectl describe pod` shows it: a warning event per refusal.
        warned = [e for e in answer_events(api, "spam") if e["type"] == "Warning"]
        assert [e["message"] for e in warned] == [f"container main: {a['error']}" for a in answers]
        assert node.status("c-spam") == "RUNNING"
        n = len(numbers(out))
        wait_for(lambda: len(numbers(out)) > n + 3, 20, "the counter to go on")
        # Once the floor has passed: taken again.
        time.sleep(FLOOR_S)
        again = ask(api, "spam")
        assert again.returncode == 0, again.stderr
        assert len(node.checkpoints(label)) == 2
    finally:
        node.remove("c-spam")


def answer(api: ApiServer, pod_name: str, token: str) -> dict[str, Any] | None:
    """The agent's answer to request `token` of a pod, as the tenant reads it (an event)."""
    from stasis.k8s import kube

    return kube.answer_of(kube.connect(str(api.kubeconfig)), NS, pod_name, token)


def answer_events(api: ApiServer, pod_name: str) -> list[dict[str, Any]]:
    found = api._call("GET", f"/api/v1/namespaces/{NS}/events")["items"]
    return [
        e
        for e in found
        if e["involvedObject"]["name"] == pod_name and e["reason"] == "StasisCheckpoint"
    ]


def test_an_agent_started_again_does_not_run_answered_requests_again(cluster: Cluster) -> None:
    node, api, log = cluster
    label = f"again-{secrets.token_hex(3)}"
    node.run("c-again", COUNTER, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: registered(node, "c-again"), 20, "the container's registration")
    pod(api, "again", {"main": "c-again"})
    try:
        r = ask(api, "again")
        assert r.returncode == 0, r.stderr
        assert len(node.checkpoints(label)) == 1
        (event,) = answer_events(api, "again")
        assert event["type"] == "Normal" and event["message"] == (
            f"container main: checkpoint {node.checkpoints(label)[0]['id']} (label {label})"
        )
        # Past the floor: a request run again would be taken, not refused.
        time.sleep(FLOOR_S)
        cluster.kill_agent()  # no goodbye: as a node's OOM killer or a crash ends it
        cluster.start_agent()
        # A new request, made after the restart: answered only once the agent went through
        # every pod it found at its start (a watch lists them first).
        node.run("c-again2", COUNTER)
        pod(api, "again2", {"main": "c-again2"})
        r = ask(api, "again2")
        assert r.returncode == 1 and "is under stasis" in r.stderr, r.stderr
        assert len(node.checkpoints(label)) == 1
        assert len(answer_events(api, "again")) == 1
        # The agent wrote nothing to the pod (it may not).
        assert set(api.get("pods", "again", NS)["metadata"]["annotations"]) == {
            "stasis.dev/checkpoint"
        }
    finally:
        node.remove("c-again")
        node.remove("c-again2")
    assert log.read_text().count(f"agent of node {NODE} running") >= 2


def test_what_the_agent_remembers_of_pods_is_bounded(cluster: Cluster, tmp_path: Path) -> None:
    """A tenant who makes many pods, each with a request, does not grow the agent's memory:
    the agent itself, in this process, against the same API and daemon."""
    from stasis.config import load_settings
    from stasis.k8s import kube
    from stasis.k8s.agent import Agent

    node, api, _ = cluster
    # Pods of another node: the agent of this test's node leaves them to this one.
    # Its own state directory: the record of answered requests is the node agent's.
    settings = load_settings(
        {"STASIS_CONFIG": node.info["stasis_config"], "STASIS_STATE_DIR": str(tmp_path)}
    )
    assert settings.socket == node.lay.stasis_socket
    agent = Agent(
        settings=settings,
        api=kube.connect(str(cluster.kubeconfig)),
        node="node-b",
        start_daemon=False,
        remember_pods=8,
    )
    names = [f"many-{i}" for i in range(30)]
    for i, name in enumerate(names):
        pod(
            api,
            name,
            {"main": f"c-many-{i}"},
            node="node-b",
            annotations={"stasis.dev/checkpoint": f"ask-{i}-" + "x" * 4000},
        )
    client = agent.api
    for name in names:
        agent.on_pod(client.read_namespaced_pod(name, NS))
        assert len(agent._answered) <= 8
    # Every one was answered all the same (nothing of it is under stasis).
    for i, name in enumerate(names):
        result = answer(api, name, f"ask-{i}-" + "x" * 4000)
        assert result is not None and "is under stasis" in result["error"]
    # So is what it keeps on disk for the next agent.
    kept = json.loads(agent.answered_file.read_text())["pods"]
    assert len(kept) == 8 and agent.answered_file.stat().st_mode & 0o777 == 0o600
    # Deleted pods are forgotten at once.
    for name in names[-8:]:
        agent.forget_pod(client.read_namespaced_pod(name, NS))
    assert len(agent._answered) == 0


def test_a_pod_with_nothing_under_stasis_or_no_such_pod_is_one_clear_error(
    cluster: Cluster,
) -> None:
    node, api, _ = cluster
    node.run("c-unprotected", COUNTER)
    pod(api, "web", {"nginx": "c-unprotected"})
    try:
        r = subprocess.run(
            [
                STASIS,
                "k8s",
                "checkpoint",
                f"{NS}/web",
                "--kubeconfig",
                str(api.kubeconfig),
                "--timeout",
                "60",
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert r.returncode == 1
        assert r.stderr.strip() == (
            f"stasis: error: no container of pod {NS}/web is under "
            f"stasis on node {NODE} (runtimeClassName: stasis and "
            "STASIS_CHECKPOINT on the container)"
        )
        assert node.status("c-unprotected") == "RUNNING"
    finally:
        node.remove("c-unprotected")
    r = subprocess.run(
        [STASIS, "k8s", "checkpoint", f"{NS}/nope", "--kubeconfig", str(api.kubeconfig)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stderr.strip()) == (2, f"stasis: error: no pod {NS}/nope")
    r = subprocess.run(
        [STASIS, "k8s", "checkpoint", "nope", "--kubeconfig", str(api.kubeconfig)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stderr.strip()) == (2, "stasis: error: 'nope' is not NAMESPACE/POD")


def test_the_interval_annotation_sets_and_unsets_a_container_s_checkpoint_interval(
    cluster: Cluster,
) -> None:
    node, api, _ = cluster
    label = f"every-{secrets.token_hex(3)}"
    out = node.run("c-every", COUNTER, env={"STASIS_CHECKPOINT": label})  # no STASIS_INTERVAL
    wait_for(lambda: registered(node, "c-every"), 20, "the container's registration")
    pod(api, "every", {"main": "c-every"}, annotations={"stasis.dev/interval": "1"})
    try:
        wait_for(lambda: len(node.checkpoints(label)) >= 2, 60, "two interval checkpoints")
        # 1 s is below the node's floor (FLOOR_S here): raised, said once in the container's log
        # (the pod's later events do not ask again).
        assert (registered(node, "c-every") or {})["interval_s"] == FLOOR_S
        api.patch("pods", "every", {"metadata": {"labels": {"touched": "yes"}}}, namespace=NS)
        time.sleep(1)
        assert out.read_text().count(f"is below this node's minimum of {FLOOR_S} s") == 1
        # Taken off: the container's own (none) again.
        api.patch(
            "pods",
            "every",
            {"metadata": {"annotations": {"stasis.dev/interval": None}}},
            namespace=NS,
        )
        wait_for(
            lambda: (registered(node, "c-every") or {}).get("interval_s") == 0,
            30,
            "the interval to be the container's own again",
        )
        n = len(node.checkpoints(label))
        time.sleep(3)
        assert len(node.checkpoints(label)) == n
    finally:
        node.remove("c-every")


def test_the_emulator_refuses_what_the_chart_does_not_grant(cluster: Cluster) -> None:
    """The RBAC the tests rely on is enforced: the agent's token may not delete a pod or read
    a Secret (a Forbidden answer, as kube-apiserver's)."""
    from kubernetes.client.exceptions import ApiException

    from stasis.k8s import kube

    node, api, _ = cluster
    pod(api, "untouchable", {"main": "c-none"})
    client = kube.connect(str(cluster.kubeconfig))
    with pytest.raises(ApiException) as e:
        client.delete_namespaced_pod("untouchable", NS)
    assert e.value.status == 403
    with pytest.raises(ApiException) as e:
        client.list_namespaced_secret(NS)
    assert e.value.status == 403
    assert api.exists("pods", "untouchable", NS)
    denied = api.requests(denied=True)
    assert [(d["verb"], d["resource"]) for d in denied] == [("delete", "pods"), ("list", "secrets")]
    # What the last test checks counts from here.
    (api.workdir / "rbac-denied.jsonl").unlink()


def test_an_agent_without_an_api_says_so_in_one_line() -> None:
    r = subprocess.run(
        [
            STASIS,
            "k8s",
            "agent",
            "--node",
            NODE,
            "--kubeconfig",
            "/nonexistent/kubeconfig",
            "--no-daemon",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert r.stderr.startswith("stasis: error: no Kubernetes API from /nonexistent/kubeconfig: ")
    assert len(r.stderr.strip().splitlines()) == 1


def test_every_call_of_the_agent_is_one_the_chart_s_rbac_allows(cluster: Cluster) -> None:
    """Last of the module: what the agent did above, it did with the chart's permissions."""
    _, api, _ = cluster
    assert api.requests(denied=True) == []
    done = {(r["verb"], r["resource"]) for r in api.requests()}
    assert {
        ("watch", "nodes"),
        ("watch", "pods"),
        ("patch", "nodes"),
        ("create", "events"),
    } <= done, done
    # Nothing written to a pod (but the test above's attempts).
    assert not [
        r
        for r in api.requests()
        if r["resource"].startswith("pods")
        and r["verb"] not in ("get", "list", "watch")
        and r["name"] != "untouchable"
    ]
