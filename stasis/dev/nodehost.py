"""Hosts of a site standing in on one machine: each node a process that holds its own UTS, mount
and network namespaces for the node's life, which the node's services enter (`prefix`).

In a node, as on a real host, /tmp, /var/tmp, /dev/shm and /run are fresh tmpfs of its own (1777,
/run 755 with /run/lock 1777), its host name is its name, and it has an address of its own on a
private bridge (`Net`: 10.213.X.0/24, this machine is .254 on it), and the names of the nodes on
that network resolve there, as a site's DNS would make them (`Net.hosts_file`, bound on the
node's /etc/hosts: the machine's own entries and one line per node). What a real site shares stays
shared: the rest of the file system (home directories, installed software) and the paths given
as `shared` (a shared store, a test's scratch directory, this Python), bound back at their own
path where they lie under a private directory. A pathname unix socket on a shared path reaches
across nodes (its address is the file, not the network).

Used by the multi-node test harnesses (tests/nodes.py: the control plane's test nodes) and meant
for `stasis-dev local-cluster` and `stasis-dev local-node`: only root makes nodes.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stasis.dev import commands
from stasis.errors import StasisError
from stasis.poll import poll

# What every node has of its own, as on real hosts: (directory, mode of its fresh tmpfs).
PRIVATE_DIRS = (("/tmp", 0o1777), ("/var/tmp", 0o1777), ("/dev/shm", 0o1777), ("/run", 0o755))

_NET = "10.213"
HOST_OCTET = 254
# Outside every node's private directories, so that a node binds the same file as the others.
_HOSTS_DIR = Path("/var/lib/stasis-dev/hosts")


@dataclass(frozen=True)
class Net:
    """A private network of nodes: a bridge on this machine, which is .254 on it."""

    net_id: int  # the third octet; also names the bridge and the veths

    @property
    def bridge(self) -> str:
        return f"stsb{self.net_id}"

    @property
    def host_addr(self) -> str:
        return f"{_NET}.{self.net_id}.{HOST_OCTET}"

    def addr(self, index: int) -> str:
        return f"{_NET}.{self.net_id}.{index + 1}"

    def netns(self, node: str) -> str:
        return f"stasis-{self.net_id}-{node}"

    def netns_path(self, node: str) -> Path:
        return Path("/run/netns") / self.netns(node)

    def veth(self, index: int) -> str:
        return f"stsv{self.net_id}x{index + 1}"

    @property
    def bridge_mac(self) -> str:
        """A fixed (locally administered) address for the bridge: one left to the kernel
        changes as ports join (it takes the lowest of theirs), and a node that learnt the old
        one loses this machine (seen: a node's requests to the control plane timing out once a
        third node joined)."""
        return f"02:53:54:53:{self.net_id:02x}:fe"

    @property
    def hosts_file(self) -> Path:
        """The /etc/hosts of the nodes on this network: the machine's, and a line per node."""
        return _HOSTS_DIR / self.bridge


def claim_net(first: int, last: int) -> Net:
    """Make the bridge of a network no one on this machine uses, among ids first..last (the
    local Slurm clusters pick theirs from 20..219). Claimed by creating the bridge: two callers
    racing for one id, one gets "exists" and tries the next."""
    for net_id in range(first, last + 1):
        net = Net(net_id)
        if Path(f"/sys/class/net/{net.bridge}").exists():
            continue
        if commands.run(
            ["ip", "link", "add", net.bridge, "address", net.bridge_mac, "type", "bridge"],
            check=False,
        ).returncode:
            continue
        try:
            commands.run(["ip", "addr", "add", f"{net.host_addr}/24", "dev", net.bridge])
            commands.run(["ip", "link", "set", net.bridge, "up"])
            _new_hosts(net)
        except BaseException:
            release_net(net)
            raise
        return net
    raise StasisError(f"no free private network for nodes (ids {first}..{last} in use)")


def release_net(net: Net) -> None:
    commands.run(["ip", "link", "del", net.bridge], check=False)
    net.hosts_file.unlink(missing_ok=True)


def _new_hosts(net: Net) -> None:
    """A fresh hosts file for a network just made (one of an earlier network with its id, left
    by a run that was killed, would name nodes that are gone)."""
    _HOSTS_DIR.mkdir(parents=True, exist_ok=True)
    with open(net.hosts_file, "w") as f:
        f.write(Path("/etc/hosts").read_text())


