"""Daemons started for a throwaway local setup (`stasis-dev local-cluster`, `stasis-dev
local-node`): started detached (`setsid -f`: not our child, they outlive the command that
started them), known by a pid file, stopped with TERM then KILL."""

from __future__ import annotations

import contextlib
import os
import signal
import socket as sock
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from stasis.engine import proctree
from stasis.poll import poll


def stasis_command() -> list[str]:
    """How to run `stasis` from this Python: the venv's script, else the module."""
    script = Path(sys.executable).parent / "stasis"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from stasis.cli.main import main; main()"]


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int | None) -> bool:
    try:
        return bool(pid) and proctree.alive(pid or 0, None)
    except OSError:
        return False


def start(argv: list[str], pid_file: Path, log: Path, env: Mapping[str, str]) -> int | None:
    """Start `argv` detached, its output appended to `log`; its pid once the file says it."""
    pid_file.unlink(missing_ok=True)
    subprocess.run(
        [
            "setsid",
            "-f",
            "sh",
            "-c",
            'echo $$ > "$0"; exec "$@" >>"$STASIS_DETACHED_LOG" 2>&1 ' "</dev/null",
            str(pid_file),
            *argv,
        ],
        env={**env, "STASIS_DETACHED_LOG": str(log)},
        check=True,
        timeout=30,
    )
    poll(lambda: read_pid(pid_file) is not None, 10, 0.05)
    return read_pid(pid_file)


def wait_listening(
    pid: int | None, socket: Path, log: Path, timeout_s: float, fail: Callable[[str], Exception]
) -> None:
    """Until the daemon `pid` listens on its socket; `fail(reason)` is raised when it exits
    first. A connection, not the file: a daemon killed before left its socket file behind, and
    the new one replaces it only once it is ready."""

    def listening() -> bool:
        if not alive(pid):
            raise fail("it exited at start: " + log.read_text(errors="replace")[-2000:])
        with contextlib.suppress(OSError), sock.socket(sock.AF_UNIX, sock.SOCK_STREAM) as s:
            s.settimeout(1)
            s.connect(str(socket))
            return True
        return False

    if not poll(listening, timeout_s, 0.1):
        raise fail(f"its socket {socket} did not appear in {timeout_s:.0f} s")


def stop(pid: int | None, timeout_s: float = 15.0) -> None:
    if not alive(pid):
        return
    assert pid is not None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not poll(lambda: not alive(pid), timeout_s):
        os.kill(pid, signal.SIGKILL)
