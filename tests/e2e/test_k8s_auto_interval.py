"""`auto` checkpoint intervals of containers on a real node (containerd, runc, the stasis daemon of
`stasis-dev local-node`) with kmock's API emulator and the node agent: the interval is Young/Daly's
(stasis.interval) from the container's measured frozen time and the site's
k8s_interruption_rate_per_hour, and `stasis ps` shows it and why."""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stasis.interval import choose, mtbi_s
from tests.conftest import wait_for
from tests.e2e.containerd_node import Node
from tests.e2e.test_k8s_agent import AGENT_TOKEN, COUNTER, NODE, NS, Cluster, pod, registered
from tests.k8s.chart_rbac import agent_rules

# 120 interruptions per pod-hour: M = 30 s; a busybox counter's checkpoint freezes it for ~0.1 s,
# so Young/Daly's interval is a few seconds, between the floor and the ceiling set here.
RATE_PER_HOUR = 120.0
FLOOR_S = 1
CEILING_S = 600.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(Path(tempfile.mkdtemp(prefix="stasis-auto-")))
    c.node = Node(c.root, min_interval_s=FLOOR_S)
    try:
        c.node.up()
        c.node.configure(
            {
                "k8s_interruption_rate_per_hour": RATE_PER_HOUR,
                "interval_min_s": float(FLOOR_S),
                "interval_max_s": CEILING_S,
            }
        )
        c.api.start()
        c.kubeconfig = c.api.authorize(AGENT_TOKEN, agent_rules())
        c.api.create("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        c.start_agent()
        yield c
    finally:
        if c.agent is not None:
            c.agent.terminate()
            c.agent.wait(timeout=30)
        c.api.stop()
        c.node.down()


def ps_intervals(c: Cluster) -> dict[str, dict[str, Any]]:
    """`stasis ps --json`'s intervals, by container id."""
    r = c.node.stasis("ps", "--json")
    assert r.returncode == 0, r.stderr
    return {row["job"]: row["interval"] for row in json.loads(r.stdout) if "interval" in row}


def test_a_container_with_auto_checkpoints_at_young_daly_s_interval_from_its_cost(
    cluster: Cluster,
) -> None:
    node = cluster.node
    label = f"auto-{secrets.token_hex(3)}"
    node.run("c-auto", COUNTER, env={"STASIS_CHECKPOINT": label, "STASIS_INTERVAL": "auto"})
    try:
        wait_for(lambda: registered(node, "c-auto"), 20, "the container's registration")
        assert (registered(node, "c-auto") or {})["interval_auto"] is True
        # Before its first checkpoint: the cost is its memory's estimate, so the floor.
        wait_for(lambda: len(node.checkpoints(label)) >= 2, 60, "two interval checkpoints")
        shown = ps_intervals(cluster)["c-auto"]
        assert shown["kind"] == "container" and shown["requested"] == "auto"
        assert shown["cost_measured"] is True and shown["cost_s"] > 0
        # The number is stasis.interval's, from the same inputs.
        expected = choose(shown["cost_s"], mtbi_s(RATE_PER_HOUR), FLOOR_S, CEILING_S)
        assert shown["mtbi_s"] == mtbi_s(RATE_PER_HOUR) == 30.0
        assert shown["rate_per_hour"] == RATE_PER_HOUR
        assert shown["interval_s"] == pytest.approx(expected.interval_s)
        assert shown["raw_s"] == pytest.approx(expected.raw_s)
        assert shown["bound"] == expected.bound
        assert FLOOR_S < shown["interval_s"] < CEILING_S, shown  # Daly's value, not a bound
        assert "auto: checkpoint cost" in shown["why"]
        # The daemon's own listing has it too (its cost may have been measured again since).
        assert FLOOR_S < (registered(node, "c-auto") or {})["interval_s"] < CEILING_S
        # Checkpoints come about that often (the daemon's task looks every second), not at the
        # floor's pace.
        before = len(node.checkpoints(label))
        time.sleep(4 * shown["interval_s"])
        taken = len(node.checkpoints(label)) - before
        assert 1 <= taken <= 5, (taken, shown)
        text = node.stasis("ps")
        assert text.returncode == 0, text.stderr
        assert "c-auto" in text.stdout and "auto: checkpoint cost" in text.stdout
    finally:
        node.remove("c-auto")


def test_the_auto_annotation_sets_auto_and_its_removal_the_container_s_own(
    cluster: Cluster,
) -> None:
    node, api = cluster.node, cluster.api
    label = f"anno-{secrets.token_hex(3)}"
    node.run("c-anno", COUNTER, env={"STASIS_CHECKPOINT": label})  # no STASIS_INTERVAL
    try:
        wait_for(lambda: registered(node, "c-anno"), 20, "the container's registration")
        assert "c-anno" not in ps_intervals(cluster)  # no interval: nothing to show
        pod(api, "anno", {"main": "c-anno"}, annotations={"stasis.dev/interval": "auto"})
        wait_for(
            lambda: (registered(node, "c-anno") or {}).get("interval_auto") is True,
            30,
            "the annotation's auto",
        )
        wait_for(lambda: len(node.checkpoints(label)) >= 1, 60, "an interval checkpoint")
        assert ps_intervals(cluster)["c-anno"]["requested"] == "auto"
        api.patch(
            "pods",
            "anno",
            {"metadata": {"annotations": {"stasis.dev/interval": None}}},
            namespace=NS,
        )
        wait_for(
            lambda: (registered(node, "c-anno") or {}).get("interval_s") == 0,
            30,
            "the interval to be the container's own (none) again",
        )
        assert (registered(node, "c-anno") or {})["interval_auto"] is False
        assert "c-anno" not in ps_intervals(cluster)
    finally:
        node.remove("c-anno")


def test_the_node_s_default_interval_for_a_container_that_asks_for_none(
    cluster: Cluster,
) -> None:
    """Last in the module: the daemon keeps `interval = "auto"` from here on."""
    node = cluster.node
    node.configure({"interval": "auto"})
    label = f"dflt-{secrets.token_hex(3)}"
    node.run("c-dflt", COUNTER, env={"STASIS_CHECKPOINT": label})  # no STASIS_INTERVAL
    node.run("c-off", COUNTER, env={"STASIS_CHECKPOINT": f"{label}-off", "STASIS_INTERVAL": "off"})
    try:
        wait_for(lambda: registered(node, "c-dflt"), 20, "the container's registration")
        wait_for(lambda: registered(node, "c-off"), 20, "the other container's registration")
        assert (registered(node, "c-dflt") or {})["interval_auto"] is True
        off = registered(node, "c-off") or {}
        assert (off["interval_auto"], off["interval_s"]) == (False, 0)
        wait_for(lambda: len(node.checkpoints(label)) >= 1, 60, "an interval checkpoint")
        shown = ps_intervals(cluster)
        assert shown["c-dflt"]["requested"] == "auto" and "c-off" not in shown
        assert node.checkpoints(f"{label}-off") == []
    finally:
        node.remove("c-dflt")
        node.remove("c-off")
