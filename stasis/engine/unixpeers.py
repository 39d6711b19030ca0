"""Unix stream connections that cross the edge of a process tree: what CRIU cannot dump.

CRIU dumps both ends of a unix stream (or seqpacket) connection or neither: when one end belongs
to the tree and the other to a process outside it (a terminal multiplexer's client attached to
its server, a database client talking through the server's socket directory), the dump fails
with "Can't dump half of stream unix connection", naming no process. This finds those
connections before (or after) CRIU does, and who holds the far end: the kernel's sock_diag
netlink interface gives each unix socket's peer inode (what `ss -x` shows), and /proc/*/fd says
which processes hold a socket inode.

The tree's own network namespaces are looked into (a job in a job network has one of its own;
sock_diag lists the sockets of the namespace its netlink socket was made in, each with its peer's
inode wherever that peer lives).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from stasis.engine import proctree

# <linux/netlink.h>, <linux/sock_diag.h>, <linux/unix_diag.h>
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
UDIAG_SHOW_NAME = 0x1
UDIAG_SHOW_PEER = 0x4
UNIX_DIAG_NAME = 0
UNIX_DIAG_PEER = 2

_NLMSGHDR = struct.Struct("=IHHII")
_UNIX_DIAG_REQ = struct.Struct("=BBHIIIII")
_UNIX_DIAG_MSG = struct.Struct("=BBBBIII")
_RTATTR = struct.Struct("=HH")
_STREAMS = (socket.SOCK_STREAM, socket.SOCK_SEQPACKET)  # CRIU dumps neither half of these
_COMMAND_CHARS = 200  # a command line in an error: enough to tell programs apart
_CMDLINE_MAX = 4096
_TYPES = {int(socket.SOCK_STREAM): "stream", int(socket.SOCK_SEQPACKET): "seqpacket"}
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class UnixSocket:
    inode: int
    type: int  # socket.SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET
    peer: int  # the inode of the other end (0: none)
    name: str | None  # the address it is bound to (accepted sockets share their listener's)


@dataclass(frozen=True)
class Process:
    pid: int
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command})"


@dataclass(frozen=True)
class ExternalPeer:
    """A unix stream (or seqpacket) connection from `inside`, a process of the tree, to a
    socket outside it. Accepted sockets carry their listener's address, so the end with an
    address is the server's: `served_inside` says which side that is (None: neither, as with
    a socketpair handed over at start)."""

    inside: Process
    kind: str  # "stream" or "seqpacket"
    address: str | None
    served_inside: bool | None
    holders: tuple[Process, ...]  # the outside processes holding the far end (may be none seen)

    def describe(self) -> str:
        outside = (
            " and ".join(str(p) for p in self.holders)
            or "a socket no process outside holds open (in flight, or in another namespace)"
        )
        limit = f"CRIU cannot dump one end of a unix {self.kind} connection"
        if self.served_inside:
            return (
                f"{outside}, outside the job, is connected to the job's socket "
                f"{self.address} (served by {self.inside}): {limit}; disconnect or stop "
                "that client before the dump, or run it inside the job"
            )
        if self.served_inside is False:
            return (
                f"{self.inside} is connected to {self.address}, served by {outside} "
                f"outside the job: {limit}; have the job close that connection before the "
                "dump, or run that server inside the job"
            )
        return (
            f"{self.inside} shares an unnamed unix {self.kind} connection (a socketpair) "
            f"with {outside}, outside the job: {limit}; close it on one side before the "
            "dump, or run that process inside the job"
        )


def netns(pid: int) -> int | None:
    """The inode of `pid`'s network namespace (None: gone, or not to be read)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _diag_socket_in(pid: int) -> socket.socket:
    """A sock_diag netlink socket of `pid`'s network namespace: made on a thread of its own that
    enters it (a network namespace is per thread; the thread, and its namespace, end with it).
    OSError whatever goes wrong, the thread's start included."""
    made: list[socket.socket] = []
    failed: list[OSError] = []

    def enter() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into pid {pid}'s network: {os.strerror(err)}")
            finally:
                os.close(fd)
            made.append(_diag_socket())
        except OSError as e:
            failed.append(e)
        except Exception as e:  # noqa: BLE001 - said to the caller as what it expects
            failed.append(OSError(f"cannot look into pid {pid}'s network: {e}"))

    try:
        thread = threading.Thread(target=enter, name=f"sock-diag-{pid}", daemon=True)
        thread.start()
    except RuntimeError as e:  # no thread to be had (pids.max, the interpreter ending)
        raise OSError(f"cannot look into pid {pid}'s network: {e}") from None
    thread.join()
    if failed or not made:
        raise failed[0] if failed else OSError(f"cannot look into pid {pid}'s network")
    return made[0]


