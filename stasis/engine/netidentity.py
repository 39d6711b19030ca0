"""A job's network identity on a move: which of its TCP connections a restore brings back, which
it restores closed, and which sockets cannot come back on this node at all.

A checkpoint's inet sockets carry the addresses of the node that dumped it. On that node (more
precisely: where CRIU's network lock for a connection is still in the firewall, so the peer is
still waiting for it) every connection comes back as it was. Elsewhere:
- a connection to a peer outside the job cannot: its local address is the old node's, and the
  peer's packets go there. CRIU would fail the whole restore ("Can't bind inet socket back:
  Cannot assign requested address"). It is restored closed instead (CRIU's tcp_close, for
  chosen sockets through CRIU patch 0005's CRIU_TCP_CLOSE): the job reads EOF, a write fails
  with EPIPE, and the job reconnects as after any network failure. The restore's notes name
  each one. The old node lifts its lock for them once it learns from the store that the
  checkpoint was restored elsewhere (stasis/daemon/netlocks.py).
- a connection whose both ends are in the job comes back when its address exists here
  (loopback); over the old node's own address it is closed like the others (both ends).
- a listening or bound socket on 0.0.0.0, ::, or an address this node has too (127.0.0.1)
  listens again; one bound to an address this node lacks cannot be bound at all: the restore is
  refused before CRIU runs, naming the address (IncompatibleNodeError).

The images are CRIU's files.img (images/fdinfo.proto file_entry, images/sk-inet.proto
inet_sk_entry), read here as root: they are the checkpoint's own, which only root can write or
which were verified before CRIU reads them; a malformed one only costs this restore.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import socket
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stasis.engine import netlock, protobuf
from stasis.errors import IncompatibleNodeError

_FILES_MAX = 64 << 20  # one entry per open file, ~100 bytes each
_INETSK = 4  # fd_types.INETSK; file_entry.isk is field 4 too
_IP_OPTS, _FREEBIND = 16, 1  # inet_sk_entry.ip_opts -> ip_opts_entry.freebind
_TCP_LISTEN = 10
_BOUND_PROTOS = (socket.IPPROTO_TCP, socket.IPPROTO_UDP, 136)  # 136: UDP-Lite
_NAMED = 5  # connections named in a note, the rest counted
_MARK = b"CRIU_TCP_CLOSE"  # in a criu binary built with patch 0005
_CRIU_MAX = 64 << 20


Conn = tuple[str, int, str, int]  # local address, port, peer address, port


@dataclass(frozen=True)
class InetSocket:
    """One inet socket of a checkpoint, as its inet_sk_entry records it."""

    ino: int
    family: int
    proto: int
    state: int
    src: str
    sport: int
    dst: str
    dport: int
    freebind: bool

    @property
    def connected_tcp(self) -> bool:
        # What CRIU restores through TCP repair (sk-inet.c tcp_connection()).
        return self.proto == socket.IPPROTO_TCP and self.dport != 0

    @property
    def conn(self) -> Conn:
        return (self.src, self.sport, self.dst, self.dport)


@dataclass
class Plan:
    """What a restore on this node does with the checkpoint's connections."""

    close: list[InetSocket] = field(default_factory=list)  # restored closed
    all_closed: bool = False  # every connected TCP socket: CRIU's own tcp_close does it
    notes: list[str] = field(default_factory=list)

    @property
    def close_inodes(self) -> list[int]:
        return [s.ino for s in self.close]


