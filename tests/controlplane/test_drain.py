"""What a drain asks of the nodes, seen from the control plane: on a Kubernetes cluster as on a
Slurm one, a node that reports a scheduler state gets one `drain` command (its daemon cordons
or drains it and checkpoints and evicts or requeues the scheduler's jobs), and those jobs are
listed as handled by it, not migrated; the daemon's own jobs are migrated. A node whose
scheduler jobs cannot be drained from here is refused with one line, nothing queued. The nodes
are spoken by the test over HTTP with their cluster's token (tests.controlplane.fakenode): the
daemons' side of a drain is tested in tests/e2e (Slurm, and Kubernetes with kmock)."""

from __future__ import annotations

from typing import Any

from tests.controlplane.conftest import ControlPlane
from tests.controlplane.fakenode import FakeNode


def drain(cp: ControlPlane, node: str) -> tuple[int, Any]:
    return cp.call("POST", f"/api/v1/nodes/{node}/drain", cp.admin, {"reason": "kernel update"})


def test_a_kubernetes_node_is_drained_by_its_daemon_and_its_own_jobs_migrate(
    controlplane: ControlPlane,
) -> None:
    cp = controlplane
    kube = cp.json("clusters", "add", "kube", "--kind", "kubernetes")
    a, b, c = (FakeNode(cp, kube, n) for n in ("kn-a", "kn-b", "kn-c"))
    for n in (a, b, c):
        n.register()
    a.heartbeat(
        [{"job": "ctr-1", "kind": "container", "partition": "ml"}, {"job": "d1"}],
        scheduler_state="Ready",
    )
    b.heartbeat([], scheduler_state="Ready")
    c.heartbeat([{"job": "ctr-2", "kind": "container"}])  # no Kubernetes API: no state

    status, plan = drain(cp, "kn-a")
    assert status == 201, plan
    assert plan["drain"]["kind"] == "drain" and plan["drain"]["node"] == "kn-a"
    assert plan["drain"]["args"] == {"reason": "kernel update"}
    assert plan["handled"] == [{"job": "ctr-1", "kind": "container", "label": "ctr-1"}]
    (moved,) = plan["migrations"]
    assert (moved["args"]["job"], moved["args"]["then_restore_on"]) == ("d1", "kn-b")
    # The node leases the drain first, then the migration's checkpoint; nothing for ctr-1.
    first = a.lease()
    assert first is not None and first["id"] == plan["drain"]["id"]
    done = a.ack(
        first["id"],
        True,
        {
            "requeued": [{"job": "ctr-1", "checkpoint": "ck1", "label": "ctr-1", "pod": "ml/p-1"}],
            "evicted": ["ml/p-1"],
            "failed": [],
        },
    )
    assert done["state"] == "done"
    second = a.lease()
    assert second is not None and second["id"] == moved["id"]
    assert second["args"]["job"] == "d1"
    assert a.lease() is None
    assert [x["args"].get("job") for x in cp.json("actions")] == [None, "d1"]

    # A node that reports no scheduler state: its containers cannot be drained from here.
    status, said = drain(cp, "kn-c")
    assert (status, said) == (
        400,
        {
            "error": "node kn-c reports no scheduler state: its 1 "
            "container job(s) cannot be drained in their "
            "scheduler from here"
        },
    )
    assert c.lease() is None  # nothing queued
    # A node with none of the scheduler's jobs and no state: nothing for its daemon to do.
    c.heartbeat([])
    status, plan = drain(cp, "kn-c")
    assert (
        status == 201
        and plan["drain"] is None
        and plan["handled"] == []
        and plan["migrations"] == []
    )


def test_a_slurm_node_is_drained_as_before(controlplane: ControlPlane) -> None:
    cp = controlplane
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    a, b = FakeNode(cp, hpc, "sn-a"), FakeNode(cp, hpc, "sn-b")
    for n in (a, b):
        n.register()
    a.heartbeat(
        [{"job": "1234", "kind": "slurm", "partition": "debug"}, {"job": "d1"}],
        scheduler_state="MIXED",
    )
    b.heartbeat([{"job": "d2"}])  # stasis's own jobs only: no Slurm state
    status, plan = drain(cp, "sn-a")
    assert status == 201 and plan["drain"]["node"] == "sn-a"
    assert plan["handled"] == [{"job": "1234", "kind": "slurm", "label": "1234"}]
    assert [m["args"]["then_restore_on"] for m in plan["migrations"]] == ["sn-b"]
    # A node with no other ready node for its own jobs: refused, its drain not queued.
    solo = FakeNode(cp, cp.json("clusters", "add", "lab", "--kind", "slurm"), "solo")
    solo.register()
    solo.heartbeat([{"job": "1235", "kind": "slurm"}, {"job": "d3"}], scheduler_state="IDLE")
    status, said = drain(cp, "solo")
    assert (status, said) == (
        400,
        {"error": "no other ready node in cluster lab to take the " "1 job(s) of solo"},
    )
    assert solo.lease() is None
