"""A migration's halves with the node daemon SIGKILLed at each named point of the control
plane's node side (stasis/controlplane/node.py), started again: the command is leased again once
its lease runs out and answered from the intent the node wrote before acting. The invariant: the
migrated job runs exactly once, on the target, its counter going on from where it was; or the
migration says failed, naming a checkpoint that is listed.

Real daemons (nodes of their own, tests/nodes.py, sharing a store and a site key) and a real
control plane (SQLite), with a short command lease so that a command held by a dead daemon comes
back within seconds."""

from __future__ import annotations

import os
import pwd
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import nodes
from tests.conftest import Daemon, new_daemon, wait_for, workload
from tests.controlplane.conftest import ControlPlane
from tests.controlplane.test_node import node_env
from tests.faults import kit

LEASE_S = "3"
LOST_AFTER_S = "8"


class Cluster:
    def __init__(self, cp: ControlPlane, a: Daemon, b: Daemon, c: Daemon) -> None:
        self.cp, self.a, self.b, self.c = cp, a, b, c


@pytest.fixture(scope="module")
def cluster(world_tmp: Path) -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="cp-faults-", dir=world_tmp))
    key = root / "site.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    cp = ControlPlane(root, str(root / "cp.db"), host=nodes.site_address())
    # A node restarting is not lost (8 s); a command its dead daemon held comes back in 3 s.
    cp.start("--command-lease", LEASE_S, "--lost-after", LOST_AFTER_S)
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    store = Path(tempfile.mkdtemp(prefix="cp-faults-store-", dir=world_tmp))
    # Each a host of its own (its /tmp, /dev/shm, /run, name and address), as real nodes are.
    daemons = [
        new_daemon(
            world_tmp,
            name,
            store=str(store),
            separate=True,
            env={**node_env(cp, hpc, name), "STASIS_SITE_KEY": str(key)},
        )
        for name in ("node-a", "node-b", "node-c")
    ]
    started: list[Daemon] = []
    try:
        for d in daemons:
            d.start()
            started.append(d)
        wait_for(
            lambda: {n["name"] for n in cp.json("nodes")} == {"node-a", "node-b", "node-c"},
            30,
            "the nodes to join",
        )
        yield Cluster(cp, *daemons)
    finally:
        for d in daemons:
            if d.proc is not None and d.proc.poll() is None:
                d.kill_all()
                d.stop()
        cp.stop()


def final(cp: ControlPlane, command_id: str, timeout_s: float = 90) -> dict[str, Any]:
    """The last command of the chain that starts at `command_id` (a migration's checkpoint
    half, its restore half, the restore's retries and re-targets), once it is answered."""

    def answered() -> dict[str, Any] | None:
        nonlocal command_id
        c: dict[str, Any] = cp.call("GET", f"/api/v1/commands/{command_id}", cp.admin)[1]
        if c["state"] not in ("done", "failed"):
            return None
        nxt = (c.get("result") or {}).get("next")
        if nxt:
            command_id = str(nxt)
            return None
        return c

    return wait_for(answered, timeout_s, f"the migration from {command_id} to end")


def counted(d: Daemon, job: str) -> list[int]:
    return [int(x) for x in d.log_of(job).split()]


def assert_runs_once_counting_on(
    c: Cluster, label: str, job: str, before: int, on: str = "b"
) -> None:
    """`label` runs on node `on` alone, once, and its counter goes on past `before` (the
    value it had reached before the migration), without starting again."""
    there = {"a": c.a, "b": c.b, "c": c.c}
    for name, d in there.items():
        if name != on and d.proc is not None:
            assert not kit.live_jobs(d, label), d.json("ps")
    d = there[on]
    live = kit.live_jobs(d, label)
    assert [j["job"] for j in live] == [job], live
    kit.assert_nothing_frozen([j["pid"] for j in live])
    wait_for(lambda: counted(d, job)[-1] > before + 3, 30, "the restored counter to go on")
    numbers = counted(d, job)
    # One counter, never started again nor run twice: 0, 1, 2... each once.
    assert numbers == list(range(len(numbers))), numbers[-20:]


def migrate_killed_at(
    c: Cluster,
    killed: Daemon,
    point: str,
    label: str,
    user: str,
    restart: bool = True,
    while_down: Callable[[Daemon], None] | None = None,
) -> tuple[dict[str, Any], int]:
    """Migrate a counting job from node-a to node-b, `killed` dying at `point` (`while_down`
    done to it meanwhile), then started again unless not to `restart`. The migration's last
    command once answered, and the value the counter had reached before."""
    job = c.a.run(*workload("counter.py"), label=label, user=user)["job"]
    wait_for(lambda: len(c.a.log_of(job).split()) >= 3, 30, "the counter to count")
    wait_for(lambda: job in [j["job"] for j in c.cp.json("jobs")], 30, "the job's report")
    log = c.a.state_dir / "logs" / f"{job}.log"
    kit.arm(killed, point)
    status, first = c.cp.call(
        "POST", "/api/v1/migrations", c.cp.admin, {"job": job, "to": "node-b"}
    )
    assert status == 201, first
    kit.died(killed)
    before = int(log.read_text().split()[-1])
    if while_down is not None:
        while_down(killed)
    if restart:
        kit.arm(killed)  # started again, disarmed
    return final(c.cp, first["id"]), before


