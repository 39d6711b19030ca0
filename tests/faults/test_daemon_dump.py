"""The node daemon SIGKILLed at each step of a dump (issue 28), a stop-dump and a leave-running
one, then started again: nothing stays frozen, nothing runs twice, and the work goes on (the
counter continues) or is kept (the checkpoint is listed, and restores to a counter that goes
on from where it was)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stasis.engine import proctree
from tests.conftest import Daemon, new_daemon, wait_for, workload
from tests.daemon.test_restore_state import last_number, numbers
from tests.faults import kit

POINTS = ("dump.before-criu", "dump.after-criu", "dump.after-publish", "dump.after-db")


@pytest.fixture(scope="module")
def d(world_tmp: Path, test_user: Any) -> Iterator[Daemon]:
    daemon = new_daemon(world_tmp, "faults-dump")
    daemon.start()
    yield daemon
    daemon.kill_all()
    daemon.stop()


def counted(d: Daemon, job: dict[str, Any]) -> int:
    """The counter's last value, from its log file (also while no daemon runs)."""
    found = numbers((d.state_dir / "logs" / f"{job['job']}.log").read_text())
    return found[-1] if found else -1


@pytest.mark.parametrize("leave_running", [False, True], ids=["stop", "leave-running"])
@pytest.mark.parametrize("point", POINTS)
def test_daemon_killed_during_a_dump(d: Daemon, point: str, leave_running: bool) -> None:
    label = f"fd-{os.urandom(3).hex()}"
    job = d.run(*workload("counter.py", 0.05, 8), label=label)
    wait_for(lambda: counted(d, job) >= 2, 20, "counting")
    args = ["dump", *(["--leave-running"] if leave_running else []), job["job"]]
    err = kit.kill_at(d, point, *args)
    assert err, "the dump's client was not told that its daemon died"
    kit.assert_nothing_frozen([job["pid"]])
    kit.assert_not_lost(d, label)
    published = point in ("dump.after-publish", "dump.after-db")
    listed = kit.checkpoints(d, label)
    assert len(listed) == (1 if published else 0), listed
    # Every journal entry was settled by the daemon's start.
    wait_for(lambda: not list((d.state_dir / "dumps").glob("*.json")), 10, "the journal empty")
    state = d.job(job["job"])["state"]
    if published and not leave_running:
        # The stop that was asked is carried out: the job is recorded checkpointed, its tree
        # gone, and its checkpoint restores to a counter that goes on from where it was.
        wait_for(lambda: d.job(job["job"])["state"] == "checkpointed", 10, "checkpointed")
        assert not proctree.alive(job["pid"], None)
        mark = counted(d, job)
        again = d.json("restore", "--label", label)
        wait_for(lambda: last_number(d, again["job"]) > mark, 20, "the restored counter")
        # One log for both (the restored job writes where the dumped one did): counted once.
        assert numbers(d.log_of(again["job"])).count(0) == 1, "restored from the beginning"
        d.cli("kill", again["job"])
    else:
        assert state in ("running", "restored"), state
        mark = counted(d, job)
        wait_for(lambda: counted(d, job) >= mark + 3, 20, "the counter to go on")
        d.cli("kill", job["job"])
