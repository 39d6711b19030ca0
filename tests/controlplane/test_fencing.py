"""Fencing (issue 28): a node cut off from the control plane past `--lost-after` while its restore
of a migration is under way keeps running; the control plane fails that restore and re-targets
it to another node. The cut-off node must never resume its restored tree: before the resume it
asks the control plane to commit the restore (POST .../commands/{id}/commit), and the control
plane refuses the commit of a command it failed, recording that the node was fenced; the node
kills its stopped tree. The job runs on exactly one node, its counter going on once.

Real daemons (nodes of their own, tests/nodes.py, sharing a store and a site key) and a real
control plane (SQLite). Node A reaches the control plane through a proxy that cuts it off (holds
every new connection, unanswered) the moment A has leased the restore: its heartbeats stop, its
lease runs out, it is found lost, and the restore is re-targeted to node C, while A's daemon and
its restore go on."""

from __future__ import annotations

import os
import pwd
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stasis.engine import proctree
from tests import nodes
from tests.conftest import Daemon, new_daemon, wait_for, workload
from tests.controlplane.conftest import ControlPlane
from tests.controlplane.test_migration_faults import Site as FakeSite
from tests.controlplane.test_migration_faults import lease_when_due
from tests.controlplane.test_node import node_env
from tests.faults import kit

LEASE_S = "2"
LOST_AFTER_S = "4"