@pytest.mark.parametrize("point", ["cp.after-lease", "cp.after-checkpoint"])
def test_a_checkpoint_half_killed_goes_on_from_its_intent(
    cluster: Cluster, point: str, test_user: pwd.struct_passwd
) -> None:
    """The source node dies after leasing (nothing done yet: it is done once started again)
    or after its checkpoint was published (answered with that checkpoint: before, the command
    was carried out again and failed "not running", and the job ran on neither node)."""
    label = "cpf-" + point.split(".")[1]
    last, before = migrate_killed_at(cluster, cluster.a, point, label, test_user.pw_name)
    assert last["kind"] == "restore" and last["state"] == "done", last
    assert_runs_once_counting_on(cluster, label, str(last["result"]["job"]), before)
    cluster.b.kill_all()


@pytest.mark.parametrize("point", ["cp.after-lease", "cp.after-restore"])
def test_a_restore_half_killed_is_carried_out_once(
    cluster: Cluster, point: str, test_user: pwd.struct_passwd
) -> None:
    """The target node dies after leasing the restore (nothing done: restored once started
    again), or after its restore, before answering: leased again, it answers with the job
    restored from that checkpoint, restoring nothing again (before: refused as a replay, the
    migration failed while the job ran)."""
    label = "cpf-restore-" + point.split(".")[1]
    last, before = migrate_killed_at(cluster, cluster.b, point, label, test_user.pw_name)
    assert last["kind"] == "restore" and last["state"] == "done", last
    assert last["node"] == "node-b", last
    assert_runs_once_counting_on(cluster, label, str(last["result"]["job"]), before)
    cluster.b.kill_all()


def test_a_control_plane_killed_mid_migration_loses_nothing(
    cluster: Cluster, test_user: pwd.struct_passwd
) -> None:
    """The control plane SIGKILLed while its nodes carry out a migration, started again on its
    database: the nodes' answers are taken (or their commands leased again and answered from
    what they did), and the migration ends with the job running once on its target."""
    c = cluster
    job = c.a.run(*workload("counter.py"), label="cpf-cp", user=test_user.pw_name)["job"]
    wait_for(lambda: len(c.a.log_of(job).split()) >= 3, 30, "the counter to count")
    wait_for(lambda: job in [j["job"] for j in c.cp.json("jobs")], 30, "the job's report")
    log = c.a.state_dir / "logs" / f"{job}.log"
    status, first = c.cp.call(
        "POST", "/api/v1/migrations", c.cp.admin, {"job": job, "to": "node-b"}
    )
    assert status == 201, first
    assert c.cp.proc is not None
    c.cp.proc.kill()
    c.cp.proc.wait()
    before = int(log.read_text().split()[-1])
    c.cp.start("--command-lease", LEASE_S, "--lost-after", LOST_AFTER_S)
    last = final(c.cp, first["id"])
    assert last["kind"] == "restore" and last["state"] == "done", last
    assert_runs_once_counting_on(c, "cpf-cp", str(last["result"]["job"]), before)
    c.b.kill_all()


def test_a_restore_half_whose_node_is_lost_is_retargeted(
    cluster: Cluster, test_user: pwd.struct_passwd
) -> None:
    """The target's daemon dies as it leases the restore and stays down: once its lease ran
    out and it is lost, the restore goes to the third node, with the seal the source made for
    it there, and the job runs there once, counting on."""
    c = cluster
    try:
        last, before = migrate_killed_at(
            c, c.b, "cp.after-lease", "cpf-lost", test_user.pw_name, restart=False
        )
        assert last["kind"] == "restore" and last["state"] == "done", last
        assert last["node"] == "node-c", last
        assert_runs_once_counting_on(c, "cpf-lost", str(last["result"]["job"]), before, "c")
        c.c.kill_all()
    finally:
        kit.arm(c.b)
    # Back, node-b restores nothing of it: the command it held went elsewhere.
    wait_for(
        lambda: {n["name"]: n["state"] for n in c.cp.json("nodes")}["node-b"] == "ready",
        30,
        "node-b to report again",
    )
    time.sleep(float(LEASE_S))
    assert not kit.live_jobs(c.b, "cpf-lost")
