"""`make test` leaves no process behind: every process the session starts carries a marker in
its environment (or runs from the session's directories), and at the session's end any such
process still alive is named, killed, and fails the run.

A harness that does not stop what it started (a cluster brought up half-way, a daemon whose
stop timed out) otherwise goes unnoticed until a later run finds its ports taken."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from stasis.dev.commands import SESSION_MARK

MARK = SESSION_MARK  # the harnesses carry it on to the daemons they start
# What a fixture's teardown signalled may still be exiting.
GRACE_S = float(os.environ.get("STASIS_TEST_LEFTOVER_GRACE_S", "20"))

# Under xdist: the controller hands each worker its token (workerinput), a worker hands back
# what it found (workeroutput; what it printed would be lost), and the controller fails the run.
WORKER_TOKEN = "stasis_leftovers_token"
WORKER_FOUND = "stasis_leftovers_found"

_before: set[int] = set()
_token = ""
_workers: list[str] = []  # the workers' tokens (the controller's list)
_heard: list[str] = []  # what the workers found


def _pids() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def start(token: str | None = None) -> None:
    """Called once, before any test: what runs now is not ours."""
    global _token
    _token = token or os.urandom(8).hex()
    os.environ[MARK] = _token
    _before.update(_pids())


def give_token(workerinput: dict[str, object]) -> None:
    token = os.urandom(8).hex()
    _workers.append(token)
    workerinput[WORKER_TOKEN] = token


def heard_from(workeroutput: dict[str, object]) -> None:
    found = workeroutput.get(WORKER_FOUND)
    if isinstance(found, str) and found:
        _heard.append(found)


def _ours(pid: int, dirs: list[str]) -> str | None:
    """The command line of `pid` if this session started it and it is alive (not a zombie)."""
    proc = Path(f"/proc/{pid}")
    try:
        if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return None
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        environ = (proc / "environ").read_bytes().split(b"\0")
        marks = {f"{MARK}={t}".encode() for t in (_token, *_workers)}
        if marks.intersection(environ) or any(d in cmdline for d in dirs):
            return cmdline.strip() or f"[{pid}]"
    except (OSError, IndexError):
        return None  # gone meanwhile
    return None


def remaining(dirs: list[str]) -> dict[int, str]:
    me = os.getpid()
    # A worker's own process carries the controller's token (its environment at exec).
    found = {pid: _ours(pid, dirs) for pid in _pids() - _before - _parents() if pid != me}
    return {pid: cmd for pid, cmd in found.items() if cmd}


def _parents() -> set[int]:
    """This process's ancestors: under xdist, a worker's controller (and execnet's shell)."""
    out, pid = set(), os.getppid()
    while pid > 1:
        out.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return out


def check(session: pytest.Session) -> None:
    if not _token:
        return
    dirs = []
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None and factory._basetemp is not None:
        dirs.append(str(factory._basetemp))
    deadline = time.monotonic() + GRACE_S
    # A process caught in the middle of an exec shows no environment for an instant: one
    # scan could miss it.
    left = remaining(dirs)
    time.sleep(1.0)
    left = remaining(dirs) or left
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = remaining(dirs)
    if not left and not _heard:
        return
    if not left:
        _fail(session, "\n".join(_heard))
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = "\n".join(f"  {pid}: {cmd[:300]}" for pid, cmd in sorted(left.items()))
    text = (
        f"{len(left)} process(es) started by the tests were still running at the end "
        f"(now killed): a harness did not stop what it started\n{lines}"
    )
    _fail(session, "\n".join([*_heard, text]))


def _fail(session: pytest.Session, text: str) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a worker: the controller says it and fails the run
        workeroutput[WORKER_FOUND] = text
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "processes left behind", red=True)
        reporter.write_line(text)
    else:
        print(text)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