class Partition:
    """A TCP proxy between one node and the control plane. Once the node has been handed a
    restore command (a lease answer naming one), it is cut off: every connection it opens from
    then on is accepted and held unanswered (a network that drops its packets), until `heal`,
    which closes them. What the held requests asked is kept (`held`)."""

    def __init__(self, host: str, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server((host, 0))
        self.url = f"http://{host}:{self._listener.getsockname()[1]}"
        self.cut = threading.Event()
        self.held: list[str] = []  # the request lines of the connections held
        self._held_socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.cut.is_set():
                threading.Thread(target=self._hold, args=(client,), daemon=True).start()
            else:
                threading.Thread(target=self._carry, args=(client,), daemon=True).start()

    def _hold(self, client: socket.socket) -> None:
        with self._lock:
            self._held_socks.append(client)
        client.settimeout(10)
        try:
            first = client.recv(400, socket.MSG_PEEK)
        except OSError:
            return
        with self._lock:
            self.held.append(first.split(b"\r\n", 1)[0].decode(errors="replace"))

    def _carry(self, client: socket.socket) -> None:
        with client:
            try:
                server = socket.create_connection(self.target)
            except OSError:
                return
            with server:
                back = threading.Thread(
                    target=self._pump, args=(server, client, bytearray()), daemon=True
                )
                back.start()
                self._pump(client, server, None)
                back.join()

    def _pump(self, src: socket.socket, dst: socket.socket, answer: bytearray | None) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if answer is not None:
                    answer += data
                    # A restore leased: cut off before the node even reads it.
                    if b'"kind": "restore"' in answer and b'"lease_id"' in answer:
                        self.cut.set()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def asked(self, fragment: str) -> bool:
        with self._lock:
            return any(fragment in line for line in self.held)

    def heal(self) -> None:
        """Connected again: the held connections drop (their requests never arrived)."""
        self.cut.clear()
        with self._lock:
            held, self._held_socks = self._held_socks, []
        for s in held:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._closing = True
        self._listener.close()
        self.heal()


class Site:
    def __init__(self, cp: ControlPlane, link: Partition, s: Daemon, a: Daemon, c: Daemon) -> None:
        self.cp, self.link, self.s, self.a, self.c = cp, link, s, a, c


@pytest.fixture
def site(request: pytest.FixtureRequest, world_tmp: Path, site_key: Path) -> Iterator[Site]:
    """Nodes S (the job's), A (the target, behind the partition) and C; a test's parameter,
    if any, is how long A waits for a commit (STASIS_CONTROLPLANE_COMMIT_TIMEOUT_S): long
    enough by default for the re-target to be over before A is connected again."""
    commit_timeout_s = str(getattr(request, "param", "90"))
    root = Path(tempfile.mkdtemp(prefix="cp-fence-", dir=world_tmp))
    host = nodes.site_address()
    cp = ControlPlane(root, str(root / "cp.db"), host=host)
    cp.start("--command-lease", LEASE_S, "--lost-after", LOST_AFTER_S)
    link = Partition(host, (host, cp.port))
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    store = Path(tempfile.mkdtemp(prefix="cp-fence-store-", dir=world_tmp))

    def node(name: str, url: str) -> Daemon:
        return new_daemon(
            world_tmp,
            name,
            store=str(store),
            separate=True,
            env={
                **node_env(cp, hpc, name),
                "STASIS_CONTROLPLANE_URL": url,
                "STASIS_SITE_KEY": str(site_key),
                "STASIS_CONTROLPLANE_COMMIT_TIMEOUT_S": commit_timeout_s,
            },
        )

    daemons = [node("node-s", cp.url), node("node-a", link.url), node("node-c", cp.url)]
    started: list[Daemon] = []
    try:
        for d in daemons:
            d.start()
            started.append(d)
        wait_for(
            lambda: {n["name"]: n["state"] for n in cp.json("nodes")}
            == dict.fromkeys(("node-s", "node-a", "node-c"), "ready"),
            60,
            "the nodes to join",
        )
        yield Site(cp, link, *daemons)
    finally:
        link.close()
        for d in started:
            d.kill_all()
            d.stop()
        cp.stop()


def command(cp: ControlPlane, command_id: str) -> dict[str, Any]:
    status, c = cp.call("GET", f"/api/v1/commands/{command_id}", cp.admin)
    assert status == 200, c
    return dict(c)


def running(d: Daemon, label: str) -> list[dict[str, Any]]:
    """The jobs of `label` whose tree runs on `d` (a restore's tree still at its gate is
    `restoring`: stopped, not running)."""
    return [
        j for j in d.json("ps") if j["state"] in ("running", "restored") and j["label"] == label
    ]


def counted(d: Daemon, job: str) -> list[int]:
    return [int(x) for x in d.log_of(job).split()]


class Moved:
    """A migration from S to A, A cut off as it leased the restore."""

    def __init__(self, site: Site, user: str) -> None:
        cp, s = site.cp, site.s
        self.label = "fence-" + os.urandom(3).hex()
        # An interval no other test's counter has: its processes are told apart on the machine.
        self.interval = f"0.1{int.from_bytes(os.urandom(3), 'big'):08d}"
        job = s.run(*workload("counter.py", self.interval), label=self.label, user=user)["job"]
        wait_for(lambda: len(s.log_of(job).split()) >= 3, 30, "the counter to count")
        wait_for(lambda: job in [j["job"] for j in cp.json("jobs")], 30, "the job's report")
        status, first = cp.call(
            "POST", "/api/v1/migrations", cp.admin, {"job": job, "to": "node-a"}
        )
        assert status == 201, first
        assert first["args"]["or_on"] == ["node-c"], first  # where a re-target goes
        # Node A leases the restore and is cut off at once: its heartbeats, its renewals and
        # its commit are held unanswered from then on.
        wait_for(site.link.cut.is_set, 60, "node-a to lease the restore")

        def restore_half() -> dict[str, Any] | None:
            nxt = (command(cp, first["id"]).get("result") or {}).get("next")
            return command(cp, nxt) if nxt else None

        self.restore = wait_for(restore_half, 30, "the restore half")
        assert self.restore["node"] == "node-a", self.restore

    def retargeted(self, cp: ControlPlane) -> dict[str, Any]:
        """A found lost, its restore failed and re-targeted to C, which answered it."""

        def answered() -> dict[str, Any] | None:
            r = command(cp, self.restore["id"])
            nxt = (r.get("result") or {}).get("next") if r["state"] == "failed" else None
            if not nxt:
                return None
            r_c = command(cp, str(nxt))
            return r_c if r_c["state"] in ("done", "failed") else None

        r_c = wait_for(answered, 90, "the restore to be re-targeted to node-c and answered")
        assert (r_c["node"], r_c["state"]) == ("node-c", "done"), r_c
        return r_c

    def gone_from(self, d: Daemon) -> bool:
        return not [
            j
            for j in d.json("ps")
            if j["label"] == self.label and j["state"] in ("restoring", "running", "restored")
        ]

    def runs_once_on(self, d: Daemon, job: str) -> None:
        """The job runs on `d` alone, once: its counter goes on from where it was, each value
        once, and no process of it runs anywhere else on the machine."""
        live = running(d, self.label)
        assert [j["job"] for j in live] == [job], live
        kit.assert_nothing_frozen([j["pid"] for j in live])
        before = counted(d, job)[-1]
        wait_for(lambda: counted(d, job)[-1] > before + 3, 30, "the counter to go on")
        numbers = counted(d, job)
        assert numbers == list(range(len(numbers))), numbers[-20:]
        counters = {p for p in kit.tree_pids_of(self.interval) if proctree.alive(p, None)}
        assert counters and counters <= set(proctree.tree(live[0]["pid"])), counters


def test_a_node_cut_off_while_restoring_is_fenced_and_the_job_runs_once(
    site: Site, test_user: pwd.struct_passwd
) -> None:
    cp, a, c = site.cp, site.a, site.c
    m = Moved(site, test_user.pw_name)
    r_a = m.restore
    moved = str(m.retargeted(cp)["result"]["job"])
    assert [j["job"] for j in running(c, m.label)] == [moved]

    # Meanwhile node A's daemon went on with its restore, cut off: its tree waits, stopped.
    assert running(a, m.label) == [], a.json("ps")
    wait_for(
        lambda: site.link.asked(f"/commands/{r_a['id']}/commit"),
        60,
        "node-a to ask the control plane to commit its restore",
    )
    assert running(a, m.label) == [], a.json("ps")
    stopped = [j for j in a.json("ps") if j["label"] == m.label]
    assert [j["state"] for j in stopped] == ["restoring"], stopped

    # Connected again: the commit is refused (the command was re-targeted), the node fenced.
    site.link.heal()

    def fenced() -> list[dict[str, Any]]:
        return [
            e
            for e in cp.json("events")
            if e["kind"] == "command-fenced" and r_a["id"] in e["message"]
        ]

    said = wait_for(fenced, 60, "the control plane to fence node-a")
    assert said[0]["node"] == "node-a" and "\n" not in said[0]["message"], said
    assert "node node-a fenced" in said[0]["message"], said
    # A killed its restored tree, never resumed: nothing of the label lives there.
    wait_for(lambda: m.gone_from(a), 60, "node-a to drop its fenced restore")
    wait_for(
        lambda: "fenced" in a.root.joinpath("daemon.log").read_text(),
        30,
        "node-a's log to say it was fenced",
    )
    assert command(cp, r_a["id"])["state"] == "failed"
    m.runs_once_on(c, moved)
    assert m.gone_from(a)


@pytest.mark.parametrize("site", ["3"], indirect=True)
def test_a_node_that_cannot_reach_the_control_plane_never_resumes(
    site: Site, test_user: pwd.struct_passwd
) -> None:
    """Node A cut off for longer than its commit timeout (3 s): its restored tree is killed
    unresumed while it is still cut off, its checkpoint kept; the re-targeted restore runs the
    job on C, once; A connected again restores nothing."""
    cp, a, c = site.cp, site.a, site.c
    m = Moved(site, test_user.pw_name)
    wait_for(
        lambda: site.link.asked(f"/commands/{m.restore['id']}/commit"),
        60,
        "node-a to ask the control plane to commit its restore",
    )
    wait_for(lambda: m.gone_from(a), 60, "node-a to kill its unconfirmed restore")
    assert site.link.cut.is_set()  # decided alone, still cut off
    log = a.root.joinpath("daemon.log").read_text()
    assert "could not confirm within 3 s" in log and "checkpoint" in log, log[-2000:]
    moved = str(m.retargeted(cp)["result"]["job"])
    site.link.heal()
    wait_for(
        lambda: {n["name"]: n["state"] for n in cp.json("nodes")}["node-a"] == "ready",
        30,
        "node-a to report again",
    )
    m.runs_once_on(c, moved)
    assert m.gone_from(a) and command(cp, m.restore["id"])["state"] == "failed"


@pytest.fixture(params=["sqlite", "postgresql"])
def fake_site(request: pytest.FixtureRequest, world_tmp: Path) -> Iterator[FakeSite]:
    """The control plane with nodes spoken over HTTP by the test (as in
    test_migration_faults): the commit and a re-target decided in one transaction, on both
    databases."""
    root = Path(tempfile.mkdtemp(prefix="cp-fence-", dir=world_tmp))
    db = (
        str(root / "cp.db")
        if request.param == "sqlite"
        else request.getfixturevalue("postgres").new_database()
    )
    cp = ControlPlane(root, db)
    cp.start("--command-lease", LEASE_S, "--lost-after", LOST_AFTER_S)
    try:
        yield FakeSite(cp, cp.json("clusters", "add", "hpc", "--kind", "slurm"))
    finally:
        cp.stop()


def test_a_committed_restore_is_never_retargeted(fake_site: FakeSite) -> None:
    """Only the node holding a restore's lease commits it; once committed (its job may be
    resuming there), the node found lost fails it without a re-target, naming the checkpoint;
    its late answer is taken as the one run of the job."""
    site = fake_site
    for name in ("src", "b", "c"):
        site.node(name)
    site.beat()
    done = site.checkpointed(site.migrate("b"))
    got = lease_when_due(site, "b", done["result"]["next"], 0)
    assert got["args"]["fence"] is True, got  # the node is to commit before resuming
    path = f"/api/v1/nodes/b/commands/{got['id']}/commit"
    # Not another node's credential, nor a lease the node does not hold.
    status, refused = site.cp.call(
        "POST",
        f"/api/v1/nodes/c/commands/{got['id']}/commit",
        site.nodes["c"].token,
        {"lease_id": got["lease_id"]},
    )
    assert status == 403 and "node b's, not c's" in refused["error"], refused
    status, refused = site.cp.call(
        "POST", path, site.nodes["c"].token, {"lease_id": got["lease_id"]}
    )
    assert status == 403, refused
    status, refused = site.cp.call(
        "POST", path, site.nodes["b"].token, {"lease_id": "lease_" + "0" * 24}
    )
    assert status == 409 and "not leased to node b" in refused["error"], refused
    status, ok = site.cp.call("POST", path, site.nodes["b"].token, {"lease_id": got["lease_id"]})
    assert (status, ok) == (200, {"id": got["id"], "committed": True}), ok

    # b goes silent: lost once its lease ran out; the restore fails, re-targeted nowhere.
    def failed() -> dict[str, Any] | None:
        site.beat("b")
        r = site.command(got["id"])
        return r if r["state"] == "failed" else None

    r = wait_for(failed, 30, "the committed restore to fail with its node")
    error = r["result"]["error"]
    assert not r["result"].get("next") and "not re-targeted" in error, r
    assert "stasis restore 20260101T000000Z-abcdef" in error and "\n" not in error, error
    assert site.nodes["c"].lease() is None
    # b back with its answer: the job it restored is the one run, said so.
    status, late = site.cp.call(
        "POST",
        f"/api/v1/commands/{got['id']}/ack",
        site.nodes["b"].token,
        {"lease_id": got["lease_id"], "ok": True, "result": {"job": "j-2", "checkpoint": "x"}},
    )
    assert status == 200 and late["state"] == "failed", late
    said = [e["message"] for e in site.cp.json("events") if e["kind"] == "command-late"]
    assert any("job j-2, which runs there, once" in m for m in said), said
    # A commit asked again now is refused, and said.
    status, refused = site.cp.call(
        "POST", path, site.nodes["b"].token, {"lease_id": got["lease_id"]}
    )
    assert status == 409 and "node b fenced" in refused["error"], refused


def test_a_checkpoint_half_whose_node_is_lost_queues_no_restore(fake_site: FakeSite) -> None:
    """The source half of a migration held by a node found lost: failed, warning that the job
    may still run there (a restore by hand elsewhere would run it twice); the node's late
    answer (it took the checkpoint, stopping the job) queues no restore, and is said, naming
    the checkpoint that resumes the job."""
    site = fake_site
    for name in ("src", "b"):
        site.node(name)
    site.beat()
    first = site.migrate("b")
    got = site.nodes["src"].lease()
    assert got is not None and got["id"] == first["id"], got

    def failed() -> dict[str, Any] | None:
        site.beat("src")
        c = site.command(first["id"])
        return c if c["state"] == "failed" else None

    c = wait_for(failed, 30, "the checkpoint half to fail with its node")
    error = c["result"]["error"]
    assert "node src was lost" in error and "job j-1 may still run on node src" in error, error
    assert "\n" not in error
    done = site.nodes["src"].ack(
        first["id"],
        True,
        {
            "checkpoint": "20260101T000000Z-abcdef",
            "label": "j-1",
            "size_bytes": 1,
            "seal": {"key_id": "0" * 32, "hmac_sha256": "0" * 64},
        },
    )
    assert done["state"] == "failed" and not (done["result"] or {}).get("next"), done
    site.beat("src")
    assert site.nodes["b"].lease() is None  # nothing to restore: the job does not run twice
    said = [e["message"] for e in site.cp.json("events") if e["kind"] == "command-late"]
    assert any(
        "it runs nowhere now" in m and "stasis restore 20260101T000000Z-abcdef" in m for m in said
    ), said
