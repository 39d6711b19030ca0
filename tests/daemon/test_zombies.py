"""The daemon is a subreaper: what failed restores leave to it is reaped, not left as zombies,
and a restore whose CRIU is killed leaves nothing running."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path
from subprocess import CompletedProcess

from stasis.engine import proctree
from stasis.poll import poll
from tests.conftest import STASIS, Daemon, MakeDaemon, wait_for, workload


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(command name, state, parent pid) of `pid`, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return text[text.index("(") + 1 : text.rindex(")")], fields[0], int(fields[1])


def zombies_of(parent: int) -> list[tuple[int, str]]:
    """Zombie children of `parent`, from every /proc/*/stat (state Z, ppid == parent)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat and stat[1] == "Z" and stat[2] == parent:
                found.append((int(entry), stat[0]))
    return found


def strays_of(daemon_pid: int) -> list[tuple[int, str]]:
    """Live children of the daemon that are not job supervisors (a restored task that a failed
    restore left running, say)."""
    found = []
    for pid in proctree.children(daemon_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        stat = _stat(pid)
        if stat and stat[1] != "Z" and b"stasis.daemon.jobsupervisor" not in argv:
            found.append((pid, stat[0]))
    return found


def _no_zombies(daemon_pid: int) -> None:
    # The daemon looks twice a second; a zombie that outlives a few looks is one it missed.
    if poll(lambda: not zombies_of(daemon_pid), 3.0) is None:
        raise AssertionError(f"zombie children of the daemon: {zombies_of(daemon_pid)}")


def _criu_restoring(daemon_pid: int) -> int | None:
    for pid in proctree.tree(daemon_pid)[1:]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[1] == b"swrk":
            return pid
    return None


def _restore_killing_criu(
    d: Daemon, cp: str, daemon_pid: int, retried: list[str]
) -> CompletedProcess[str] | None:
    """The answer to a restore of `cp` whose CRIU got SIGKILLed once the restored tree existed;
    None when the restore was done before that (a loaded machine runs a 64 MiB restore before
    this test's process gets the CPU back): its job is killed and added to `retried`."""
    result: dict[str, CompletedProcess[str]] = {}
    thread = threading.Thread(
        target=lambda: result.update(
            r=subprocess.run(
                [STASIS, "restore", cp], env=d.env, capture_output=True, text=True, timeout=30
            )
        )
    )
    thread.start()
    found = poll(
        lambda: _criu_restoring(daemon_pid) or ("done" if not thread.is_alive() else 0), 30, 0.002
    )
    criu = found if isinstance(found, int) else None
    stat = _stat(criu) if criu is not None else None
    if criu is not None and stat is not None:
        supervisor = stat[2]
        poll(lambda: len(proctree.children(supervisor)) > 1 or not thread.is_alive(), 10, 0.002)
        try:
            os.kill(criu, signal.SIGKILL)
        except ProcessLookupError:
            pass
    thread.join()
    answer = result["r"]
    if answer.returncode == 0:
        restored = answer.stdout.split()[1]
        d.cli("kill", restored)
        retried.append(restored)
        return None
    return answer


def test_rejected_restores_and_a_killed_criu_leave_no_zombie(make_daemon: MakeDaemon) -> None:
    d: Daemon = make_daemon()
    assert d.proc is not None
    daemon_pid = d.proc.pid
    job = d.run(*workload("memhold.py", 64))
    wait_for(lambda: "ready" in d.log_of(job["job"]), 30, "64 MiB allocated")
    cp = d.json("dump", job["job"], "--leave-running")["checkpoint"]

    # A restore of a damaged copy is rejected at the gate: its tasks are killed mid-restore.
    good = Path(d.store) / cp
    pages = sorted(good.glob("pages-*"))[0]
    intact = pages.read_bytes()
    damaged = bytearray(intact)
    damaged[len(damaged) // 2] ^= 0xFF
    pages.write_bytes(bytes(damaged))
    for _ in range(3):
        rejected = d.cli("restore", cp, check=False)
        assert rejected.returncode == 1 and "is corrupt" in rejected.stderr, rejected.stderr
    _no_zombies(daemon_pid)
    # A restore's leftover stays; a short-lived CRIU of the daemon's own (a version query, say)
    # may be seen once, on a slow machine.
    if poll(lambda: not strays_of(daemon_pid), 5.0) is None:
        raise AssertionError(f"strays of the daemon: {strays_of(daemon_pid)}")

    # kill -9 of CRIU half-way through a restore (once the restored tree exists).
    pages.write_bytes(intact)
    killed = None
    retried: list[str] = []
    for _ in range(10):
        killed = _restore_killing_criu(d, cp, daemon_pid, retried)
        if killed is not None:
            break
    assert killed is not None, "every restore got done before its CRIU could be killed"
    assert killed.returncode == 1, killed.stderr
    _no_zombies(daemon_pid)
    assert poll(lambda: not strays_of(daemon_pid), 3.0) is not None, strays_of(daemon_pid)
    # Nothing of the failed restores is listed as a job; the original runs on.
    jobs = {j["job"]: j["state"] for j in d.json("ps")}
    assert jobs.pop(job["job"]) == "running"
    assert sorted(jobs) == sorted(retried) and "running" not in jobs.values(), jobs
    assert proctree.alive(job["pid"], None)
