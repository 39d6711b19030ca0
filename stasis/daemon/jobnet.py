"""A job's own network, which its parts take along when they move between nodes (issue 31).

Each part of a multi-node job (the ranks it has on one node) lives in a network namespace of the
job's on that node, with an address of the job's subnet. The namespace's eth0 is one end of a
veth whose other end is on a bridge of the job's on the node; on that bridge too is a VXLAN
device (the job's VNI, unicast over the nodes' own network) whose forwarding table names, for
every other node of the job, where the job's broadcasts go (an all-zero entry per peer node) and,
for every part there, where its MAC lives. Nothing is learnt: the daemons write every entry, so
a move is exact at once, not when a learnt entry ages out.

A part's MAC is made from its job address, so that the peers' ARP caches stay right across a
move; its namespace holds only what the daemon made (lo and eth0), so it can be made again on
any node, identical: CRIU leaves it out of the checkpoint and restores the tree into the new one
(stasis/engine/jobnetns.py), TCP connections between ranks repaired as they were.

A move of a part: `make_part` on the new node (same address), `set_peers` on every node of the
job with the new layout, `remove_part` on the old node. Every function acts on the node it runs
on; `on` is a command prefix reaching another one (tests: stasis/dev/nodehost.py's `prefix`).

What it costs: VXLAN's 50 bytes of header (the job's MTU is the node's less 50) and a bridge
and a veth on the way; measured against the node's own network in /work/shared/notes/mpi.md.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from stasis.daemon import partcgroup
from stasis.daemon.supervisorwire import JobNetSpec
from stasis.errors import StasisError, UsageError

VXLAN_PORT = 4789  # IANA's; every job shares it, told apart by its VNI
_OVERHEAD = 50  # outer Ethernet 14 + IPv4 20 + UDP 8 + VXLAN 8
_FLOOD = "00:00:00:00:00:00"
_VNI_MAX = (1 << 24) - 1
_TIMEOUT_S = 30
_NETNS_DIR = Path("/run/netns")  # where `ip netns` keeps a namespace's file
_NETNS_PREFIX = "stasis-job-"


class JobNetError(StasisError):
    """The node could not make or change a job's network."""


@dataclass(frozen=True)
class JobNet:
    """A job's network: its VXLAN id (unique among the jobs of the site) and its subnet."""

    vni: int
    subnet: ipaddress.IPv4Network

    def __post_init__(self) -> None:
        if not 1 <= self.vni <= _VNI_MAX:
            raise JobNetError(f"VXLAN id {self.vni} is out of range: use 1..{_VNI_MAX}")

    # Interface names hold 15 bytes: "sjb" + 8 digits at most.
    @property
    def netns(self) -> str:
        return f"{_NETNS_PREFIX}{self.vni}"

    @property
    def netns_path(self) -> Path:
        """The namespace's file on the node (what `ip netns` keeps; open it for a restore)."""
        return netns_path(self.vni)

    @property
    def bridge(self) -> str:
        return f"sjb{self.vni}"

    @property
    def vxlan(self) -> str:
        return f"sjx{self.vni}"

    @property
    def veth(self) -> str:
        """The node's end of the part's veth (the part's end is its eth0)."""
        return f"sjv{self.vni}"

    def address(self, index: int) -> ipaddress.IPv4Address:
        """The job address of its `index`th part (0-based), the same on whatever node."""
        hosts = self.subnet.num_addresses - 2
        if not 0 <= index < hosts:
            raise JobNetError(f"job subnet {self.subnet} has no address for part {index}")
        return self.subnet.network_address + 1 + index


@dataclass(frozen=True)
class Part:
    """One part of a job: its job address, and the node address (on the nodes' own network)
    that the VXLAN reaches it at."""

    address: ipaddress.IPv4Address
    node: ipaddress.IPv4Address

    @property
    def mac(self) -> str:
        """Locally administered, made from the job address: the same on any node."""
        return "02:4a:" + ":".join(f"{b:02x}" for b in self.address.packed)