def _publish(net: Net, holder: int, address: str) -> None:
    """Name the node held by `holder` (its host name) at `address` in `net`'s hosts file, and
    bind that file on the node's /etc/hosts (once). Written in place, under a lock: every node
    binds the same file and sees each line as it is added."""
    name = commands.run([*prefix(holder), "hostname"]).stdout.strip()
    _HOSTS_DIR.mkdir(parents=True, exist_ok=True)
    with open(net.hosts_file, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        lines = f.read().splitlines() or Path("/etc/hosts").read_text().splitlines()
        kept = [
            line
            for line in lines
            if not (line.split()[:1] == [address] or name in line.split()[1:])
        ]
        f.truncate(0)
        f.write("\n".join([*kept, f"{address} {name}"]) + "\n")
    mounts = Path(f"/proc/{holder}/mountinfo").read_text().splitlines()
    if not any(line.split()[4] == "/etc/hosts" for line in mounts):
        commands.run(
            [*prefix(holder, net=False), "mount", "--bind", str(net.hosts_file), "/etc/hosts"]
        )


# Run in a node's new namespaces, as the process that holds them for the node's life (`nsenter
# -t` enters them). Not kept as namespace files: on kernel 6.18, inside a mount namespace that is
# not the machine's first (a container, a test root), binding a mount namespace's file was
# refused (EINVAL) depending on which namespaces had been made before. argv[1]: JSON with the
# node's name, the pid file, the private dirs [[DIR, MODE]], the shared paths that must stay
# visible at their own path, each opened BEFORE the private tmpfs covers it and bound back from
# that descriptor (a path would resolve into the new tmpfs), and binds [[SOURCE, TARGET]] made
# last (a node's own directory at a path every node uses).
_SETUP = """\
import ctypes, json, os, sys
spec = json.loads(sys.argv[1])
pid_file = spec["pid_file"]
# Nothing of the caller's pipes kept (it waits for their end), errors into the .err file.
null = os.open("/dev/null", os.O_RDWR)
os.dup2(null, 0)
os.dup2(null, 1)
os.dup2(os.open(pid_file + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC = 2, 4, 4096, 16384

def mount(src, dst, fstype, flags, data):
    if libc.mount(src.encode(), dst.encode(), fstype.encode() if fstype else None, flags,
                  data.encode() if data else None) != 0:
        e = ctypes.get_errno()
        sys.exit(f"mount {src} on {dst}: {os.strerror(e)}")

def under(path, d):
    return path == d or path.startswith(d.rstrip("/") + "/")

shared = spec["shared"]
# A shared path under another shared path comes back with it.
shared = [p for p in shared if not any(q != p and under(p, q) for q in shared)]
for d, mode in spec["private"]:
    if not os.path.isdir(d):
        continue
    for p in shared:
        if under(d, p):
            sys.exit(f"{d} cannot be private to the node: it is in the shared {p}")
    kept = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in shared
            if under(p, d) and p != d and os.path.isdir(p)]
    mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "mode=%o" % mode)
    if d == "/run":  # what a booted Debian host has there (/var/lock points to it)
        os.mkdir("/run/lock")
        os.chmod("/run/lock", 0o1777)
    for p, fd in kept:
        os.makedirs(p, mode=0o755, exist_ok=True)
        mount("/proc/self/fd/%d" % fd, p, None, MS_BIND | MS_REC, None)
        os.close(fd)
if spec.get("hostname", True):
    with open("/proc/sys/kernel/hostname", "w") as f:
        f.write(spec["name"])
for src, dst in spec["binds"]:
    mount(src, dst, None, MS_BIND, None)
# A cgroup subtree of the node's own: joined first (a cgroup namespace's root is its maker's
# cgroup), then the hierarchies mounted afresh, their roots that subtree.
for procs in spec.get("cgroups", []):
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
if spec.get("cgroups") and libc.unshare(0x02000000) != 0:  # CLONE_NEWCGROUP
    sys.exit("unshare(CLONE_NEWCGROUP): " + os.strerror(ctypes.get_errno()))
for fstype, opts, target in spec.get("cgroup_mounts", []):
    os.makedirs(target, exist_ok=True)
    mount(fstype, target, fstype, MS_NOSUID | MS_NODEV | 8, opts)  # 8: MS_NOEXEC
with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(pid_file + ".tmp", pid_file)
os.dup2(null, 2)
os.execvp("sleep", ["sleep", "infinity"])
"""


def start_holder(
    name: str,
    pid_file: Path,
    shared: Sequence[str],
    *,
    binds: Sequence[tuple[str, str]] = (),
    net: bool = True,
    cgroups: Sequence[str] = (),
    cgroup_mounts: Sequence[tuple[str, str, str]] = (),
    host: bool = True,
) -> int:
    """Start the process that holds `name`'s UTS and mount namespaces (and, with `net`, a new
    network namespace with nothing but a loopback, down): its pid.

    `cgroups`: cgroup.procs files it joins before it makes a cgroup namespace of its own, in
    which it mounts `cgroup_mounts` (fstype, options, target), in order. `host=False`: only
    that, the machine's host name and directories kept (the mount namespace follows the
    machine's mounts), for services that are this machine but for their cgroups."""
    pid_file.unlink(missing_ok=True)
    spec = {
        "name": name,
        "pid_file": str(pid_file),
        "private": [[d, mode] for d, mode in PRIVATE_DIRS] if host else [],
        "shared": sorted(set(shared)),
        "binds": [list(b) for b in binds],
        "hostname": host,
        "cgroups": list(cgroups),
        "cgroup_mounts": [list(m) for m in cgroup_mounts],
    }
    commands.run(
        [
            "setsid",
            "--fork",
            "unshare",
            *(["--uts"] if host else []),
            "--mount",
            *(["--net"] if net else []),
            "--propagation",
            "private" if host else "slave",
            sys.executable,
            "-I",
            "-c",
            _SETUP,
            json.dumps(spec),
        ]
    )
    found = poll(lambda: pid_file.exists() and pid_file.read_text().strip(), 20, 0.02)
    if not found:
        err = Path(f"{pid_file}.err")
        why = err.read_text().strip() if err.exists() else "it did not start"
        raise StasisError(f"cannot make the namespaces of node {name}: {why}")
    return int(found)


def prefix(holder: int, *, net: bool = True, cgroup: bool = False, host: bool = True) -> list[str]:
    """How to run a command inside the node whose namespaces `holder` holds (`cgroup`: its
    cgroup namespace too; `host=False`: a holder of only a mount and a cgroup namespace)."""
    return [
        "nsenter",
        "-t",
        str(holder),
        *(["--uts"] if host else []),
        "--mount",
        *(["--net"] if net else []),
        *(["--cgroup"] if cgroup else []),
        "--",
    ]


def attach(net: Net, holder: int, index: int) -> str:
    """Give the node held by `holder` its address `index` on `net` (eth0, its end of a veth
    whose other end is on the bridge) and its loopback; the address."""
    veth = net.veth(index)
    commands.run(["ip", "link", "del", veth], check=False)  # one left by a node of an earlier run
    commands.run(
        ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(holder)]
    )
    return _configure(net, holder, index)


