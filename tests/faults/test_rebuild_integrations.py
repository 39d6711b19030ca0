"""A node daemon whose job database is found corrupt at its start loses none of the control
plane's records it acts on (issue 28): the database is moved aside and rebuilt, and the
intents, the migrations restored and the answers not yet taken come back from the files the
node keeps of them (stasis/daemon/records.py). The node is SIGKILLed at a named point of a
migration's half, its database overwritten with garbage, and started again: the command leased
again is answered from its record, not carried out twice; the job runs once, on the target,
its counter going on.

(The Slurm registrations and Kubernetes containers: tests/e2e/test_rebuild_integrations.py.)
Real daemons and a real control plane: the cluster of tests/faults/test_controlplane.py."""

from __future__ import annotations

import os
import pwd
from typing import Any

import pytest

from tests.conftest import Daemon, wait_for, workload
from tests.faults.test_controlplane import (  # noqa: F401 - the fixture
    Cluster,
    assert_runs_once_counting_on,
    cluster,
    final,
    migrate_killed_at,
)


def corrupt(d: Daemon) -> None:
    """Garbage where SQLite expects its header, as a torn disk leaves it."""
    (d.state_dir / "jobs.db").write_bytes(os.urandom(64 << 10))
    for extra in ("jobs.db-wal", "jobs.db-shm"):
        (d.state_dir / extra).unlink(missing_ok=True)


def rebuilt(d: Daemon) -> bool:
    return any(d.state_dir.glob("jobs.db.corrupt-*"))


def migrate_killed_and_corrupted(
    c: Cluster, killed: Daemon, point: str, label: str, user: str
) -> tuple[dict[str, Any], int]:
    """migrate_killed_at, `killed`'s database corrupted while it is down: started again, the
    database is rebuilt."""

    def corrupted(d: Daemon) -> None:
        for old in d.state_dir.glob("jobs.db.corrupt-*"):
            old.unlink()  # an earlier test's
        corrupt(d)

    last, before = migrate_killed_at(c, killed, point, label, user, while_down=corrupted)
    assert rebuilt(killed), os.listdir(killed.state_dir)
    return last, before


@pytest.mark.parametrize("point", ["cp.after-restore", "cp.before-ack"])
def test_a_restore_half_leased_again_after_a_rebuild_restores_nothing_again(
    cluster: Cluster, point: str, test_user: pwd.struct_passwd
) -> None:
    """The target dies after its restore (its intent and the migration's restore kept), or
    after its answer was kept but before the control plane took it; its database is rebuilt.
    Leased again, the restore is answered with the job restored then: nothing is restored a
    second time (before: the rebuilt database knew none of it, and the checkpoint was
    restored again beside the job it had become)."""
    label = "rebuild-" + point.split(".")[1]
    last, before = migrate_killed_and_corrupted(cluster, cluster.b, point, label, test_user.pw_name)
    assert last["kind"] == "restore" and last["state"] == "done", last
    assert last["node"] == "node-b", last
    assert_runs_once_counting_on(cluster, label, str(last["result"]["job"]), before)
    cluster.b.kill_all()


def test_a_checkpoint_half_leased_again_after_a_rebuild_is_answered_with_its_checkpoint(
    cluster: Cluster, test_user: pwd.struct_passwd
) -> None:
    """The source dies after its stop checkpoint was published (the job gone with it); its
    database is rebuilt. Leased again, the checkpoint half is answered with that checkpoint
    from its intent (before: the intent was lost, the checkpoint asked again failed "not
    running", and the job ran on neither node)."""
    last, before = migrate_killed_and_corrupted(
        cluster, cluster.a, "cp.after-checkpoint", "rebuild-ckpt", test_user.pw_name
    )
    assert last["kind"] == "restore" and last["state"] == "done", last
    assert_runs_once_counting_on(cluster, "rebuild-ckpt", str(last["result"]["job"]), before)
    cluster.b.kill_all()


def test_records_of_answers_taken_are_not_kept(
    cluster: Cluster, test_user: pwd.struct_passwd
) -> None:
    """A migration that went well leaves no answer, no intent behind as files (the control
    plane took them: never leased again); the migration restored stays, for good."""
    c = cluster
    job = c.a.run(*workload("counter.py"), label="rebuild-clean", user=test_user.pw_name)["job"]
    wait_for(lambda: len(c.a.log_of(job).split()) >= 3, 30, "the counter to count")
    wait_for(lambda: job in [j["job"] for j in c.cp.json("jobs")], 30, "the job's report")
    status, first = c.cp.call(
        "POST", "/api/v1/migrations", c.cp.admin, {"job": job, "to": "node-b"}
    )
    assert status == 201, first
    last = final(c.cp, first["id"])
    assert last["state"] == "done", last

    def files(d: Daemon, table: str) -> list[str]:
        return sorted(p.name for p in (d.state_dir / "records" / table).glob("*.json"))

    wait_for(
        lambda: not files(c.b, "controlplane_done") and not files(c.a, "controlplane_done"),
        20,
        "the answers' files to go once taken",
    )
    assert not files(c.a, "controlplane_intent") and not files(c.b, "controlplane_intent")
    assert files(c.b, "controlplane_restored")
    for d in (c.a, c.b):
        for path in (d.state_dir / "records").rglob("*"):
            st = path.stat()
            assert st.st_uid == 0 and not st.st_mode & 0o077, (path, oct(st.st_mode))
    c.b.kill_all()
