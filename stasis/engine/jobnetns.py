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

import os
from typing import Any

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
