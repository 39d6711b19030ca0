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

Before a restore into such a namespace: the TCP sockets a tree killed there left to the kernel
(`netns_orphans`), which would make CRIU's bind of a restored listener fail.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
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


# Why a restore looks at the namespace first (orphans, below): CRIU binds a restored listener
# as an application would, SO_REUSEADDR set, and the kernel refuses that bind while any socket
# on the port lacks reuse and is not listening. The connections a listener accepted inherit its
# reuse (none, unless the application set it), and those it closed before its tree was killed
# live on without it as the kernel's own (FIN-WAIT, TIME-WAIT for a minute, LAST-ACK): CRIU
# neither dumps them nor can it bind past them, and fails with "Address already in use" halfway.
# Such a socket has no file: the kernel shows inode 0 for it (sock_i_ino of an orphan).
_TCP_STATES = {
    1: "ESTAB",
    2: "SYN-SENT",
    3: "SYN-RECV",
    4: "FIN-WAIT-1",
    5: "FIN-WAIT-2",
    6: "TIME-WAIT",
    7: "CLOSE",
    8: "CLOSE-WAIT",
    9: "LAST-ACK",
    10: "LISTEN",
    11: "CLOSING",
}
_ORPHAN_STATES = frozenset({"FIN-WAIT-1", "FIN-WAIT-2", "TIME-WAIT", "LAST-ACK", "CLOSING"})


@dataclass(frozen=True)
class TcpSocket:
    """One row of /proc/net/tcp or tcp6: its addresses as `address:port` ([address]:port for
    IPv6), its state as `ss` names it, its inode (0: no file, no process holds it)."""

    local: str
    remote: str
    state: str
    inode: int

    def __str__(self) -> str:
        return f"{self.local} {self.state}"


def _endpoint(hexed: str) -> str:
    address, port = hexed.split(":")
    raw = bytes.fromhex(address)
    # The kernel prints each 32-bit word of the address in its own (little-endian) order.
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(packed) == 4:
        return f"{ipaddress.IPv4Address(packed)}:{int(port, 16)}"
    ip = ipaddress.IPv6Address(packed)
    return f"{ip.ipv4_mapped or f'[{ip}]'}:{int(port, 16)}"


def parse_proc_tcp(text: str) -> list[TcpSocket]:
    """The sockets of /proc/net/tcp or /proc/net/tcp6's `text`, or of both one after the other
    (header lines skipped); ValueError on a row that is not one."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0] == "sl":
            continue
        if len(fields) < 10:
            raise ValueError(f"not a row of /proc/net/tcp: {line.strip()!r}")
        state = int(fields[3], 16)
        found.append(
            TcpSocket(
                local=_endpoint(fields[1]),
                remote=_endpoint(fields[2]),
                state=_TCP_STATES.get(state, f"state {state}"),
                inode=int(fields[9]),
            )
        )
    return found


def orphans(sockets: Iterable[TcpSocket]) -> list[TcpSocket]:
    """Those of `sockets` that no process holds and that are closing: what a tree killed (or a
    connection closed) left to the kernel. A socket a live process holds is none of them, nor
    one not yet accepted from a live listener's queue (established, inode 0 too)."""
    return [s for s in sockets if s.inode == 0 and s.state in _ORPHAN_STATES]


def netns_orphans(netns: Path) -> list[TcpSocket]:
    """The orphan TCP sockets (`orphans`) in the network namespace whose file is `netns` (a
    daemon's /run/netns/stasis-job-V, never a user's). Read by root's own nsenter and cat, the
    namespace's /proc/net/tcp{,6} as seen from inside it; nothing of a user's runs. OSError, one
    line, when it cannot be read."""
    tables = [t for t in ("/proc/net/tcp", "/proc/net/tcp6") if os.path.exists(t)]
    try:
        done = subprocess.run(
            ["nsenter", f"--net={netns}", "cat", *tables],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise OSError(f"cannot read the TCP sockets of network namespace {netns}: {e}") from e
    if done.returncode:
        why = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise OSError(f"cannot read the TCP sockets of network namespace {netns}: {why[0]}")
    return orphans(parse_proc_tcp(done.stdout))