def make_part(
    net: JobNet,
    part: Part,
    peers: Iterable[Part],
    *,
    underlay: str,
    on: Sequence[str] = (),
) -> Path:
    """Make `part`'s namespace on this node (eth0 with its job address, lo) joined to the job's
    bridge and VXLAN over this node's interface `underlay` (whose address is `part.node`), the
    forwarding table pointing at `peers`; the namespace's file. Anything of `net` left on the
    node (a part that was here before, a daemon killed midway) is replaced."""
    remove_part(net, on=on)
    mtu = _mtu(underlay, on) - _OVERHEAD
    ns = ["ip", "-n", net.netns]
    steps = [
        ["ip", "netns", "add", net.netns],
        ["ip", "link", "add", net.bridge, "mtu", str(mtu), "type", "bridge"],
        [
            "ip",
            "link",
            "add",
            net.vxlan,
            "mtu",
            str(mtu),
            "type",
            "vxlan",
            "id",
            str(net.vni),
            "local",
            str(part.node),
            "dev",
            underlay,
            "dstport",
            str(VXLAN_PORT),
            "nolearning",
        ],  # fmt: skip
        ["ip", "link", "set", net.vxlan, "master", net.bridge, "up"],
        [
            "ip",
            "link",
            "add",
            net.veth,
            "mtu",
            str(mtu),
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            net.netns,
        ],  # fmt: skip
        ["ip", "link", "set", net.veth, "master", net.bridge, "up"],
        ["ip", "link", "set", net.bridge, "up"],
        [*ns, "link", "set", "eth0", "address", part.mac, "mtu", str(mtu), "up"],
        [*ns, "addr", "add", f"{part.address}/{net.subnet.prefixlen}", "dev", "eth0"],
        [*ns, "link", "set", "lo", "up"],
    ]
    try:
        for argv in steps:
            _run(on, argv, f"make the network of job VNI {net.vni}")
        set_peers(net, part.node, peers, on=on)
    except BaseException:
        remove_part(net, on=on)
        raise
    return net.netns_path


def set_peers(
    net: JobNet, here: ipaddress.IPv4Address, parts: Iterable[Part], *, on: Sequence[str] = ()
) -> None:
    """Point this node's VXLAN of `net` at the job's `parts` (those on this node, `here`, are
    skipped): a broadcast entry per other node, a MAC entry per part there; entries for nodes
    and parts no longer in the job removed."""
    want: set[tuple[str, str]] = set()
    for p in parts:
        if p.node != here:
            want.add((_FLOOD, str(p.node)))
            want.add((p.mac, str(p.node)))
    have = forwarding(net, on=on)
    for mac, dst in sorted(have - want):
        _run(
            on,
            ["bridge", "fdb", "del", mac, "dev", net.vxlan, "dst", dst],
            f"take {dst} out of job VNI {net.vni}'s network",
        )
    for mac, dst in sorted(want - have):
        # A MAC has one place: `replace` moves it; the flood entries are a list: `append`.
        verb = "append" if mac == _FLOOD else "replace"
        _run(
            on,
            ["bridge", "fdb", verb, mac, "dev", net.vxlan, "dst", dst, "self", "permanent"],
            f"point job VNI {net.vni}'s network at {dst}",
        )


def remove_part(net: JobNet, *, on: Sequence[str] = ()) -> None:
    """Remove `net` from this node: the namespace (the veth's end in it goes with it), the
    veth, the VXLAN and the bridge. Nothing there: nothing done."""
    for argv in (
        ["ip", "netns", "del", net.netns],
        ["ip", "link", "del", net.veth],
        ["ip", "link", "del", net.vxlan],
        ["ip", "link", "del", net.bridge],
    ):
        subprocess.run(
            [*on, *argv],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_TIMEOUT_S,
            check=False,
        )


def forwarding(net: JobNet, *, on: Sequence[str] = ()) -> set[tuple[str, str]]:
    """This node's VXLAN forwarding table for `net`: (MAC, node address) pairs, the all-zero
    MAC for where broadcasts go."""
    out = _run(on, ["bridge", "-j", "fdb", "show", "dev", net.vxlan], "read the forwarding table")
    found: set[tuple[str, str]] = set()
    for entry in json.loads(out or "[]"):
        mac, dst = entry.get("mac"), entry.get("dst")
        if isinstance(mac, str) and isinstance(dst, str):
            found.add((mac, dst))
    return found


def vni_of(pid: int) -> int | None:
    """The VNI of the job network whose namespace on this node `pid` lives in (its tree is then
    dumped with the namespace external: DumpOptions.job_netns); None: none of them."""
    try:
        inode = os.stat(f"/proc/{pid}/ns/net").st_ino
        entries = list(os.scandir(_NETNS_DIR))
    except OSError:
        return None
    for entry in entries:
        number = entry.name.removeprefix(_NETNS_PREFIX)
        if entry.name.startswith(_NETNS_PREFIX) and number.isdigit():
            try:
                if entry.stat().st_ino == inode:
                    return int(number)
            except OSError:
                continue
    return None


