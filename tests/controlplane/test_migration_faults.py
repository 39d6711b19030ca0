"""A migration's halves under faults, on the control plane's side (a real `stasis controlplane
serve`, SQLite; the nodes spoken over HTTP by the test, as tests/controlplane/fakenode.py does,
to fail on cue): a failed restore half is retried with backoff, then re-targeted to another
ready node of the cluster with the seal its source made for that node, then reported failed
naming the checkpoint; a restore half held by a node that stops heartbeating is re-targeted once
its lease runs out; a not-ready node is never a migration's target; a control plane killed
mid-migration loses nothing of it."""

from __future__ import annotations

import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.controlplane.conftest import ControlPlane
from tests.controlplane.fakenode import FakeNode


def seal(n: int) -> dict[str, str]:
    return {"key_id": f"{n:032x}", "hmac_sha256": f"{n:064x}"}


class Site:
    def __init__(self, cp: ControlPlane, cluster: dict[str, str]) -> None:
        self.cp, self.cluster = cp, cluster
        self.nodes: dict[str, FakeNode] = {}

    def node(self, name: str, check_ok: bool = True, problems: tuple[str, ...] = ()) -> FakeNode:
        n = FakeNode(self.cp, self.cluster, name)
        joined = n.call(
            "POST",
            "/api/v1/nodes/register",
            {
                "name": name,
                "cluster_id": n.cluster_id,
                "host": name,
                "stasis_version": "0.test",
                "criu_version": "4.0",
                "check_ok": check_ok,
                "problems": list(problems),
            },
        )
        n.token = joined["node_token"]
        self.nodes[name] = n
        return n

    def beat(self, *silent: str) -> None:
        for name, n in self.nodes.items():
            if name not in silent:
                n.heartbeat([{"job": "j-1"}] if name == "src" else [])

    def command(self, command_id: str) -> dict[str, Any]:
        status, c = self.cp.call("GET", f"/api/v1/commands/{command_id}", self.cp.admin)
        assert status == 200, c
        return dict(c)

    def migrate(self, to: str) -> dict[str, Any]:
        status, first = self.cp.call(
            "POST", "/api/v1/migrations", self.cp.admin, {"job": "j-1", "to": to}
        )
        assert status == 201, first
        return dict(first)

    def checkpointed(self, first: dict[str, Any]) -> dict[str, Any]:
        """The source node takes the checkpoint, sealed for every node it was asked to."""
        got = self.nodes["src"].lease()
        assert got is not None and got["id"] == first["id"], got
        targets = [got["args"]["then_restore_on"], *got["args"].get("or_on", [])]
        seals = {t: seal(i + 1) for i, t in enumerate(targets)}
        done = self.nodes["src"].ack(
            first["id"],
            True,
            {
                "checkpoint": "20260101T000000Z-abcdef",
                "label": "j-1",
                "size_bytes": 1,
                "seal": seals[targets[0]],
                "seals": seals,
            },
        )
        assert done["state"] == "done", done
        return done


@pytest.fixture(params=["sqlite"])
def site(request: pytest.FixtureRequest, world_tmp: Path) -> Iterator[Site]:
    """SQLite; PostgreSQL where a test asks (indirect): the retries' queries on both."""
    root = Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp))
    db = (
        str(root / "cp.db")
        if request.param == "sqlite"
        else request.getfixturevalue("postgres").new_database()
    )
    cp = ControlPlane(root, db)
    cp.start("--command-lease", "2", "--lost-after", "4")
    try:
        yield Site(cp, cp.json("clusters", "add", "hpc", "--kind", "slurm"))
    finally:
        cp.stop()


def lease_when_due(site: Site, name: str, command_id: str, not_before_s: float) -> dict[str, Any]:
    """Leased by `name` (heartbeating all), not earlier than `not_before_s` from now."""
    start = time.monotonic()

    def leased() -> dict[str, Any] | None:
        site.beat()
        got = site.nodes[name].lease()
        if got is not None:
            assert got["id"] == command_id, got
            assert time.monotonic() - start >= not_before_s, "leased before its backoff"
        return got

    return wait_for(leased, 30, f"{name} to lease {command_id}")


@pytest.mark.parametrize("site", ["sqlite", "postgresql"], indirect=True)
def test_a_failed_restore_is_retried_with_backoff_then_retargeted_then_fails_naming_it(
    site: Site,
) -> None:
    for name in ("src", "b", "c"):
        site.node(name)
    site.beat()
    first = site.migrate("b")
    assert first["args"]["or_on"] == ["c"], first  # the other ready node, sealed for too
    done = site.checkpointed(first)
    r1 = site.command(done["result"]["next"])
    assert (r1["node"], r1["args"]["seal"]) == ("b", seal(1)), r1

    # b fails it: retried on b after a backoff, as a new command the failed one names
    got = lease_when_due(site, "b", r1["id"], 0)
    site.nodes["b"].ack(got["id"], False, {"error": "CRIU failed: restore of pid 7"})
    r1 = site.command(r1["id"])
    assert r1["state"] == "failed" and r1["result"]["next"], r1
    r2 = site.command(r1["result"]["next"])
    assert r2["node"] == "b" and r2["state"] == "queued", r2
    assert site.nodes["b"].lease() is None  # not before its backoff
    got = lease_when_due(site, "b", r2["id"], 0.5)
    site.nodes["b"].ack(got["id"], False, {"error": "CRIU failed again"})

    # b failed it twice: re-targeted to c, with the seal its source made for c
    r3 = site.command(site.command(r2["id"])["result"]["next"])
    assert (r3["node"], r3["args"]["seal"]) == ("c", seal(2)), r3
    assert r3["args"]["migrated_from"] == first["id"]
    for _ in range(2):
        rid = r3["id"]
        got = lease_when_due(site, "c", rid, 0)
        site.nodes["c"].ack(got["id"], False, {"error": "no room"})
        r3 = site.command(rid)
        if r3["result"].get("next"):
            r3 = site.command(r3["result"]["next"])
    # Nowhere left: failed, naming the checkpoint that is kept; nothing hangs, nothing "done".
    assert r3["state"] == "failed" and not r3["result"].get("next"), r3
    error = r3["result"]["error"]
    assert "20260101T000000Z-abcdef" in error and "\n" not in error, error
    assert "stasis restore 20260101T000000Z-abcdef" in error, error