def _diag_socket() -> socket.socket:
    return socket.socket(
        socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG
    )


def unix_sockets(of: int | None = None) -> dict[int, UnixSocket]:
    """Every unix socket of this network namespace (`of`: of that process's), by inode, with
    its peer and address."""
    here = of is None or netns(of) == netns(os.getpid())
    with _diag_socket() if of is None or here else _diag_socket_in(of) as nl:
        req = _UNIX_DIAG_REQ.pack(
            socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, UDIAG_SHOW_NAME | UDIAG_SHOW_PEER, 0, 0
        )
        hdr = _NLMSGHDR.pack(
            _NLMSGHDR.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0
        )
        nl.sendto(hdr + req, (0, 0))
        found: dict[int, UnixSocket] = {}
        while True:
            data = nl.recv(1 << 16)
            for kind, payload in _messages(data):
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", payload)[0]
                    if code == 0:
                        continue
                    raise OSError(code, f"sock_diag: {os.strerror(code)}")
                sk = _parse(payload)
                found[sk.inode] = sk


def _messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size:
            return
        yield kind, data[offset + _NLMSGHDR.size : offset + length]
        offset += (length + 3) & ~3


def _parse(payload: bytes) -> UnixSocket:
    _family, kind, _state, _pad, inode, _c0, _c1 = _UNIX_DIAG_MSG.unpack_from(payload)
    peer = 0
    name = None
    offset = _UNIX_DIAG_MSG.size
    while offset + _RTATTR.size <= len(payload):
        length, attr = _RTATTR.unpack_from(payload, offset)
        if length < _RTATTR.size:
            break
        value = payload[offset + _RTATTR.size : offset + length]
        if attr == UNIX_DIAG_PEER and len(value) >= 4:
            peer = struct.unpack_from("=I", value)[0]
        elif attr == UNIX_DIAG_NAME and value:
            # An abstract address starts with a NUL; `ss` shows it as '@'.
            name = (
                ("@" + value[1:].decode(errors="replace"))
                if value[0] == 0
                else value.decode(errors="replace").rstrip("\0")
            )
        offset += (length + 3) & ~3
    return UnixSocket(inode=inode, type=kind, peer=peer, name=name)


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets `pid` holds open (empty when it is gone or cannot be read)."""
    found: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def command(pid: int, viewer: int | None = None) -> str:
    """`pid`'s command line, shortened for one line of an error ("?" when it is gone).

    Told to `viewer` (a uid; None or 0: root): another user's process shows only its name and
    owner, since its arguments may hold what that user keeps from others (nodes may mount
    /proc with hidepid)."""
    try:
        if viewer:
            owner = os.stat(f"/proc/{pid}").st_uid
            if owner != viewer:
                with open(f"/proc/{pid}/comm") as f:
                    return f"{_one_line(f.read())}, user {_user(owner)}"
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            # The user's to make megabytes long: only what a line can show is read.
            argv = f.read(_CMDLINE_MAX).rstrip(b"\0").split(b"\0")
        # The program's name, not its whole path: the line has the pid for the rest.
        argv[0] = os.path.basename(argv[0])
        text = " ".join(a.decode(errors="replace") for a in argv)
        if not text:  # a kernel thread, or a zombie
            with open(f"/proc/{pid}/comm") as f:
                text = f.read().strip()
    except OSError:
        return "?"
    text = _one_line(text)
    return text if len(text) <= _COMMAND_CHARS else text[: _COMMAND_CHARS - 3] + "..."


def _one_line(text: str) -> str:
    """`text` fit for one line of an error, whatever it holds (a `python -c` program, a
    terminal's escapes, a name set by prctl): each run of blanks or control characters one
    space."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def _user(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def holders(inodes: Iterable[int], skip: set[int]) -> dict[int, list[int]]:
    """Which processes (not in `skip`) hold each of `inodes` open: one pass over /proc."""
    wanted = set(inodes)
    found: dict[int, list[int]] = {i: [] for i in wanted}
    if not wanted:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        for inode in socket_inodes(int(entry)) & wanted:
            found[inode].append(int(entry))
    return found


def _crossing(tree: list[int]) -> tuple[list[tuple[UnixSocket, int]], dict[int, UnixSocket]]:
    """The tree's ends of unix stream connections whose other end no process of it holds, each
    with the first process of the tree holding it; and the sockets looked at, by inode."""
    mine: dict[int, int] = {}  # socket inode -> the first process of the tree holding it
    for pid in tree:
        for inode in socket_inodes(pid):
            mine.setdefault(inode, pid)
    if not mine:
        return [], {}
    # One listing per network namespace the tree's processes are in (usually one), and this
    # one's: the socket a server's accept() gives lives in its client's namespace, so a server
    # in the tree with a client outside holds a socket of the client's.
    spaces = {netns(os.getpid()): os.getpid()}
    for pid in tree:
        spaces.setdefault(netns(pid), pid)
    sockets: dict[int, UnixSocket] = {}
    for space, pid in spaces.items():
        try:
            sockets.update(unix_sockets(pid))
        except OSError:
            if space is not None and netns(pid) == space:
                raise  # not gone: a namespace not looked into would hide a connection
    crossing = [
        (sockets[i], pid)
        for i, pid in mine.items()
        if i in sockets
        and sockets[i].type in _STREAMS
        and sockets[i].peer
        and sockets[i].peer not in mine
    ]
    return crossing, sockets


def crosses_edge(root: int) -> bool:
    """Whether a unix stream connection crosses the edge of the tree under `root` (what
    `external_peers` describes, without looking for who holds the far ends: cheap enough to
    ask again and again). OSError when a namespace of the tree cannot be looked into."""
    return bool(_crossing(proctree.tree(root))[0])


def external_peers(root: int, viewer: int | None = None) -> list[ExternalPeer]:
    """The unix stream and seqpacket connections between the tree under `root` and processes
    outside it: each one makes CRIU's dump of the tree fail. Commands as `viewer` may see them
    (see `command`). OSError when a namespace of the tree cannot be looked into."""
    tree = proctree.tree(root)
    crossing, sockets = _crossing(tree)
    if not crossing:
        return []
    far = holders((sk.peer for sk, _ in crossing), skip=set(tree))
    peers = []
    for sk, pid in sorted(crossing, key=lambda c: (c[1], c[0].inode)):
        other = sockets.get(sk.peer)
        outside_name = other.name if other else None
        address = sk.name or outside_name
        peers.append(
            ExternalPeer(
                inside=Process(pid, command(pid, viewer)),
                kind=_TYPES[sk.type],
                address=_one_line(address) if address is not None else None,
                served_inside=True if sk.name else False if outside_name else None,
                holders=tuple(Process(p, command(p, viewer)) for p in sorted(far.get(sk.peer, []))),
            )
        )
    return peers


__all__ = [
    "ExternalPeer",
    "Process",
    "UnixSocket",
    "crosses_edge",
    "external_peers",
    "unix_sockets",
]