def netns_path(vni: int) -> Path:
    """Where the namespace of job network `vni`'s part on this node is (whether or not made)."""
    return _NETNS_DIR / f"{_NETNS_PREFIX}{vni}"


def part_spec(vni: int, job_id: str, what: str) -> JobNetSpec:
    """What a job's supervisor needs to run or restore job `job_id` as a part of job network
    `vni` on this node: the namespace (which must be made already) and a cgroup of its own
    (made here). UsageError, one line, `what` first, when the network is not on this node."""
    path = netns_path(vni)
    if not path.exists():
        raise UsageError(
            f"{what}: job network {vni} is not set up on this node: make its part here first "
            f"(jobnet.make_part, which makes {path})"
        )
    return JobNetSpec(netns=str(path), cgroup=str(partcgroup.make(job_id)))


def part_address(vni: int, *, on: Sequence[str] = ()) -> ipaddress.IPv4Address | None:
    """The job address of the part of job network `vni` on this node (its eth0's); None: no
    such part here."""
    if not on and not netns_path(vni).exists():
        return None
    try:
        out = _run(
            on,
            ["ip", "-n", f"{_NETNS_PREFIX}{vni}", "-j", "-4", "addr", "show", "dev", "eth0"],
            f"read the address of job VNI {vni}'s part",
        )
    except JobNetError:
        return None
    for link in json.loads(out or "[]"):
        for addr in link.get("addr_info", []):
            if addr.get("family") == "inet":
                return ipaddress.IPv4Address(addr["local"])
    return None


# Why a job's network is held still (`hold`), each with a rule of its own in both directions,
# so that one's release leaves the other: a part frozen for a cut, and the parts of a cut being
# restored one after another (a restore releases the first, never the second, which its
# coordinator lets go once every part is back).
FROZEN = "stasis-part-held"
RESTORING = "stasis-restore-held"


def _hold_rule(why: str) -> list[str]:
    return ["-m", "comment", "--comment", why, "-j", "DROP"]


def hold(vni: int, *, on: Sequence[str] = (), why: str = FROZEN) -> None:
    """Drop every packet into and out of job network `vni`'s namespace on this node (its own
    firewall, nothing of the node's): while a part is frozen for a coordinated checkpoint, a
    peer's kernel must not hand it data after its dump (the peer would drop it as delivered,
    and no image would hold it), nor its kernel send a peer a reset when it is killed after
    it. TCP sends again what was dropped once the network is released (`release`). Held
    already (another part in the same namespace frozen first): left as it is, never released
    in between, which would let a peer's data reach that part."""
    for chain in ("INPUT", "OUTPUT"):
        held = subprocess.run(
            [*on, "nsenter", f"--net={netns_path(vni)}", "iptables", "-w", "-C", chain]
            + _hold_rule(why),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
        if held.returncode == 0:
            continue
        _run(
            on,
            [
                "nsenter",
                f"--net={netns_path(vni)}",
                "iptables",
                "-w",
                "-I",
                chain,
                *_hold_rule(why),
            ],  # fmt: skip
            f"hold job VNI {vni}'s network still",
        )


def release(vni: int, *, on: Sequence[str] = (), why: str = FROZEN) -> None:
    """Undo `hold` for `why` (nothing held: nothing done)."""
    for chain in ("INPUT", "OUTPUT"):
        for _ in range(8):  # one rule per `hold`; a few, should holds have piled up
            done = subprocess.run(
                [
                    *on,
                    "nsenter",
                    f"--net={netns_path(vni)}",
                    "iptables",
                    "-w",
                    "-D",
                    chain,
                    *_hold_rule(why),
                ],  # fmt: skip
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=_TIMEOUT_S,
                check=False,
            )
            if done.returncode:
                break


def _mtu(device: str, on: Sequence[str]) -> int:
    out = _run(on, ["ip", "-j", "link", "show", "dev", device], f"find the interface {device}")
    links = json.loads(out)
    return int(links[0]["mtu"])


def _run(on: Sequence[str], argv: Sequence[str], what: str) -> str:
    try:
        done = subprocess.run(
            [*on, *argv],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise JobNetError(f"cannot {what}: `{' '.join(argv)}` did not run: {e}") from e
    if done.returncode:
        why = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise JobNetError(f"cannot {what}: `{' '.join(argv)}` failed: {why[0]}")
    return done.stdout
