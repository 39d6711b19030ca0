"""The end-of-run check (tests/leftovers.py) names and kills what a test run left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = """
import pytest
from tests import leftovers

def pytest_configure(config):
    leftovers.start()

@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    leftovers.check(session)
"""


def nested_session(
    tmp_path: Path, conftest: str, target: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """A pytest session of its own in `tmp_path` (`conftest` its conftest.py), on `target`,
    outside this session's leftovers check, with a short grace."""
    (tmp_path / "conftest.py").write_text(conftest)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("STASIS_TEST_SESSION", None)
    env["STASIS_TEST_LEFTOVER_GRACE_S"] = "2"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *args,
            "--rootdir",
            str(tmp_path),
            str(target),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _session(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_it.py").write_text(textwrap.dedent(body))
    return nested_session(tmp_path, CONFTEST, tmp_path)


def _assert_killed(pidfile: Path) -> None:
    """The process the inner session left (its pid in `pidfile`) was killed by the check."""
    pid = int(pidfile.read_text())
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), state
    if state == "Z":  # our grandchild's zombie: nobody reaps it but init; nothing runs
        os.kill(pid, signal.SIGKILL)


def test_a_process_left_running_fails_the_run_and_is_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    result = _session(
        tmp_path,
        f"""
        import subprocess
        def test_leaks():
            p = subprocess.Popen(["setsid", "sleep", "1000"], start_new_session=True)
            open({str(pidfile)!r}, "w").write(str(p.pid))
        """,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "processes left behind" in result.stdout and "sleep 1000" in result.stdout
    _assert_killed(pidfile)


def test_a_daemon_a_harness_starts_with_an_environment_of_its_own_is_found(
    tmp_path: Path,
) -> None:
    """As Slurm 24.11's slurmctld after a reconfigure: started by a harness with an environment
    of its own (stasis.dev.commands.session_mark carries the session's mark into it), in a new
    process the harness did not record."""
    pidfile = tmp_path / "pid"
    result = _session(
        tmp_path,
        f"""
        import subprocess, sys
        from stasis.dev import commands
        def test_leaks():
            p = subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(1000)", "cluster-daemon"],
                env={{"PATH": "/usr/bin:/bin", **commands.session_mark()}},
                start_new_session=True,
            )
            open({str(pidfile)!r}, "w").write(str(p.pid))
        """,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "processes left behind" in result.stdout and "cluster-daemon" in result.stdout
    _assert_killed(pidfile)


def test_a_run_that_stops_what_it_started_passes(tmp_path: Path) -> None:
    result = _session(
        tmp_path,
        """
        import subprocess
        def test_tidy():
            p = subprocess.Popen(["sleep", "1000"])
            p.terminate()
            p.wait()
        """,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "left behind" not in result.stdout
