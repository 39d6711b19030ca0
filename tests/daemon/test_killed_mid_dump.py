"""A daemon killed during a dump (kill -9) leaves nothing frozen: at its next start it removes
the dump's staging at once and resumes the job CRIU left stopped, also when that CRIU is still
running; a later dump of the job restores running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from stasis.engine import proctree
from stasis.poll import poll
from tests.conftest import STASIS, Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_concurrent_dumps import tracer
from tests.daemon.test_restore_state import last_number, numbers
from tests.faults.kit import stopped


def staging(d: Daemon) -> list[str]:
    area = Path(d.store) / ".staging"
    return sorted(os.listdir(area)) if area.exists() else []


def counted(d: Daemon, job: dict[str, Any]) -> int:
    """The counter's last value, from its log file (also while no daemon runs)."""
    found = numbers((d.state_dir / "logs" / f"{job['job']}.log").read_text())
    return found[-1] if found else -1


def _start_dump_and_catch_criu(d: Daemon, job: dict[str, Any]) -> tuple[subprocess.Popen[str], int]:
    wait_for(lambda: last_number(d, job["job"]) >= 2, 30, "counting")
    dump = subprocess.Popen(
        [STASIS, "dump", job["job"]],
        env=d.env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    criu = poll(lambda: tracer(job["pid"]), 30, 0.001)  # CRIU holds the tree from here on
    assert criu, "no CRIU dumping the job"
    return dump, criu


def _kill_daemon(d: Daemon, dump: subprocess.Popen[str]) -> None:
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait()
    d.stop()
    _, err = dump.communicate(timeout=30)
    assert dump.returncode != 0, err


def _runs_on(d: Daemon, job: dict[str, Any]) -> None:
    assert stopped(job["pid"]) == []
    mark = counted(d, job)
    wait_for(lambda: counted(d, job) >= mark + 3, 10, "the counter to go on")


def test_killed_after_criu_stopped_the_job(make_daemon: MakeDaemon) -> None:
    d: Daemon = make_daemon()
    job = d.run(*workload("counter.py", 0.05, 128), label="frozen")
    dump, criu = _start_dump_and_catch_criu(d, job)
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGSTOP)  # the daemon stands still; CRIU finishes its part
    wait_for(lambda: not proctree.alive(criu, None), 30, "CRIU to finish")
    _kill_daemon(d, dump)
    # What the killed daemon left: the whole tree stopped, the images in the staging area.
    assert stopped(job["pid"]) == proctree.tree(job["pid"])
    assert staging(d)

    d.start()
    _runs_on(d, job)
    assert staging(d) == []
    assert d.job(job["job"])["state"] == "running"
    assert d.json("checkpoints") == []  # never published
    assert os.listdir(d.state_dir / "dumps") == []

    # A dump of the resumed job is a normal one: its restore runs, it is not stopped.
    cp = d.json("dump", job["job"])
    restored = d.json("restore", cp["checkpoint"])
    assert stopped(restored["pid"]) == []
    at = last_number(d, restored["job"])
    wait_for(lambda: last_number(d, restored["job"]) >= at + 3, 10, "the restored counter")
    d.cli("kill", restored["job"])


def test_killed_while_criu_dumps(make_daemon: MakeDaemon) -> None:
    d: Daemon = make_daemon()
    job = d.run(*workload("counter.py", 0.05, 128), label="held")
    dump, criu = _start_dump_and_catch_criu(d, job)
    os.kill(criu, signal.SIGSTOP)  # a slow CRIU: it outlives the daemon, holding the tree
    try:
        _kill_daemon(d, dump)
        d.start()
        # The staging goes at once; the job stays CRIU's until it is done, and says so.
        assert staging(d) == []
        refused = d.cli("dump", job["job"], check=False)
        assert refused.returncode == 1
        assert "is being resumed" in refused.stderr and "wait for it" in refused.stderr
    finally:
        os.kill(criu, signal.SIGCONT)
    wait_for(lambda: not proctree.alive(criu, None), 30, "CRIU to end")
    wait_for(
        lambda: stopped(job["pid"]) == [] and tracer(job["pid"]) == 0, 10, "the job to be resumed"
    )
    _runs_on(d, job)
    assert staging(d) == []
    assert d.json("checkpoints") == []
    assert d.job(job["job"])["state"] == "running"
    wait_for(lambda: os.listdir(d.state_dir / "dumps") == [], 5, "the dump record to go")
    cp = d.json("dump", job["job"], "--leave-running")  # its slot is free again
    assert [c["id"] for c in d.json("checkpoints")] == [cp["checkpoint"]]


def test_killed_after_publishing_finishes_the_dump(make_daemon: MakeDaemon) -> None:
    d: Daemon = make_daemon()
    job = d.run(*workload("counter.py", 0.05), label="published")
    wait_for(lambda: last_number(d, job["job"]) >= 2, 30, "counting")
    cp = d.json("dump", job["job"], "--leave-running")["checkpoint"]
    # What a daemon killed between publishing a stop-dump and killing the job leaves: the
    # checkpoint listed, the tree stopped by CRIU, and the dump's record (written by hand here:
    # that window is too short to hit with a kill).
    d.stop()
    proctree.signal_tree(job["pid"], signal.SIGSTOP)
    record = {
        "checkpoint": cp,
        "job": job["job"],
        "pid": job["pid"],
        "pid_start": proctree.start_time(job["pid"]),
        "leave_running": False,
    }
    (d.state_dir / "dumps").mkdir(mode=0o700, exist_ok=True)
    (d.state_dir / "dumps" / f"{cp}.json").write_text(json.dumps(record))
    d.start()
    # The checkpoint made it, so the rest of the dump is done: the job stops, as asked.
    assert d.job(job["job"])["state"] == "checkpointed"
    wait_for(lambda: not proctree.alive(job["pid"], None), 10, "the job to be stopped")
    at_dump = counted(d, job)
    restored = d.json("restore", "--label", "published")
    assert restored["checkpoint"] == cp
    wait_for(lambda: last_number(d, restored["job"]) >= at_dump + 3, 10, "the restored counter")
    d.cli("kill", restored["job"])