def test_a_refused_restore_is_not_retried(site: Site) -> None:
    for name in ("src", "b", "c"):
        site.node(name)
    site.beat()
    done = site.checkpointed(site.migrate("b"))
    got = lease_when_due(site, "b", done["result"]["next"], 0)
    refused = (
        "restore of checkpoint 20260101T000000Z-abcdef refused: its seal is signed by "
        "a key this node does not trust"
    )
    site.nodes["b"].ack(got["id"], False, {"error": refused, "permanent": True})
    r = site.command(got["id"])
    assert r["state"] == "failed" and not r["result"].get("next"), r
    assert r["result"]["error"] == refused, r  # the node's own line, as it said it


@pytest.mark.parametrize("site", ["sqlite", "postgresql"], indirect=True)
def test_a_restore_held_by_a_lost_node_is_retargeted_after_its_lease(site: Site) -> None:
    for name in ("src", "b", "c"):
        site.node(name)
    site.beat()
    done = site.checkpointed(site.migrate("b"))
    got = lease_when_due(site, "b", done["result"]["next"], 0)

    # b goes silent holding the lease: once its lease ran out and it is lost, c gets it.
    def moved() -> dict[str, Any] | None:
        site.beat("b")
        return site.nodes["c"].lease()

    again = wait_for(moved, 30, "the restore to be re-targeted to c")
    assert again["kind"] == "restore" and again["args"]["seal"] == seal(2), again
    old = site.command(got["id"])
    assert old["state"] == "failed" and old["result"]["next"] == again["id"], old
    assert "node b" in old["result"]["error"] and "lost" in old["result"]["error"], old
    site.nodes["c"].ack(again["id"], True, {"job": "j-2", "checkpoint": "x"})
    assert site.command(again["id"])["state"] == "done"
    # b back late with its answer: refused, the re-targeted restore stands
    status, late = site.cp.call(
        "POST",
        f"/api/v1/commands/{got['id']}/ack",
        site.nodes["b"].token,
        {"lease_id": got["lease_id"], "ok": True, "result": {"job": "j-3"}},
    )
    assert site.command(got["id"])["state"] == "failed", late


def test_a_not_ready_node_is_no_migration_target(site: Site) -> None:
    site.node("src")
    site.node("sick", check_ok=False, problems=("the job database is unreadable (restore it)",))
    site.node("c")
    site.beat()
    status, refused = site.cp.call(
        "POST", "/api/v1/migrations", site.cp.admin, {"job": "j-1", "to": "sick"}
    )
    assert status == 409, refused
    error = refused["error"]
    assert "node sick is not ready" in error and "job database is unreadable" in error, error
    assert "\n" not in error
    # Nor an alternate of a migration to another node.
    assert site.migrate("c")["args"].get("or_on", []) == []


def test_a_control_plane_killed_mid_migration_loses_nothing(site: Site) -> None:
    for name in ("src", "b"):
        site.node(name)
    site.beat()
    first = site.migrate("b")
    got = site.nodes["src"].lease()
    assert got is not None
    cp = site.cp
    assert cp.proc is not None
    cp.proc.send_signal(signal.SIGKILL)
    cp.proc.wait()
    cp.start("--command-lease", "2", "--lost-after", "4")
    # The node's answer to the lease it holds is taken after the restart.
    done = site.nodes["src"].ack(
        first["id"],
        True,
        {"checkpoint": "20260101T000000Z-abcdef", "label": "j-1", "size_bytes": 1, "seal": seal(1)},
    )
    assert done["state"] == "done" and done["result"]["next"], done
    cp.proc.send_signal(signal.SIGKILL)
    cp.proc.wait()
    cp.start("--command-lease", "2", "--lost-after", "4")
    got = lease_when_due(site, "b", done["result"]["next"], 0)
    assert (
        got["args"]["seal"] == seal(1) and got["args"]["checkpoint"] == "20260101T000000Z-abcdef"
    ), got


def test_a_command_leased_again_and_again_unanswered_fails(site: Site) -> None:
    """A node whose daemon dies carrying a command out, each time it leases it: the command
    fails after MAX_LEASES leases, saying so, instead of being given out for ever."""
    from stasis.controlplane.commandqueue import MAX_LEASES

    site.node("src")
    site.beat()
    status, cmd = site.cp.call(
        "POST", "/api/v1/commands", site.cp.admin, {"kind": "checkpoint", "job": "j-1"}
    )
    assert status == 201, cmd
    for _ in range(MAX_LEASES):
        lease_when_due(site, "src", cmd["id"], 0)  # never answered

    def failed() -> dict[str, Any] | None:
        site.beat()
        c = site.command(cmd["id"])
        return c if c["state"] == "failed" else None

    c = wait_for(failed, 30, "the command to fail")
    assert f"leased it {MAX_LEASES} times without answering" in c["result"]["error"], c