def plan(images: Path, checkpoint: str, criu_path: str | None = None) -> Plan:
    """Decide, before CRIU runs, what happens to the inet sockets in `images` on this node.
    IncompatibleNodeError when one is bound to an address this node does not have. `criu_path`:
    the criu binary, to tell whether it can close chosen connections (patch 0005); one that
    cannot closes them all when any must be."""
    found = sockets(images)
    unbindable = [s for s in found if _binds(s) and not _local(s.family, s.src)]
    if unbindable:
        s = unbindable[0]
        what = (
            "listens on"
            if s.state == _TCP_LISTEN
            else f"has a {'TCP' if s.proto == socket.IPPROTO_TCP else 'UDP'} socket bound to"
        )
        more = f" (and {len(unbindable) - 1} more)" if len(unbindable) > 1 else ""
        raise IncompatibleNodeError(
            f"checkpoint {checkpoint} cannot be restored on {socket.gethostname()}: the job "
            f"{what} {_endpoint(s.src, s.sport)}{more}, an address of the node that checkpointed "
            "it which this node does not have; restore it on a node with that address, or "
            "have the job listen on 0.0.0.0 (all addresses) so that it can move"
        )
    connected = [s for s in found if s.connected_tcp]
    if not connected:
        return Plan()
    locked = _locked()
    ends = {s.conn for s in connected}
    result = Plan()
    outside: list[InetSocket] = []
    inside: list[InetSocket] = []
    for s in connected:
        here = _local(s.family, s.src)
        if here and s.conn in locked:
            continue  # the node that dumped it: the peer waits behind CRIU's lock
        in_job = (s.dst, s.dport, s.src, s.sport) in ends
        if in_job and here:
            continue  # both ends come back, over an address this node has (loopback)
        result.close.append(s)
        (inside if in_job else outside).append(s)
    result.all_closed = bool(result.close) and len(result.close) == len(connected)
    if outside:
        result.notes.append(
            f"{_count(len(outside))} to "
            f"{'a peer' if len(outside) == 1 else 'peers'} outside the job "
            f"{'was' if len(outside) == 1 else 'were'} closed on the move (the job reads "
            f"end-of-file, as when a peer closes): {_peers(outside)}"
        )
    if inside:
        pairs = len(inside) // 2 or 1
        result.notes.append(
            f"{_count(pairs)} between processes of the job "
            f"{'was' if pairs == 1 else 'were'} closed on the move: "
            f"{'it runs' if pairs == 1 else 'they run'} over an address of the node that "
            f"checkpointed it ({_locals(inside)}), which this node does not have; connect over "
            "127.0.0.1 for connections that move with the job"
        )
    if result.close and not result.all_closed and criu_path and not closes_chosen(criu_path):
        back = [s for s in connected if s not in result.close]
        inner = sum(1 for s in back if (s.dst, s.dport, s.src, s.sport) in ends)
        kept = len(back) - inner + (inner + 1) // 2  # both ends of one in the job: one
        result.close, result.all_closed = list(connected), True
        result.notes.append(
            f"{_count(kept)} that could have come back {'was' if kept == 1 else 'were'} closed "
            f"too: {criu_path} cannot close only some (it lacks stasis's CRIU patch 0005; "
            "`make install` builds it)"
        )
    return result


@functools.cache
def closes_chosen(criu_path: str) -> bool:
    """Whether the criu binary knows CRIU_TCP_CLOSE (stasis's patch 0005)."""
    try:
        with open(criu_path, "rb") as f:
            return _MARK in f.read(_CRIU_MAX)
    except OSError:
        return False


def sockets(images: Path) -> list[InetSocket]:
    """The inet sockets the checkpoint's files.img records ([] when it has none, or cannot be
    read: CRIU then says what is wrong)."""
    try:
        with open(images / "files.img", "rb") as f:
            data = f.read(_FILES_MAX)
    except OSError:
        return []
    try:
        return list(_parse(data))
    except ValueError:
        return []


def _parse(data: bytes) -> Iterable[InetSocket]:
    # Two magics, then entries: a u32 (little-endian) size and a file_entry each.
    at = 8
    while at + 4 <= len(data):
        size = int.from_bytes(data[at : at + 4], "little")
        at += 4
        if at + size > len(data):
            raise ValueError("an entry runs past the end")
        entry = protobuf.fields(data[at : at + size])
        at += size
        kind = next((v for n, v in entry if n == 1 and isinstance(v, int)), None)
        isk = next((v for n, v in entry if n == _INETSK and isinstance(v, bytes)), None)
        if kind == _INETSK and isk is not None:
            yield _inet(isk)


