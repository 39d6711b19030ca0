"""Process trees as /proc shows them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE")


def children(pid: int) -> list[int]:
    """Direct children of every thread of `pid` (empty when it is gone)."""
    result: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return result
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except OSError:
            continue
        result.extend(int(p) for p in text.split())
    return result


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants, parents first."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children(p))
    return out


def outputs(pid: int) -> set[tuple[int, int]]:
    """The (device, inode) of `pid`'s stdout and stderr: a job's log, which a restore
    re-points at a file of its own."""
    out = set()
    for std in (1, 2):
        try:
            st = os.stat(f"/proc/{pid}/fd/{std}")
        except OSError:
            continue
        out.add((st.st_dev, st.st_ino))
    return out


def resident_bytes(pid: int) -> int:
    """Resident memory of the whole tree under `pid` (an upper bound on what a dump writes).

    From statm, the kernel's RSS counter: smaps_rollup gives the same figure by walking the page
    tables, ~15 ms per GiB here, all of it added to every dump."""
    total = 0
    for p in tree(pid):
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


def signal_tree(pid: int, sig: signal.Signals) -> None:
    """Send `sig` to every process of the tree; gone processes are skipped."""
    for p in tree(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot: with the pid it identifies one process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def alive(pid: int, started: int | None) -> bool:
    """Whether `pid` still is the process that started at `started` (and is not a zombie).

    Only a process /proc no longer has is gone; any other failure to look (no file descriptors
    left, say) raises OSError: not being able to tell is not an exit."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return False
    return started is None or int(fields[19]) == started


def stopped(pid: int) -> list[int]:
    """The processes of the tree under `pid` that are stopped by a signal (state T)."""
    found = []
    for p in tree(pid):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] == "T":
            found.append(p)
    return found


def kill_descendants(timeout_s: float = 5.0) -> None:
    """SIGKILL every process under this one, again and again until none is left (or
    `timeout_s`): a process forking meanwhile (CRIU restoring a tree) would leave a child the
    first pass missed. Orphans of a subreaper come back to it for the next pass; zombies are
    the caller's to reap. A process whose /proc cannot be read counts as alive."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for pid in tree(os.getpid())[1:]:
            try:
                if alive(pid, None):
                    left.append(pid)
            except OSError:
                left.append(pid)
        if not left or time.monotonic() > deadline:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
