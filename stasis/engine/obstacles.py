"""What in a process tree CRIU cannot checkpoint, or cannot bring back as it was, found before
the dump (`stasis dump --check`) or to explain a dump that failed.

    obstacles  the dump will fail: a unix stream connection to a process outside the tree
               (unixpeers); or it cannot be taken at all: an open RDMA device
               (/dev/infiniband/*: InfiniBand verbs, RDMA CM) or an io_uring, whose state lives
               in the adapter or the kernel where CRIU cannot reach it (`unsupported_files`;
               the daemon refuses these before CRIU freezes anything: `refusal`)
    notes      the dump works, but the restore differs: a thread waiting in a timed sleep or
               futex wait that CRIU cannot restart gets EINTR once restored (CRIU's "Will
               restore N with interrupted system call"); a program that takes EINTR as fatal
               dies then
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

from stasis.engine import proctree, unixpeers

# Calls the kernel restarts through a restart block (-ERESTART_RESTARTBLOCK): CRIU cannot replay
# that, and makes them return EINTR in the restored task. By architecture: (nanosleep,
# clock_nanosleep, futex, poll); aarch64 has no poll (ppoll is restarted normally).
_SYSCALLS = {
    "x86_64": {35: "nanosleep", 230: "clock_nanosleep", 202: "futex", 7: "poll"},
    "aarch64": {101: "nanosleep", 115: "clock_nanosleep", 98: "futex"},
}
_TIMER_ABSTIME = 1
_FUTEX_CMD_MASK = ~(128 | 256)  # without FUTEX_PRIVATE_FLAG, FUTEX_CLOCK_REALTIME
_FUTEX_WAITS = (0, 9)  # FUTEX_WAIT, FUTEX_WAIT_BITSET


# Where RDMA devices are, by what /proc/PID/fd/N reads: libibverbs opens
# /dev/infiniband/uverbsN, librdmacm /dev/infiniband/rdma_cm, MAD users umadN/issmN.
RDMA_DIRS = ("/dev/infiniband/",)
_IO_URING = "anon_inode:[io_uring]"
_TARGET_CHARS = 120


@dataclass(frozen=True)
class UnsupportedFile:
    """An open file of the tree that no checkpoint can carry."""

    pid: int
    fd: int
    target: str  # what /proc/PID/fd/FD reads
    rdma: bool  # an RDMA device; otherwise an io_uring

    def describe(self, viewer: int | None = None) -> str:
        who = f"pid {self.pid} ({unixpeers.command(self.pid, viewer)})"
        if self.rdma:
            return (
                f"{who} holds the RDMA device {_printable(self.target)} (fd {self.fd}), which CRIU "
                "cannot checkpoint (its queue pairs and registered memory live in the adapter): "
                "run it over TCP (Open MPI: OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader,tcp; "
                "MPICH or UCX: UCX_TLS=tcp,self,sm), or without stasis"
            )
        return (
            f"{who} holds an io_uring (fd {self.fd}), which CRIU cannot checkpoint (its rings "
            "and the requests in flight live in the kernel): run it without io_uring (most "
            "programs can fall back to epoll or threads), or without stasis"
        )


@dataclass
class Findings:
    obstacles: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def find(root: int, viewer: int | None = None) -> Findings:
    """Everything this module knows to look for in the tree under `root`, told to `viewer` (a
    uid: other users' processes are named, their arguments not shown)."""
    return Findings(
        obstacles=[f.describe(viewer) for f in unsupported_files(root)]
        + [p.describe() for p in unixpeers.external_peers(root, viewer)],
        notes=[_note(pid, call, viewer) for pid, call in timed_waits(root)],
    )


def refusal(root: int, viewer: int | None = None) -> str | None:
    """Why no checkpoint of the tree under `root` can be taken, whatever CRIU is asked (None:
    nothing known): checked before a dump, so that such a job is never frozen for nothing."""
    return "; ".join(f.describe(viewer) for f in unsupported_files(root)) or None


def unsupported_files(root: int, rdma_dirs: tuple[str, ...] = RDMA_DIRS) -> list[UnsupportedFile]:
    """The open RDMA devices (files under `rdma_dirs`) and io_urings of the tree under `root`,
    the first of each kind per process. Only the links' text is read: nothing is followed."""
    found = []
    for pid in proctree.tree(root):
        try:
            fds = sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue  # gone, or not ours to look into: CRIU's own error will say
        seen: set[bool] = set()
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            rdma = target.startswith(rdma_dirs)
            if (rdma or target == _IO_URING) and rdma not in seen:
                seen.add(rdma)
                found.append(UnsupportedFile(pid, fd, target, rdma))
    return found


def explain(root: int, viewer: int | None = None) -> str | None:
    """Why a dump of the tree under `root` failed, as far as can be told from outside CRIU
    (None: nothing known to block it); never raises, it only adds to another error."""
    try:
        obstacles = [f.describe(viewer) for f in unsupported_files(root)] + [
            p.describe() for p in unixpeers.external_peers(root, viewer)
        ]
    except OSError:
        return None
    return "; ".join(obstacles) or None


def timed_waits(root: int) -> list[tuple[int, str]]:
    """(pid, call) for each process of the tree with a thread blocked in a call that a restore
    ends early with EINTR. Empty on architectures not in the table."""
    calls = _SYSCALLS.get(platform.machine())
    if not calls:
        return []
    found = []
    for pid in proctree.tree(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            call = _interrupted(f"/proc/{pid}/task/{tid}/syscall", calls)
            if call:
                found.append((pid, call))
                break  # one per process is enough to say it
    return found


def _interrupted(path: str, calls: dict[int, str]) -> str | None:
    try:
        with open(path) as f:
            fields = f.read().split()
    except OSError:
        return None
    if len(fields) < 7 or not fields[0].isdigit():
        return None  # "running", or "-1 sp pc": not in a call
    name = calls.get(int(fields[0]))
    args = [int(a, 16) for a in fields[1:7]]
    if name == "nanosleep":
        return name
    if name == "clock_nanosleep" and not args[1] & _TIMER_ABSTIME:
        return name
    if name == "futex" and args[1] & _FUTEX_CMD_MASK in _FUTEX_WAITS and args[3]:
        return name
    if name == "poll" and args[2] & 0xFFFFFFFF < 0x80000000:  # a timeout, not -1 (forever)
        return name
    return None


def _printable(path: str) -> str:
    """A path for one line: no control characters, not too long."""
    text = "".join(c if c.isprintable() else "?" for c in path)
    return text if len(text) <= _TARGET_CHARS else text[: _TARGET_CHARS - 3] + "..."


def _note(pid: int, call: str, viewer: int | None) -> str:
    return (
        f"pid {pid} ({unixpeers.command(pid, viewer)}) waits in {call} with a timeout, which CRIU "
        "cannot restart: after a restore that call returns early with EINTR (most programs "
        "retry; one that takes EINTR as fatal dies then)"
    )


__all__ = [
    "RDMA_DIRS",
    "Findings",
    "UnsupportedFile",
    "explain",
    "find",
    "refusal",
    "timed_waits",
    "unsupported_files",
]
