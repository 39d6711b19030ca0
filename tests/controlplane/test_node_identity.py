"""A cluster token is not a master key (issue 27, item 4). Each node gets its own credential when
it joins; only a command's node leases it, only the holder of its lease renews or acknowledges
it (quoting the lease), and a command moves only forward. Jobs are addressed by (cluster, node,
job): a job id reported by two nodes is refused, never resolved by name order. The attackers
play through the control plane's HTTP API: whoever holds a stolen cluster token (a plain HTTP
client, no node), another node of the same cluster, and a node of another cluster."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from tests.conftest import wait_for
from tests.controlplane.conftest import SQLITE_ONLY, ControlPlane
from tests.controlplane.fakenode import FakeNode

REPORT = {"host": "evil", "stasis_version": "0.test", "check_ok": True}


def events_of(cp: ControlPlane, kind: str) -> list[dict[str, Any]]:
    return [
        e for e in cp.call("GET", "/api/v1/events?limit=1000", cp.admin)[1] if e["kind"] == kind
    ]


# SQLite only: who may take what is decided in Python (leases on both: test_commands).
@SQLITE_ONLY
def test_a_stolen_cluster_token_and_another_node_cannot_take_a_nodes_commands(
    controlplane: ControlPlane,
) -> None:
    cp = controlplane
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    a, b = FakeNode(cp, hpc, "node-a"), FakeNode(cp, hpc, "node-b")
    for n in (a, b):
        n.register()
    assert a.token.startswith("stasis_node_") and a.token != b.token
    a.heartbeat([{"job": "j1"}])
    b.heartbeat([])
    stolen = hpc["token"]  # a plain HTTP client holding the cluster token, no node

    # Joining under a name that already has a credential: refused, in one line.
    status, said = cp.call("POST", "/api/v1/nodes/register", stolen, {**REPORT, "name": "node-a"})
    assert (
        status == 409
        and said["error"].startswith(
            f"node node-a of cluster {hpc['cluster_id']} is already joined"
        )
        and "`stasis controlplane nodes reset node-a --cluster " in said["error"]
    ), said
    assert "\n" not in said["error"]

    status, cmd = cp.call("POST", "/api/v1/commands", cp.admin, {"kind": "checkpoint", "job": "j1"})
    assert status == 201 and cmd["node"] == "node-a" and "lease_id" not in cmd, cmd
    cid = cmd["id"]
    lease_a = "/api/v1/nodes/node-a/commands/lease"

    # The stolen token: no lease, no heartbeat as the node, no renewal, no acknowledgement.
    for method, path, body in (
        ("POST", lease_a, {}),
        ("POST", "/api/v1/nodes/node-a/heartbeat", {"jobs": []}),
        ("POST", f"/api/v1/nodes/node-a/commands/{cid}/renew", {"lease_id": "x"}),
        (
            "POST",
            f"/api/v1/commands/{cid}/ack",
            {"lease_id": "x", "ok": True, "result": {"checkpoint": "forged"}},
        ),
    ):
        status, said = cp.call(method, path, stolen, body)
        assert status == 403 and "needs the node's own credential" in said["error"], (
            path,
            status,
            said,
        )
    # Another node of the cluster: not node-a's lease, nor its command.
    status, said = cp.call("POST", lease_a, b.token, {})
    assert (status, said) == (
        403,
        {"error": "this credential is node node-b's: it may not " "act as node node-a"},
    )
    assert b.lease() is None  # nothing of its own

    got = a.lease()
    assert got is not None and got["id"] == cid and got["lease_id"].startswith("lease_")
    lease_id = got["lease_id"]
    # The lease id is the holder's alone: not shown in the listings.
    assert all("lease_id" not in c for c in cp.call("GET", "/api/v1/commands", stolen)[1])
    assert "lease_id" not in cp.call("GET", f"/api/v1/commands/{cid}", cp.admin)[1]
    # node-b, even quoting node-a's lease: refused.
    for path, body in (
        (f"/api/v1/nodes/node-b/commands/{cid}/renew", {"lease_id": lease_id}),
        (
            f"/api/v1/commands/{cid}/ack",
            {"lease_id": lease_id, "ok": True, "result": {"checkpoint": "forged"}},
        ),
    ):
        status, said = cp.call("POST", path, b.token, body)
        assert (status, said) == (
            403,
            {
                "error": f"command {cid} is node node-a's, not "
                "node-b's: only the node it is for carries "
                "it out"
            },
        ), (path, said)
    # node-a itself, with a lease it does not hold: refused (409).
    for path, body in (
        (f"/api/v1/nodes/node-a/commands/{cid}/renew", {"lease_id": "lease_x"}),
        (
            f"/api/v1/commands/{cid}/ack",
            {"lease_id": "lease_x", "ok": False, "result": {"error": "no"}},
        ),
    ):
        status, said = cp.call("POST", path, a.token, body)
        assert status == 409 and said["error"].startswith(
            f"command {cid} is not leased to node node-a under lease lease_x"
        ), said
    # A node of another cluster: it does not even see the command.
    evil = FakeNode(cp, cp.json("clusters", "add", "evil", "--kind", "slurm"), "x")
    evil.register()
    status, said = cp.call(
        "POST",
        f"/api/v1/commands/{cid}/ack",
        evil.token,
        {"lease_id": lease_id, "ok": True, "result": {"checkpoint": "f"}},
    )
    assert (status, said) == (404, {"error": f"no command {cid} for this cluster"})

    # The legitimate node renews and acknowledges, quoting its lease: carried out once.
    assert (
        cp.call(
            "POST", f"/api/v1/nodes/node-a/commands/{cid}/renew", a.token, {"lease_id": lease_id}
        )[0]
        == 200
    )
    done = a.ack(cid, True, {"checkpoint": "20261206T000000Z-abcdef", "label": "j1"})
    assert (done["state"], done["attempts"], done["result"]["checkpoint"]) == (
        "done",
        1,
        "20261206T000000Z-abcdef",
    )
    # Answered again (a lost answer): from its record, never applied again; not by others.
    again = a.ack(cid, False, {"error": "changed my mind"})
    assert (again["state"], again["result"]) == ("done", done["result"])
    status, _ = cp.call(
        "POST",
        f"/api/v1/commands/{cid}/ack",
        b.token,
        {"lease_id": lease_id, "ok": False, "result": {}},
    )
    assert status == 403
    assert a.lease() is None  # done: never leased again
    assert [e["message"] for e in events_of(cp, "command-done")] == [
        f'checkpoint j1 ({cid}): {{"checkpoint": "20261206T000000Z-abcdef", "label": "j1"}}'
    ]
    final = cp.call("GET", f"/api/v1/commands/{cid}", cp.admin)[1]
    assert (final["state"], final["attempts"], final["result"]) == ("done", 1, done["result"])


# SQLite only: the cluster check is Python.
@SQLITE_ONLY
def test_a_job_id_reported_from_another_cluster_cannot_divert_its_commands(
    controlplane: ControlPlane,
) -> None:
    cp = controlplane
    # "aaa" sorts before "hpc": by name order its report would have won.
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    aaa = cp.json("clusters", "add", "aaa", "--kind", "slurm")
    a, b = FakeNode(cp, hpc, "node-a"), FakeNode(cp, hpc, "node-b")
    thief = FakeNode(cp, aaa, "node-a")  # the same node name too
    for n in (a, b, thief):
        n.register()
    a.heartbeat([{"job": "j1", "label": "sim", "user": "alice"}])
    b.heartbeat([])
    thief.heartbeat([{"job": "j1", "label": "sim", "user": "alice"}])

    said = (
        "job j1 is reported by 2 nodes (aaa/node-a, hpc/node-a): name its cluster and "
        "node (--cluster, --node)"
    )
    for path, body in (
        ("/api/v1/commands", {"kind": "checkpoint", "job": "j1"}),
        ("/api/v1/migrations", {"job": "j1", "to": "node-b"}),
    ):
        assert cp.call("POST", path, cp.admin, body) == (409, {"error": said}), path
    r = cp.cli("checkpoint", "j1", "--wait", "1")
    assert (r.returncode, r.stderr.strip()) == (2, f"stasis: error: {said}")
    assert cp.call("GET", "/api/v1/commands", cp.admin)[1] == []  # nothing queued
    assert thief.lease() is None

    # Named by its cluster (id or name) and node, it goes to its node only.
    status, cmd = cp.call(
        "POST",
        "/api/v1/migrations",
        cp.admin,
        {"job": "j1", "to": "node-b", "cluster": "hpc", "node": "node-a"},
    )
    assert status == 201 and (cmd["cluster_id"], cmd["node"]) == (hpc["cluster_id"], "node-a")
    assert thief.lease() is None
    got = a.lease()
    assert got is not None and got["id"] == cmd["id"]
    # The thief's node credential cannot answer it either (not even as "node-a").
    status, _ = cp.call(
        "POST",
        f"/api/v1/commands/{cmd['id']}/ack",
        thief.token,
        {
            "lease_id": got["lease_id"],
            "ok": True,
            "result": {"checkpoint": "20261206T000000Z-000000"},
        },
    )
    assert status == 404
    done = a.ack(cmd["id"], True, {"checkpoint": "20261206T000000Z-abcdef"})
    restore = cp.call("GET", f"/api/v1/commands/{done['result']['next']}", cp.admin)[1]
    assert restore["node"] == "node-b" and restore["args"] == {
        "checkpoint": "20261206T000000Z-abcdef",
        "migrated_from": cmd["id"],
        "job": "j1",
        "label": "sim",
        "user": "alice",
        "from_node": "node-a",
        "seal": None,
        "fence": True,
    }  # the node commits before it resumes (issue 28's fencing)
    assert thief.lease() is None and a.lease() is None

    # Policies address the jobs they pick by (cluster, node, job) too: each its own node.
    cp.json("policies", "add", "all", "--on", "webhook", "--action", "checkpoint")
    assert cp.json("policies", "run", "all")["queued"] == 2
    for n in (thief, a):
        got = n.lease()
        assert got is not None and got["args"]["job"] == "j1" and got["args"]["policy"] == "all"
    # A drain of a node name two clusters have: refused unless the cluster is named.
    status, refused = cp.call("POST", "/api/v1/nodes/node-a/drain", cp.admin, {})
    assert (status, refused) == (
        409,
        {"error": "node node-a is in several clusters (aaa, hpc): " "name its cluster (--cluster)"},
    )


# SQLite only: credentials are hashes compared in Python.
@SQLITE_ONLY
def test_an_admin_reset_lets_a_node_join_again_and_its_old_credential_is_dead(
    controlplane: ControlPlane,
) -> None:
    cp = controlplane
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    a = FakeNode(cp, hpc, "node-a")
    a.register()
    old = a.token
    (listed,) = cp.json("nodes")
    assert listed["credential_since"] is not None
    r = cp.cli("nodes", "reset", "node-a")
    assert (r.returncode, r.stdout.strip()) == (
        0,
        "node node-a reset: it joins again with the cluster token",
    ), r.stderr
    assert cp.json("nodes")[0]["credential_since"] is None
    status, said = cp.call("POST", "/api/v1/nodes/node-a/heartbeat", old, {"jobs": []})
    assert status == 401 and said["error"].startswith("unknown node credential"), said
    again = FakeNode(cp, hpc, "node-a")
    again.register()
    assert again.token != old
    again.heartbeat([])
    assert [e["node"] for e in events_of(cp, "node-reset")] == ["node-a"]
    # Only the admin resets.
    assert cp.call("POST", "/api/v1/nodes/node-a/reset", hpc["token"], {})[0] == 403
    assert cp.call("POST", "/api/v1/nodes/node-a/reset", again.token, {})[0] == 403


def test_ids_from_nodes_are_checked_before_they_are_kept(controlplane: ControlPlane) -> None:
    cp = controlplane
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    a = FakeNode(cp, hpc, "node-a")
    a.register()
    for job in (
        {"job": "../../etc/passwd"},
        {"job": "j1", "label": "<script>"},
        {"job": "j1", "user": "a b"},
        {"job": "j\n1"},
        {"job": "x" * 101},
        {"job": "j1", "restored_from": "../x"},
    ):
        status, said = cp.call(
            "POST",
            "/api/v1/nodes/node-a/heartbeat",
            a.token,
            {"jobs": [{"state": "running", **job}]},
        )
        assert status == 400 and said["error"].startswith("bad request: jobs.0."), (job, said)
    status, said = cp.call(
        "POST",
        "/api/v1/nodes/register",
        a.token,
        {**REPORT, "name": "node-a", "problems": ["bad\x1b[31m"]},
    )
    assert status == 400, said
    assert cp.call("GET", "/api/v1/jobs", cp.admin)[1] == []


def test_a_lease_that_ran_out_and_was_given_again_cannot_be_answered(world_tmp: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp))
    cp = ControlPlane(root, str(root / "cp.db"))
    cp.start("--command-lease", "1")
    try:
        hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
        a = FakeNode(cp, hpc, "node-a")
        a.register()
        a.heartbeat([{"job": "j1"}])
        status, cmd = cp.call(
            "POST", "/api/v1/commands", cp.admin, {"kind": "checkpoint", "job": "j1"}
        )
        assert status == 201
        # Not answerable before it is leased: queued never jumps to done.
        status, said = cp.call(
            "POST",
            f"/api/v1/commands/{cmd['id']}/ack",
            a.token,
            {"lease_id": "", "ok": True, "result": {}},
        )
        assert status == 409 and "it was never leased" in said["error"], said
        first = a.lease()
        assert first is not None
        time.sleep(2.1)  # its lease runs out: leased again, under a new id
        second = a.lease()
        assert second is not None and second["id"] == cmd["id"]
        assert second["lease_id"] != first["lease_id"]
        status, said = cp.call(
            "POST",
            f"/api/v1/commands/{cmd['id']}/ack",
            a.token,
            {
                "lease_id": first["lease_id"],
                "ok": True,
                "result": {"checkpoint": "20261206T000000Z-000001"},
            },
        )
        assert status == 409 and said["error"].startswith(
            f"command {cmd['id']} is not leased to node node-a under lease " f"{first['lease_id']}"
        ), said
        done = a.ack(cmd["id"], True, {"checkpoint": "20261206T000000Z-000002"})
        assert (done["state"], done["attempts"], done["result"]["checkpoint"]) == (
            "done",
            2,
            "20261206T000000Z-000002",
        )
    finally:
        cp.stop()


# SQLite only: approval is a flag read and checked in Python.
@SQLITE_ONLY
def test_with_approve_joins_a_node_joined_with_a_stolen_token_gets_no_work_until_approved(
    controlplane: ControlPlane,
) -> None:
    """A cluster added with --approve-joins: a node joined with its (stolen) token is pending:
    it may heartbeat, but is no migration, drain or policy target and leases no command, until
    an admin approves it; then it is one like the others."""
    from tests.controlplane.test_dashboard import Browserless

    cp = controlplane
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm", "--approve-joins")
    assert hpc["approve_joins"] is True
    a, b = FakeNode(cp, hpc, "node-a"), FakeNode(cp, hpc, "node-b")
    for n in (a, b):
        n.register()
        assert cp.json("nodes", "approve", n.name)["was_pending"] is True
    a.heartbeat([{"job": "j1"}, {"job": "j2"}])
    b.heartbeat([])

    # The thief joins a node of its own with the stolen cluster token.
    evil = FakeNode(cp, hpc, "node-evil")
    evil.register()
    assert evil.token.startswith("stasis_node_")
    evil.heartbeat([{"job": "j-evil"}])  # it may report
    listed = {n["name"]: n for n in cp.json("nodes")}
    assert (listed["node-evil"]["state"], listed["node-evil"]["approved"]) == ("pending", False)
    assert events_of(cp, "node-pending")[-1]["node"] == "node-evil"

    # No migration to it, no command for it.
    status, said = cp.call("POST", "/api/v1/migrations", cp.admin, {"job": "j1", "to": "node-evil"})
    assert (
        status == 409
        and said["error"].startswith(
            f"node node-evil of cluster {hpc['cluster_id']} is pending: it joined and waits for "
            "an admin's approval"
        )
        and "\n" not in said["error"]
    ), said
    status, said = cp.call(
        "POST", "/api/v1/commands", cp.admin, {"kind": "checkpoint", "job": "j-evil"}
    )
    assert status == 409 and "is pending" in said["error"], said
    # A drain of node-a and a migrate policy send its jobs to node-b only.
    cp.json("policies", "add", "move", "--every", "1", "--action", "migrate", "--node", "node-a")
    wait_for(
        lambda: len([c for c in cp.json("actions") if c["args"].get("policy") == "move"]) >= 2,
        20,
        "the policy to migrate a's jobs",
    )
    drained = cp.call("POST", "/api/v1/nodes/node-a/drain", cp.admin, {})[1]
    targets = {c["args"].get("then_restore_on") for c in cp.json("actions")} - {None}
    assert targets == {"node-b"}, (targets, drained)
    cp.json("policies", "rm", "move")
    assert evil.lease() is None  # nothing leased to it
    assert not [c for c in cp.json("actions") if c["node"] == "node-evil"]

    # The dashboard shows it pending, with what approves it.
    web = Browserless(cp)
    web.login(cp.admin)
    page = web.call("GET", "/ui/")[2]
    assert (
        "pending: <code>stasis controlplane nodes approve node-evil --cluster hpc</code>" in page
    ), page
    assert "approved by an admin" in page

    # Approved: a target like the others.
    assert cp.json("nodes", "approve", "node-evil", "--cluster", "hpc")["was_pending"] is True
    status, cmd = cp.call(
        "POST", "/api/v1/commands", cp.admin, {"kind": "checkpoint", "job": "j-evil"}
    )
    assert status == 201, cmd
    got = evil.lease()
    assert got is not None and got["id"] == cmd["id"]
    # Real nodes heartbeat every few seconds; lost-after is 3 s here, on a machine that may be busy.
    b.heartbeat([])
    evil.heartbeat([{"job": "j-evil"}])
    status, moved = cp.call(
        "POST", "/api/v1/migrations", cp.admin, {"job": "j-evil", "to": "node-b"}
    )
    assert status == 201, moved
    assert {n["name"]: n["state"] for n in cp.json("nodes")}["node-evil"] == "ready"


# SQLite only: approval is a flag read and checked in Python.
@SQLITE_ONLY
def test_without_approve_joins_nodes_are_approved_at_join(controlplane: ControlPlane) -> None:
    cp = controlplane
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    assert hpc["approve_joins"] is False
    n = FakeNode(cp, hpc, "node-a")
    n.register()
    (listed,) = cp.json("nodes")
    assert (listed["state"], listed["approved"]) == ("ready", True)
    # Switched on later: the next node to join waits; node-a keeps its approval.
    assert cp.json("clusters", "set", "hpc", "--approve-joins")["approve_joins"] is True
    FakeNode(cp, hpc, "node-b").register()
    assert {x["name"]: x["state"] for x in cp.json("nodes")} == {
        "node-a": "ready",
        "node-b": "pending",
    }
    r = cp.cli("clusters", "set", "hpc", "--approve-joins", token=hpc["token"])
    assert r.returncode != 0 and "this needs the admin token" in r.stderr, r.stderr


def test_a_real_node_pending_approval_says_so_and_takes_commands_once_approved(
    world_tmp: Path,
) -> None:
    from tests.conftest import new_daemon, workload
    from tests.controlplane.test_node import node_env

    root = Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp))
    cp = ControlPlane(root, str(root / "cp.db"))
    cp.start()
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm", "--approve-joins")
    d = new_daemon(world_tmp, "node-p", env=node_env(cp, hpc, "node-p"))
    d.start()
    try:
        job = d.run(*workload("counter.py"), label="c")["job"]
        wait_for(lambda: [j["job"] for j in cp.json("jobs")] == [job], 30, "its job reported")
        assert {n["name"]: n["state"] for n in cp.json("nodes")} == {"node-p": "pending"}
        log = d.root / "daemon.log"
        assert (
            log.read_text().count(
                "joined the control plane, pending: an admin approves "
                "this node (`stasis controlplane nodes approve "
                "node-p`)"
            )
            == 1
        )
        status, said = cp.call(
            "POST", "/api/v1/commands", cp.admin, {"kind": "checkpoint", "job": job}
        )
        assert status == 409 and "is pending" in said["error"], said
        cp.json("nodes", "approve", "node-p")
        status, cmd = cp.call(
            "POST", "/api/v1/commands", cp.admin, {"kind": "checkpoint", "job": job}
        )
        assert status == 201, cmd

        def done() -> bool:
            c = cp.call("GET", f"/api/v1/commands/{cmd['id']}", cp.admin)[1]
            return bool(c["state"] == "done")

        wait_for(done, 30, "the checkpoint once approved")
        assert len(d.json("checkpoints")) == 1
    finally:
        d.kill_all()
        d.stop()
        cp.stop()
