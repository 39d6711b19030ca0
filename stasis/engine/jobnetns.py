"""A tree that lives in a network namespace of its job's (stasis/daemon/jobnet.py): CRIU's options
that leave the namespace out of the images and put the restored tree into the one the restoring
node made for it.

The namespace is the node daemon's, not the job's: its devices (a veth whose other end is on the
node), addresses and routes are made again by the daemon wherever the part goes, so CRIU must not
dump them (it would refuse the veth: its peer is outside the tree) nor make a namespace of its
own on restore. CRIU calls such a namespace external: `net[INODE]:KEY` at dump, and on restore a
descriptor of the new namespace inherited under KEY (seen, CRIU 4.2.1: the tree comes back in it,
its established TCP connections repaired there). CRIU's network lock then covers the whole
namespace (every packet in or out dropped between the freeze and the restore's end), not single
connections: nothing of the node's own firewall is touched.
"""

from __future__ import annotations

import ctypes
import os
import socket
from typing import Any

from stasis.engine import proctree

KEY = "stasis-job-net"


def own_netns(pid: int) -> bool:
    """Whether `pid` is in another network namespace than the caller."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino


def dump_options(opts: Any, pid: int) -> None:
    """CRIU's dump options for a tree in its job's network namespace: the namespace external."""
    opts.external.append(f"net[{os.stat(f'/proc/{pid}/ns/net').st_ino}]:{KEY}")


def restore_options(opts: Any, netns_fd: int) -> None:
    """CRIU's restore options putting the tree into the namespace open as `netns_fd` (which
    must also be passed to CRIU: RestoreOptions.inherit_fds does both)."""
    opts.inherit_fd.add(key=KEY, fd=netns_fd)


_TCP_REPAIR = 19  # linux/tcp.h
_SYS_PIDFD_GETFD = 438


def silence_connections(pid: int) -> int:
    """Put every connected TCP socket of the tree under `pid` in repair mode, so that killing
    the tree closes them without a word to their peers (no FIN, no reset, no orphan socket left
    resending one on the connection's addresses in the namespace), as CRIU's own dumps leave
    them: a part stopped at its checkpoint, whose connections live on in its images. How many
    (root only; a task gone meanwhile is skipped)."""
    libc = ctypes.CDLL(None, use_errno=True)
    done = 0
    for task in proctree.tree(pid):
        try:
            names = os.listdir(f"/proc/{task}/fd")
            pidfd = os.pidfd_open(task)
        except OSError:
            continue
        try:
            for name in names:
                try:
                    if not os.readlink(f"/proc/{task}/fd/{name}").startswith("socket:"):
                        continue
                except OSError:
                    continue
                fd = int(libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(name), 0))
                if fd < 0:
                    continue
                with socket.socket(fileno=fd) as sock:
                    try:
                        if sock.type != socket.SOCK_STREAM or sock.family not in (
                            socket.AF_INET,
                            socket.AF_INET6,
                        ):
                            continue
                        sock.getpeername()  # connected ones only
                        sock.setsockopt(socket.IPPROTO_TCP, _TCP_REPAIR, 1)
                    except OSError:
                        continue
                    done += 1
        finally:
            os.close(pidfd)
    return done
