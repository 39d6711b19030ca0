"""A job's own pseudo-terminals: a devpts instance of its own, in its own mount namespace.

Why: CRIU gives a restored pty master the number it had (criu/tty.c opens /dev/ptmx until the
kernel hands out that index), and the kernel hands out the lowest free one. In the node's shared
/dev/pts any process that holds that number (an administrator's ssh session, another job's
rank) fails the restore: "Unable to open dev/ptmx with specified index N". Open MPI 4 gives
each rank it starts a pty, so an MPI job would restore only where its numbers happen to be free.
A devpts mounted with `newinstance` in the job's mount namespace numbers from 0 for that job
alone; CRIU dumps it with the namespace's own mounts and mounts a fresh instance at restore
(engine/privatetmp.py: the namespace's own mounts travel in the images), so the numbers are
always free. /dev/ptmx needs nothing: since Linux 4.7 opening it takes the devpts mounted at
the "pts" beside it in the opener's namespace.

Given to the processes stasis starts in a namespace of their own: a Slurm job's batch tree
(stasis/slurm/files/stasis_spank.c does the same in C, its constants below) and each part of a
job across nodes (stasis/daemon/jobsupervisor.py).

Such a namespace is the node's but for its devpts, and it is not dumped: CRIU runs inside it
(`nsenter --mount`), where the tree's mounts are CRIU's own, and the restorer makes a fresh one
(`enter`) in which it opens the job's new output files and runs CRIU, so the tree comes back in
it. Dumping the namespace instead (as a private /tmp's is, engine/privatetmp.py) would rebuild it
at restore after the restorer opened those files outside it: the next dump then fails on them
("Can't lookup mount=N", seen with CRIU 4.2). Marked in the manifest (EXTRA_KEY) so that every
restorer makes one.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
from collections.abc import Mapping
from typing import Any

# The mount's source, as mount tables show it (how tests and operators find it).
SOURCE = "stasis-devpts"
# Debian's base-passwd fixes the tty group's id at 5; the node's own /dev/pts uses it too.
TTY_GID = 5
# What a login's devpts has: the job's user opens /dev/ptmx, its terminals are theirs and tty's.
OPTIONS = f"newinstance,ptmxmode=0666,mode=0620,gid={TTY_GID}"
MOUNT_POINT = "/dev/pts"
# The manifest's `extra` key: the tree had terminals of its own; its restorer makes a new devpts.
EXTRA_KEY = "own_pts"

_CLONE_NEWNS = 0x00020000
_NS_GET_USERNS = 0xB701  # _IO(0xb7, 0x1), linux/nsfs.h
_MS_NOSUID = 0x2
_MS_NOEXEC = 0x8
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19


def enter(new_namespace: bool) -> None:
    """As root, before the job opens any file: with `new_namespace`, a mount namespace of the
    caller's own first (a slave of the node's: the node's later mounts still reach the job,
    the job's never leave it); then a devpts of the job's own on /dev/pts. OSError if the
    kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if new_namespace:
        _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _check(libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    _check(
        libc.mount(
            SOURCE.encode(),
            MOUNT_POINT.encode(),
            b"devpts",
            _MS_NOSUID | _MS_NOEXEC,
            OPTIONS.encode(),
        ),
        f"mount devpts on {MOUNT_POINT}",
    )


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"private pseudo-terminals: {what}: {os.strerror(err)}")


def recorded(extra: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's manifest `extra` says its tree had a devpts of its own."""
    return extra.get(EXTRA_KEY) is True


def only_own_pts(pid: int) -> bool:
    """Whether `pid` lives in a mount namespace that is the caller's but for a devpts of its own
    on /dev/pts: what `enter` makes. A namespace with more of its own (a private /tmp, a Slurm
    job container's) is dumped whole instead (engine/privatetmp.py); one without any difference
    would be the caller's own."""
    try:
        if os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino:
            return False
        theirs = _mounts(f"/proc/{pid}/mountinfo")
        ours = _mounts("/proc/self/mountinfo")
    except (OSError, ValueError, IndexError):
        return False  # gone, or unreadable: CRIU says what is wrong
    own = {m for m in theirs if m[0] == MOUNT_POINT and m[3] == SOURCE}
    # The node's mounts made since reach the job (a slave), unless the node keeps them private.
    return bool(own) and (theirs - own) <= ours


def _mounts(mountinfo: str) -> set[tuple[str, str, str, str]]:
    """Each mount as (mount point, filesystem, root within it, source)."""
    found = set()
    with open(mountinfo) as f:
        for line in f:
            fields = line.split()
            tail = fields.index("-")
            found.add((fields[4], fields[2], fields[3], fields[tail + 2]))
    return found


def namespace_fd(pid: int) -> int:
    """A descriptor of `pid`'s mount namespace, for CRIU to run in (`nsenter`), once it is known
    to be owned by the node's user namespace: then only the node's root can mount or unmount
    anything in it. A job's process may unshare a user namespace and a mount namespace of its
    own (and a process of the job's user could move the job's init into them), mount a devpts
    named like ours and pass `only_own_pts`; there it could later bind anything over the
    programs CRIU runs (iptables). The descriptor, not the path, goes to nsenter: the namespace
    checked is the one entered. OSError if it cannot be opened; PermissionError if it is not
    the node's to trust."""
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        owner = fcntl.ioctl(fd, _NS_GET_USERNS)
        try:
            theirs = os.fstat(owner)
        finally:
            os.close(owner)
        ours = os.stat("/proc/self/ns/user")
        if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
            raise PermissionError(
                f"its mount namespace is not the one stasis gave it (process {pid} moved into "
                "a user namespace of its own): CRIU does not run in a namespace its user controls"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def nsenter(fd: int) -> list[str]:
    """The argv prefix that runs a command (CRIU) in the mount namespace `fd` (namespace_fd),
    which the command inherits."""
    return ["nsenter", f"--mount=/proc/self/fd/{fd}", "--"]
