"""`stasis kill`: the signal first (TERM by default), SIGKILL once the timeout passed, and the
answer says which ended the job. Real programs: one that shuts down cleanly on TERM, one that
ignores it."""

from __future__ import annotations

import os
import pwd
import shlex
import tempfile
import threading
import time
from pathlib import Path

import pytest

from stasis.client import Client
from stasis.errors import UsageError
from tests.conftest import Daemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error


@pytest.fixture
def markers(world_tmp: Path, test_user: pwd.struct_passwd) -> Path:
    """A directory the test user's jobs write their shutdown markers into."""
    path = Path(tempfile.mkdtemp(prefix="markers-", dir=world_tmp))
    os.chown(path, test_user.pw_uid, test_user.pw_gid)
    return path


def _start(daemon: Daemon, mode: str, marker: Path, user: str) -> dict[str, object]:
    job = daemon.run(*workload("stopper.py", mode, marker), user=user)
    wait_for(lambda: "ready" in daemon.log_of(str(job["job"])), what=f"{mode} ready")
    return dict(job)


def _gone(pid: object) -> bool:
    return not Path(f"/proc/{pid}").exists()


def test_term_ends_a_graceful_job_cleanly(
    daemon: Daemon, markers: Path, test_user: pwd.struct_passwd
) -> None:
    user = test_user.pw_name
    job = _start(daemon, "graceful", markers / "term", user)
    answer = daemon.json("kill", str(job["job"]), "--timeout", "20", user=user)
    assert answer == {
        "job": job["job"],
        "state": "exited",
        "ended_by": "SIGTERM",
        "exit_code": 0,
        "signal": "SIGTERM",
        "timeout_s": 20.0,
    }
    # It ran its shutdown: the marker is there and the log says so; nothing of it is left.
    assert (markers / "term").read_text() == "clean shutdown on SIGTERM\n"
    assert "stopped" in daemon.log_of(str(job["job"]))
    assert _gone(job["pid"])
    assert daemon.job(str(job["job"]))["exit_code"] == 0


def test_other_signals_by_name_or_number_in_text_mode(
    daemon: Daemon, markers: Path, test_user: pwd.struct_passwd
) -> None:
    user = test_user.pw_name
    for given, name in (("INT", "SIGINT"), ("sighup", "SIGHUP"), ("2", "SIGINT")):
        marker = markers / f"sig-{given}"
        job = _start(daemon, "graceful", marker, user)
        out = daemon.cli("kill", str(job["job"]), "--signal", given, user=user).stdout
        assert out.strip() == f"job {job['job']} ended by {name}, exit code 0"
        assert marker.read_text() == f"clean shutdown on {name}\n"


def test_sigkill_after_the_timeout_when_term_is_ignored(
    daemon: Daemon, markers: Path, test_user: pwd.struct_passwd
) -> None:
    user = test_user.pw_name
    job = _start(daemon, "stubborn", markers / "stubborn", user)
    started = time.monotonic()
    out = daemon.cli("kill", str(job["job"]), "--timeout", "0.5", user=user).stdout
    took = time.monotonic() - started
    assert out.strip() == (
        f"job {job['job']} ended by SIGKILL: SIGTERM did not end it within " "0.5 s, exit code 137"
    )
    assert 0.5 <= took < 5
    assert _gone(job["pid"]) and not (markers / "stubborn").exists()
    row = daemon.job(str(job["job"]))
    assert (row["state"], row["exit_code"]) == ("exited", 137)


def test_timeout_zero_is_sigkill_at_once(
    daemon: Daemon, markers: Path, test_user: pwd.struct_passwd
) -> None:
    user = test_user.pw_name
    job = _start(daemon, "graceful", markers / "zero", user)
    answer = daemon.json("kill", str(job["job"]), "--timeout", "0", user=user)
    assert (answer["ended_by"], answer["signal"], answer["exit_code"]) == (
        "SIGKILL",
        "SIGKILL",
        137,
    )
    assert not (markers / "zero").exists()  # it had no chance to shut down
    # A job that is not running any more: said so, nothing sent.
    again = daemon.json("kill", str(job["job"]), user=user)
    assert (again["state"], again["ended_by"]) == ("exited", None)
    out = daemon.cli("kill", str(job["job"]), user=user).stdout
    assert out.strip() == f"job {job['job']} was not running (exited, exit code 137)"


def test_every_process_of_the_job_gets_the_signal(
    daemon: Daemon, markers: Path, test_user: pwd.struct_passwd
) -> None:
    # Two servers in one job, one of them in a session of its own (as a daemon would be).
    user = test_user.pw_name
    a, b = markers / "a", markers / "b"
    first, second = (shlex.join(workload("stopper.py", "graceful", m)) for m in (a, b))
    job = daemon.run("sh", "-c", f"setsid {first} & exec {second}", user=user)
    wait_for(lambda: daemon.log_of(job["job"]).count("ready") == 2, what="both ready")
    answer = daemon.json("kill", job["job"], user=user)
    assert answer["ended_by"] == "SIGTERM"
    assert a.read_text() == b.read_text() == "clean shutdown on SIGTERM\n"


def test_a_restored_job_stops_gracefully_too(
    daemon: Daemon, markers: Path, test_user: pwd.struct_passwd
) -> None:
    user = test_user.pw_name
    job = _start(daemon, "graceful", markers / "restored", user)
    cp = daemon.json("dump", str(job["job"]), user=user)
    restored = daemon.json("restore", cp["checkpoint"], user=user)
    answer = daemon.json("kill", restored["job"], user=user)
    assert (answer["ended_by"], answer["exit_code"]) == ("SIGTERM", 0)
    assert (markers / "restored").read_text() == "clean shutdown on SIGTERM\n"


def test_the_daemon_serves_others_while_a_kill_waits(
    daemon: Daemon, markers: Path, test_user: pwd.struct_passwd
) -> None:
    user = test_user.pw_name
    jobs = [_start(daemon, "stubborn", markers / f"wait-{i}", user) for i in range(8)]
    # More waiting kills than the daemon has worker threads (6 on 2 CPUs): they must not hold
    # them, or nobody else gets an answer until they are over.
    kills = [
        threading.Thread(
            target=daemon.cli, args=("kill", str(j["job"]), "--timeout", "4"), kwargs={"user": user}
        )
        for j in jobs
    ]
    for t in kills:
        t.start()
    time.sleep(1)
    started = time.monotonic()
    daemon.json("ps")
    assert time.monotonic() - started < 2
    assert all(t.is_alive() for t in kills)  # still waiting for their jobs
    for t in kills:
        t.join()
    assert all(daemon.job(str(j["job"]))["exit_code"] == 137 for j in jobs)


def test_bad_signal_or_timeout_is_one_line_and_the_job_runs_on(
    daemon: Daemon, markers: Path, test_user: pwd.struct_passwd
) -> None:
    user = test_user.pw_name
    job = _start(daemon, "graceful", markers / "bad", user)
    one_line_error(
        daemon.cli("kill", str(job["job"]), "--signal", "NOPE", user=user, check=False),
        2,
        "'NOPE' is not a signal",
    )
    one_line_error(
        daemon.cli("kill", str(job["job"]), "--timeout", "-1", user=user, check=False), 2, "0..3600"
    )
    # The daemon checks too, for callers of its API other than this CLI.
    with pytest.raises(UsageError, match="not a signal"):
        Client(daemon.socket).kill(str(job["job"]), signal="SIGNOPE")
    assert daemon.job(str(job["job"]))["state"] == "running"
    assert not (markers / "bad").exists()
    daemon.cli("kill", str(job["job"]), user=user)
