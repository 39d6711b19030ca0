"""Labels, retention, and a daemon restart under running jobs."""

from __future__ import annotations

import os
import signal

from tests.conftest import Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_restore_state import last_number, numbers


def test_restore_by_label_picks_newest_and_retention_drops_oldest(make_daemon: MakeDaemon) -> None:
    d: Daemon = make_daemon(keep=2)
    job = d.run(*workload("counter.py"), label="train")
    ids = []
    for target in (3, 8, 13):
        wait_for(lambda: last_number(d, job["job"]) >= target, what=f"count {target}")
        ids.append(d.json("dump", job["job"], "--leave-running")["checkpoint"])
    listed = [c["id"] for c in d.json("checkpoints", "--label", "train")]
    assert listed == [ids[2], ids[1]]  # newest first; the oldest went over keep=2
    d.cli("kill", job["job"])
    before = numbers(d.log_of(job["job"]))
    restored = d.json("restore", "--label", "train")
    assert restored["checkpoint"] == ids[2]
    wait_for(lambda: len(numbers(d.log_of(restored["job"]))) > len(before) + 2, what="more")
    first_new = numbers(d.log_of(restored["job"]))[len(before)]
    assert first_new >= 13  # from the newest checkpoint, not an older one
    d.cli("checkpoints", "rm", ids[1])
    assert [c["id"] for c in d.json("checkpoints")] == [ids[2]]
    d.cli("kill", restored["job"])


def test_daemon_restart_keeps_track_of_jobs(make_daemon: MakeDaemon) -> None:
    d: Daemon = make_daemon()
    job = d.run(*workload("counter.py"), label="survivor")
    short = d.run("sh", "-c", "sleep 1.5; exit 7")
    wait_for(lambda: last_number(d, job["job"]) >= 3, what="counting")
    d.stop()
    log = d.state_dir / "logs" / f"{job['job']}.log"
    wait_for(lambda: numbers(log.read_text())[-1] >= 10, what="counting while no daemon runs")
    import time

    time.sleep(1.6)  # the short job ends while no daemon is there
    d.start()
    listed = {j["job"]: j for j in d.json("ps")}
    assert listed[job["job"]]["state"] == "running"
    assert listed[short["job"]]["state"] == "exited"
    assert listed[short["job"]]["exit_code"] == 7  # not lost: its supervisor recorded it
    cp = d.json("dump", job["job"])
    at_dump = last_number(d, job["job"])
    restored = d.json("restore", cp["checkpoint"])
    wait_for(lambda: last_number(d, restored["job"]) >= at_dump + 3, what="counting on")
    d.cli("kill", restored["job"])


def test_object_store_through_fsspec(make_daemon: MakeDaemon) -> None:
    # memory:// lives inside the daemon process: the same code path as s3:// or gs://.
    d: Daemon = make_daemon(store="memory://stasis-ci")
    job = d.run(*workload("counter.py"), label="remote")
    wait_for(lambda: last_number(d, job["job"]) >= 5, what="counting")
    cp = d.json("dump", "--compress", "lz4", job["job"])
    at_dump = last_number(d, job["job"])
    assert [c["id"] for c in d.json("checkpoints", "--label", "remote")] == [cp["checkpoint"]]
    restored = d.json("restore", "--label", "remote")
    wait_for(lambda: last_number(d, restored["job"]) >= at_dump + 3, what="counting on")
    values = numbers(d.log_of(restored["job"]))
    assert values == list(range(len(values)))
    d.cli("kill", restored["job"])


def _spares(daemon_pid: int) -> list[int]:
    """The daemon's children that are idle spare supervisors."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = _parent(int(entry))
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == daemon_pid and b"--spare" in argv:
            found.append(int(entry))
    return found


def test_a_spare_supervisor_waits_and_leaves_with_the_daemon(make_daemon: MakeDaemon) -> None:
    d: Daemon = make_daemon()
    assert d.proc is not None
    daemon_pid = d.proc.pid
    [spare] = wait_for(lambda: _spares(daemon_pid), what="a spare supervisor")
    job = d.run(*workload("counter.py"))
    wait_for(lambda: last_number(d, job["job"]) >= 1, what="counting")
    # The spare became the job's supervisor (the workload's parent); a new one waits.
    assert _parent(job["pid"]) == spare
    both = wait_for(
        lambda: _spares(daemon_pid) if len(_spares(daemon_pid)) == 2 else [], what="a new spare"
    )
    [new_spare] = set(both) - {spare}
    d.stop()
    wait_for(
        lambda: not os.path.exists(f"/proc/{new_spare}"),
        what="the idle spare to leave with the daemon",
    )
    log = d.state_dir / "logs" / f"{job['job']}.log"
    at_stop = numbers(log.read_text())[-1]
    wait_for(
        lambda: numbers(log.read_text())[-1] >= at_stop + 2,
        what="the job to go on without the daemon",
    )
    assert os.path.exists(f"/proc/{spare}")  # its supervisor too
    os.kill(job["pid"], signal.SIGKILL)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
