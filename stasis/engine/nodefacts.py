"""What a restore depends on that this node can tell: its architecture, kernel, CPU flags, and
the regular files a process tree holds open (with their size and modification time).

The daemon records these in a checkpoint's manifest at dump time and compares them with the
restoring node before CRIU runs (stasis/daemon/compat.py). Reads /proc and uname only.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class HeldFile:
    path: str
    size_bytes: int
    mtime_ns: int
    writable: bool


@dataclass(frozen=True)
class Node:
    arch: str
    kernel: str
    cpu_flags: frozenset[str]


@cache
def this_node() -> Node:
    uname = os.uname()
    return Node(arch=uname.machine, kernel=uname.release, cpu_flags=frozenset(cpu_flags()))


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's feature flags as the kernel reports them (x86 "flags", arm64 "Features"):
    those a process may have used and CRIU's cpuinfo check compares."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return sorted(set(value.split()))
    except OSError:
        pass
    return []


def held_files(pids: list[int], skip: set[str]) -> list[HeldFile]:
    """Regular files the processes `pids` hold open, once each (by path), but those in `skip`
    (what stasis itself gives the job: its log). Deleted files are CRIU's to handle (it dumps
    their contents), so they are not listed; a process gone meanwhile is skipped."""
    found: dict[str, HeldFile] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
                if not path.startswith("/") or path.endswith(" (deleted)") or path in skip:
                    continue
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if not stat.S_ISREG(st.st_mode):
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                    flags = next(int(line.split()[1], 8) for line in info
                                 if line.startswith("flags:"))
            except (OSError, StopIteration, ValueError):
                continue
            writable = flags & os.O_ACCMODE != os.O_RDONLY
            known = found.get(path)
            found[path] = HeldFile(path, st.st_size, st.st_mtime_ns,
                                   writable or (known is not None and known.writable))
    return [found[p] for p in sorted(found)]
