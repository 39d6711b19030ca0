"""The launcher and the SPANK helper never wait forever on a daemon that does not answer
(they call it with a bounded Client). A fresh workload finds our srun first on its PATH; no
checkpoint is asked for while a step runs on Slurm's own srun."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stasis.client import Client
from stasis.engine import proctree
from stasis.errors import DaemonAPIError
from stasis.slurm import steps
from stasis.slurm.launcher import Launcher
from tests.conftest import wait_for


def test_a_daemon_that_never_answers_is_given_up_on(tmp_path: Path) -> None:
    path = tmp_path / "hung.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen(1)
        start = time.monotonic()
        with pytest.raises(DaemonAPIError, match="no answer in time"):
            Client(path, 0.5).request("GET", "/slurm/health")
        assert time.monotonic() - start < 5


def test_no_daemon_at_all(tmp_path: Path) -> None:
    with pytest.raises(DaemonAPIError, match="no socket there"):
        Client(tmp_path / "none.sock", 0.5).request("GET", "/slurm/health")


def test_something_that_is_not_the_daemon(tmp_path: Path) -> None:
    path = tmp_path / "other.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen(1)

        def answer_garbage() -> None:
            conn, _ = server.accept()
            conn.recv(4096)
            conn.sendall(b"SSH-2.0-OpenSSH\r\n")
            conn.close()

        threading.Thread(target=answer_garbage, daemon=True).start()
        with pytest.raises(DaemonAPIError, match="nothing answers"):
            Client(path, 5).request("GET", "/jobs")


# -- srun steps -----------------------------------------------------------------------------------


def _launcher(tmp_path: Path, mode: str) -> Launcher:
    steps_dir = tmp_path / "lib" / "bin"
    steps_dir.mkdir(parents=True, exist_ok=True)
    (steps_dir / "srun").write_text("#!/bin/sh\n# stasis.slurm.steps\n")
    os.chmod(steps_dir / "srun", 0o755)
    return Launcher({"mode": mode, "label": "7"}, "/bin/true", "7", steps_dir)


def test_a_fresh_workload_finds_our_srun_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tmp_path / "slurm" / "srun"
    real.parent.mkdir()
    real.write_text("#!/bin/sh\n")
    os.chmod(real, 0o755)
    monkeypatch.setenv("PATH", f"{real.parent}:/usr/bin")
    monkeypatch.setenv("STASIS_SLURM_START", "{}")
    env = _launcher(tmp_path, "fresh")._env()
    assert env["PATH"] == f"{tmp_path}/lib/bin:{real.parent}:/usr/bin"
    assert env[steps.STEPS_VAR] == "7" and env[steps.REAL_SRUN_VAR] == str(real)
    assert "STASIS_SLURM_START" not in env
    # Unprotected, the job runs as without stasis: Slurm's srun, nothing of ours.
    off = _launcher(tmp_path, "off")._env()
    assert off["PATH"] == f"{real.parent}:/usr/bin" and steps.STEPS_VAR not in off


def test_no_checkpoint_while_slurms_srun_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir()
    shutil.copy("/bin/sleep", fake)
    launcher = _launcher(tmp_path, "fresh")
    tree = subprocess.Popen(["bash", "-c", f"{fake} 30 & wait"])
    launcher.pid = tree.pid
    try:
        deadline = time.monotonic() + 20
        while not steps.real_srun_running(tree.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # Periodic: skipped, said once for the step, not at every interval.
        assert launcher.steps_outside(final=False) and launcher.steps_outside(final=False)
        # The warning: refused, said every time, the job goes on.
        assert launcher.steps_outside(final=True)
        err = capsys.readouterr().err.splitlines()
        assert err == [
            f"stasis: periodic checkpoint skipped: a step runs outside stasis ({fake} 30): a "
            "checkpoint now could not restore it; try again when the step has ended",
            f"stasis: warning: no checkpoint: a step runs outside stasis ({fake} 30): a "
            "checkpoint now could not restore it; try again when the step has ended; the job "
            "goes on (if Slurm requeues it, it runs again from its last checkpoint, or from the "
            "start)",
        ]
    finally:
        for pid in reversed(proctree.tree(tree.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        tree.wait()
    assert not launcher.steps_outside(final=False)


# -- after a requeue ------------------------------------------------------------------------------

_REQUEUED = """\
import os, signal, sys
from stasis.slurm import launcher
r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
signal.set_wakeup_fd(w)
signal.signal(signal.SIGTERM, lambda *_: None)  # as the launcher's loop has it
if sys.argv[1] == "before":
    os.kill(os.getpid(), signal.SIGTERM)
print("waiting", flush=True)
sys.exit(launcher._until_ended(r))
"""


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_requeued_jobs_launcher_ends_at_slurms_sigterm(when: str) -> None:
    """Not KillWait later at the SIGKILL: a batch step lingering there makes Slurm 24.11 drain
    the node now and then (tests/e2e/test_slurm_job_container.py measures it in Slurm)."""
    started = time.monotonic()
    with subprocess.Popen([sys.executable, "-c", _REQUEUED, when], stdout=subprocess.PIPE) as p:
        try:
            assert p.stdout is not None
            assert p.stdout.readline() == b"waiting\n"
            if when == "during":
                # Once it no longer catches SIGTERM: it is waiting for Slurm's now.
                wait_for(lambda: not _catches(p.pid, signal.SIGTERM), 10, "SIGTERM uncaught")
                p.send_signal(signal.SIGTERM)
            # A SIGTERM that came while the workload's end was looked at ends it as well.
            assert p.wait(10) == (1 if when == "before" else -signal.SIGTERM)
        finally:
            p.kill()
    assert time.monotonic() - started < 10


def _catches(pid: int, sig: int) -> bool:
    caught = next(
        line.split()[1]
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("SigCgt:")
    )
    return bool(int(caught, 16) >> (sig - 1) & 1)
