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
"""

from __future__ import annotations

import ctypes
import os

# The mount's source, as mount tables show it (how tests and operators find it).
SOURCE = "stasis-devpts"
# Debian's base-passwd fixes the tty group's id at 5; the node's own /dev/pts uses it too.
TTY_GID = 5
# What a login's devpts has: the job's user opens /dev/ptmx, its terminals are theirs and tty's.
OPTIONS = f"newinstance,ptmxmode=0666,mode=0620,gid={TTY_GID}"
MOUNT_POINT = "/dev/pts"

_CLONE_NEWNS = 0x00020000
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