def _inet(data: bytes) -> InetSocket:
    fields = protobuf.fields(data)
    ints = {n: v for n, v in fields if isinstance(v, int)}
    family = ints.get(3, 0)
    opts = next((v for n, v in fields if n == _IP_OPTS and isinstance(v, bytes)), b"")
    freebind = any(n == _FREEBIND and v for n, v in protobuf.fields(opts))
    return InetSocket(
        ino=ints.get(2, 0),
        family=family,
        proto=ints.get(5, 0),
        state=ints.get(6, 0),
        src=_address(family, protobuf.repeated(fields, 11)),
        sport=ints.get(7, 0),
        dst=_address(family, protobuf.repeated(fields, 12)),
        dport=ints.get(8, 0),
        freebind=freebind,
    )


def _address(family: int, words: Sequence[int]) -> str:
    # CRIU copies the address's bytes (network order) into u32 words as they lie in memory.
    raw = b"".join((w & 0xFFFFFFFF).to_bytes(4, "little") for w in words)
    if family == socket.AF_INET6:
        raw = raw.ljust(16, b"\0")[:16]
        v6 = ipaddress.IPv6Address(raw)
        return str(v6.ipv4_mapped or v6)
    return str(ipaddress.IPv4Address(raw.ljust(4, b"\0")[:4]))


def _binds(s: InetSocket) -> bool:
    """Whether CRIU binds `s` to its own address on restore (sk-inet.c inet_bind()): a
    listening or bound TCP or UDP socket not left to the TCP repair of its connection. An
    IPv6 one it binds with IP_FREEBIND (bound, listening on nothing): only one the job itself
    made so (an address that comes and goes) is let through."""
    if s.connected_tcp or not s.sport or s.proto not in _BOUND_PROTOS:
        return False
    if ipaddress.ip_address(s.src).is_unspecified:
        return False
    return not (s.family == socket.AF_INET6 and s.freebind)


def _local(family: int, address: str) -> bool:
    """Whether this node has `address` (what CRIU's bind needs): a bind to port 0 tells."""
    ip = ipaddress.ip_address(address)
    if ip.is_unspecified:
        return True
    fam = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    try:
        with socket.socket(fam, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError as e:
        return e.errno != errno.EADDRNOTAVAIL
    return True


def _locked() -> set[Conn]:
    """The connections CRIU's network lock holds in this node's firewall (as the job's socket
    sees them): those a dump on this very node left for their restore."""
    found: set[Conn] = set()
    try:
        lines = netlock.present()
    except (OSError, subprocess.SubprocessError):
        return found
    for line in lines:
        words = line.split()

        def value(*flags: str) -> str | None:
            for i, w in enumerate(words[:-1]):
                if w in flags:
                    return words[i + 1].split("/")[0]
            return None

        src, dst = value("-s", "--source"), value("-d", "--destination")
        sport, dport = value("--sport"), value("--dport")
        if not (src and dst and sport and dport and sport.isdigit() and dport.isdigit()):
            continue
        try:
            src, dst = str(ipaddress.ip_address(src)), str(ipaddress.ip_address(dst))
        except ValueError:
            continue
        if len(words) > 1 and words[1] == "INPUT":
            found.add((dst, int(dport), src, int(sport)))
        else:
            found.add((src, int(sport), dst, int(dport)))
    return found


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _count(n: int) -> str:
    return f"{n} TCP connection{'' if n == 1 else 's'}"


def _peers(closed: Sequence[InetSocket]) -> str:
    names = [_endpoint(s.dst, s.dport) for s in closed]
    shown = ", ".join(names[:_NAMED])
    return shown + (f" and {len(names) - _NAMED} more" if len(names) > _NAMED else "")


def _locals(closed: Sequence[InetSocket]) -> str:
    return ", ".join(sorted({s.src for s in closed}))
