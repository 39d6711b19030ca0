"""The job table and the CRIU logs do not grow without bound: at its start (and hourly) the
daemon prunes finished jobs' rows and CRIU logs by age and count, never a live job's."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from contextlib import closing
from datetime import datetime, timezone
from pathlib import Path

from stasis.engine import proctree
from tests.conftest import Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_restore_state import last_number

DAY_S = 86400


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="milliseconds")


def _age(path: Path, at: float) -> None:
    os.utime(path, (at, at), follow_symlinks=False)


def _finished_rows(d: Daemon, count: int, created: float) -> list[str]:
    """Add `count` rows of jobs that ended, created at `created` (with their job directories,
    as old as they are), straight into the daemon's table, as months of use would leave them."""
    ids = []
    # closing(): sqlite3's own `with` commits but leaves the connection open.
    with closing(sqlite3.connect(d.state_dir / "jobs.db")) as db, db:
        for i in range(count):
            job_id = secrets.token_hex(6)
            job_dir = d.state_dir / "jobs" / job_id
            job_dir.mkdir()
            (job_dir / "exit.json").write_text(json.dumps({"exit_code": 0, "signal": None}))
            _age(job_dir / "exit.json", created + i)
            _age(job_dir, created + i)
            db.execute(
                "INSERT INTO jobs (id, pid, pid_start, shim_pid, state, label, exit_code, "
                "command, cwd, env, user, uid, gid, log, checkpoint, created, job_dir) VALUES "
                "(?, NULL, NULL, NULL, 'exited', ?, 0, '[\"true\"]', '/', '{}', 'root', 0, 0, "
                "?, NULL, ?, ?)",
                (job_id, job_id, f"/tmp/{job_id}.log", _iso(created + i), str(job_dir)),
            )
            ids.append(job_id)
    return ids


def _criu_logs(d: Daemon, count: int, at: float) -> list[str]:
    names = []
    for i in range(count):
        path = d.state_dir / "criu-logs" / f"dump-{secrets.token_hex(4)}.log"
        path.write_bytes(b"x" * 1024)
        _age(path, at + i)
        names.append(path.name)
    return names


def test_old_rows_and_criu_logs_are_pruned_live_ones_stay(make_daemon: MakeDaemon) -> None:
    d: Daemon = make_daemon(
        env={
            "STASIS_KEEP_FINISHED_JOBS": "20",
            "STASIS_FINISHED_JOBS_MAX_AGE_S": str(3 * DAY_S),
            "STASIS_KEEP_CRIU_LOGS": "10",
            "STASIS_CRIU_LOGS_MAX_AGE_S": str(DAY_S),
        }
    )
    running = d.run(*workload("counter.py"))
    wait_for(lambda: last_number(d, running["job"]) >= 2, what="counting")
    cp = d.json("dump", running["job"], "--leave-running")["checkpoint"]
    restored = d.json("restore", cp)
    d.stop()

    now = time.time()
    old_rows = _finished_rows(d, 300, now - 10 * DAY_S)  # older than the age limit
    recent_rows = _finished_rows(d, 50, now - DAY_S)  # young enough, but over the count
    # A live job's CRIU log, as old as any: it stays.
    live_log = d.state_dir / "criu-logs" / f"restore-{restored['job']}.log"
    assert live_log.exists()
    _age(live_log, now - 20 * DAY_S)
    dump_log = f"dump-{cp}.log"  # a minute old: the newest
    old_logs = _criu_logs(d, 100, now - 5 * DAY_S)
    recent_logs = _criu_logs(d, 20, now - 3 * 3600)  # young enough, but over the count

    d.start()
    wait_for(lambda: len(d.json("ps")) == 2 + 20, 20, "the table pruned to the limit")
    jobs = {j["job"]: j["state"] for j in d.json("ps")}
    assert jobs[running["job"]] == "running" and jobs[restored["job"]] == "restored"
    assert set(jobs) - {running["job"], restored["job"]} == set(recent_rows[-20:])
    for job_id in old_rows + recent_rows[:-20]:
        assert not (d.state_dir / "jobs" / job_id).exists()
    for job in (running, restored):
        assert (d.state_dir / "jobs" / job["job"]).exists()

    def logs() -> list[str]:
        # Not CRIU's stats-dump and stats-restore: overwritten by each run, never pruned.
        return sorted(
            n for n in os.listdir(d.state_dir / "criu-logs") if not n.startswith("stats-")
        )

    # The ten newest (the real dump's log and nine of the recent ones), and the live job's.
    expected = sorted([dump_log, *recent_logs[-9:], live_log.name])
    wait_for(lambda: logs() == expected or len(logs()) < len(expected), 20, "logs pruned")
    assert logs() == expected
    assert not set(old_logs) & set(logs())
    # The live jobs were not touched.
    assert proctree.alive(running["pid"], None) and proctree.alive(restored["pid"], None)
    mark = last_number(d, restored["job"])
    wait_for(lambda: last_number(d, restored["job"]) >= mark + 3, what="still counting")
    started = time.monotonic()
    d.json("ps")
    assert time.monotonic() - started < 1.0
