"""Processes: namespaced workloads started like stasis starts jobs, their logs, and reaping.

The bench makes itself a child subreaper (`become_subreaper`), so that a tree restored by
`criu restore -d` is reparented to us and can be reaped after it is killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
TINI_CANDIDATES = ("/usr/bin/tini-static", "/usr/bin/tini", "/usr/local/bin/tini")


class BenchError(RuntimeError):
    """A step of the benchmark failed; the case is recorded as failed, the suite goes on."""


def become_subreaper() -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise BenchError("prctl(PR_SET_CHILD_SUBREAPER) failed")


def find_tini() -> str:
    for path in TINI_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    raise BenchError("tini is not installed (Debian package tini)")


@dataclass
class LogTail:
    """Lines a workload appends to its log, read from where we last stopped."""

    path: Path
    offset: int = 0
    _partial: bytes = field(default=b"", repr=False)

    def skip_to_end(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self._partial = b""

    def wait_line(self, prefix: str, timeout_s: float) -> tuple[str, float]:
        """The first new line starting with `prefix`, and the monotonic time it was seen."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read()
            except FileNotFoundError:
                data = b""
            now = time.monotonic()
            if data:
                self.offset += len(data)
                lines = (self._partial + data).split(b"\n")
                self._partial = lines.pop()
                for line in lines:
                    text = line.decode(errors="replace")
                    if text.startswith(prefix):
                        return text, now
            if now > deadline:
                raise BenchError(f"no {prefix!r} line in {self.path} after {timeout_s:.0f} s")
            time.sleep(0.005)


@dataclass
class Namespaced:
    """A workload as the init of its own PID namespace: unshare -> setsid tini -> command."""

    unshare: subprocess.Popen[bytes]
    init_pid: int


def start_namespaced(command: list[str], log: Path, cwd: Path) -> Namespaced:
    """Start `command` the way a user without stasis would, for the plain CRIU baseline.

    setsid runs inside the namespace (a session leader outside it cannot be dumped); no
    --mount-proc (a new mount namespace breaks the dump); the log is opened O_APPEND so that
    CRIU accepts it having grown by restore time.
    """
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--", "setsid", find_tini(), "-g", "--", *command],
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            cwd=cwd,
            start_new_session=True,
        )
    finally:
        os.close(fd)
    deadline = time.monotonic() + 10
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    while time.monotonic() < deadline:
        try:
            pids = children.read_text().split()
        except FileNotFoundError:
            pids = []
        if pids and _exe(int(pids[0])).startswith("/usr/bin/tini"):
            return Namespaced(proc, int(pids[0]))
        if proc.poll() is not None:
            break
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    raise BenchError(f"the namespaced workload did not start: {' '.join(command)}")


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def kill_tree(init_pid: int, timeout_s: float = 10) -> None:
    """SIGKILL a namespace init (the whole namespace dies with it) and reap it if it is ours."""
    try:
        os.kill(init_pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got, _ = os.waitpid(init_pid, os.WNOHANG)
            if got:
                return
        except ChildProcessError:  # not our child: wait for it to vanish instead
            if not Path(f"/proc/{init_pid}").exists():
                return
        time.sleep(0.01)
    raise BenchError(f"pid {init_pid} did not die")


def reap_orphans() -> None:
    """Collect any exited children (restored trees reparented to us) without blocking."""
    while True:
        try:
            got, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not got:
            return