def _configure(net: Net, holder: int, index: int) -> str:
    inside = prefix(holder)
    commands.run(["ip", "link", "set", net.veth(index), "master", net.bridge, "up"])
    commands.run([*inside, "ip", "addr", "add", f"{net.addr(index)}/24", "dev", "eth0"])
    commands.run([*inside, "ip", "link", "set", "eth0", "up"])
    commands.run([*inside, "ip", "link", "set", "lo", "up"])
    _publish(net, holder, net.addr(index))
    return net.addr(index)


def join_net(net: Net, holder: int) -> str:
    """Give the node held by `holder` the first free address on `net`, a network that nodes
    made apart from each other join and leave (`leave_net`); the first makes its bridge. An
    address is claimed by creating its veth: two nodes racing, one gets "exists" and tries the
    next."""
    if not Path(f"/sys/class/net/{net.bridge}").exists():
        made = commands.run(
            ["ip", "link", "add", net.bridge, "address", net.bridge_mac, "type", "bridge"],
            check=False,
        )
        if made.returncode == 0:
            commands.run(["ip", "addr", "add", f"{net.host_addr}/24", "dev", net.bridge])
            commands.run(["ip", "link", "set", net.bridge, "up"])
            _new_hosts(net)
    for index in range(HOST_OCTET - 1):
        veth = net.veth(index)
        if Path(f"/sys/class/net/{veth}").exists():
            continue
        if commands.run(
            [
                "ip",
                "link",
                "add",
                veth,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                str(holder),
            ],
            check=False,
        ).returncode:
            continue
        return _configure(net, holder, index)
    raise StasisError(f"no free address on {net.bridge} ({HOST_OCTET - 1} nodes on it?)")


def leave_net(net: Net) -> None:
    """Remove `net`'s bridge once no node is on it (a node's veth goes with its namespace,
    which the kernel ends a moment after its last process)."""
    ports = Path(f"/sys/class/net/{net.bridge}/brif")
    if poll(lambda: not ports.exists() or not any(ports.iterdir()), 3, 0.05):
        if ports.exists():
            release_net(net)


def end_holder(holder: int) -> None:
    """End a node's holder. Its namespaces go with the last process in them (its veth too)."""
    try:
        os.kill(holder, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass(frozen=True)
class NodeHost:
    """One node on a private network."""

    name: str
    holder: int
    address: str

    def prefix(self) -> list[str]:
        return prefix(self.holder)

    def close(self) -> None:
        end_holder(self.holder)


def make_node(net: Net, index: int, name: str, state_dir: Path, shared: Sequence[str]) -> NodeHost:
    """A node `name` with its own namespaces and address `index` on `net`; its holder's pid
    file is kept in `state_dir`."""
    holder = start_holder(name, state_dir / f"{name}.holder", shared)
    try:
        address = attach(net, holder, index)
    except BaseException:
        end_holder(holder)
        raise
    return NodeHost(name, holder, address)
