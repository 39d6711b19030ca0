"""A multi-node Slurm job's own network on one node: made at the job's start there, gone at its end.

    python -I -m stasis.slurm.jobnetnode prolog --job-id N --node NAME
    python -I -m stasis.slurm.jobnetnode epilog --job-id N

The SPANK plugin runs this as root from slurmd's job prolog and epilog (its job_prolog and
job_epilog callbacks: every node of the allocation, before the job's first task there and after
its last; no Prolog= line in slurm.conf is needed). For an opted-in job (its AdminComment has the
stasis-token job_submit.lua gives it) on several nodes, with `slurm_multinode` set, the prolog
makes the node's part of the job's network (stasis/daemon/jobnet.py): the namespace
`stasis-job-<VNI>` with the job address of the node's place in the allocation, its VXLAN's
forwarding table pointing at every other node of the allocation, and writes the VNI to
`/run/stasis-jobnet/<job id>`, where the plugin's task_init_privileged finds it and moves every
task of the job on this node (the batch step's and every srun step's) into that namespace before
it execs. The epilog removes all of it (namespace, veth, VXLAN, bridge, routes, NAT rules, the
file), whatever the prolog got to.

The job's identity: VNI = slurm_multinode << 20 | job id mod 2^20 (unique among the running jobs
of the site while each cluster has its own number and its running jobs' ids are less than 2^20
apart: Slurm gives ids in order); subnet = a /24 of 100.64.0.0/10 (the shared address space,
which a cluster's own networks seldom use) chosen by the VNI's low 14 bits, so that two jobs on
one node have different subnets unless their ids are a multiple of 16384 apart. A job whose
subnet or VNI is already a running job's on the node (its ids a multiple of 16384, or of 2^20,
apart: a user can get such an id by submitting that many jobs) is refused there: its tasks run in
the node's network, with a warning in the node's log, never in the other job's namespace, and its
epilog leaves the other job's network alone.

A job's tasks must still reach Slurm (srun inside the batch step talks to slurmctld and to the
other nodes' slurmd, which call it back): each node's bridge has an address of the job's subnet
(the gateway of the part there, counted down from the subnet's top: node i has .254 - i), the
node forwards between the job and its own network, and the job's traffic to anything but its
own nodes is masqueraded behind the node's address. Traffic between the job and its nodes'
slurmd/slurmstepd is routed, not translated: they see the job address and answer it through
their own bridge, over the VXLAN, so their callbacks to srun reach it.

The node forwards (net.ipv4.ip_forward=1) while it has a job network: the value it had before
the first one is recorded (`/run/stasis-jobnet/ip_forward`) and put back when the last one is
removed. Prologs and epilogs of several jobs run at once on a node: each holds the records
directory's lock (flock on the directory itself, so that no file of it outlives the last job)
while it reads and changes the node's job networks.

Failures never fail the prolog (Slurm would drain the node): the job's tasks then run in the
node's own network, and the reason is on stdout, which the plugin puts into slurmd's log.
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stasis.config import load_settings
from stasis.daemon import jobnet
from stasis.errors import SlurmJobNotFoundError, StasisError
from stasis.slurm import scontrol

VNI_BITS = 20  # a cluster's block: 2^20 VNIs, one per job id modulo that
_POOL = ipaddress.IPv4Network("100.64.0.0/10")
_SLOTS = _POOL.num_addresses // 256
RECORDS = Path("/run/stasis-jobnet")  # <job id> -> its VNI, read by the SPANK plugin
FORWARD = RECORDS / "ip_forward"  # the node's net.ipv4.ip_forward before its first job network
_FORWARD_SYSCTL = Path("/proc/sys/net/ipv4/ip_forward")
_TIMEOUT_S = 30
_LOCK_WAIT_S = 120  # for the other jobs' prologs and epilogs on this node
# Slurm's states of a job that no longer holds its nodes (a record of it is left over).
_GONE = frozenset(
    (
        "PENDING",
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    )
)


def vni_of_job(job_id: int, cluster: int) -> int:
    """The VXLAN id of job `job_id` of the cluster numbered `cluster` (slurm_multinode)."""
    if not 1 <= cluster <= 15:
        raise StasisError(f"slurm_multinode {cluster} is not a cluster number from 1 to 15")
    return cluster << VNI_BITS | job_id % (1 << VNI_BITS)


def subnet_of(vni: int) -> ipaddress.IPv4Network:
    """The job subnet of job network `vni` (a /24 of 100.64.0.0/10)."""
    base = int(_POOL.network_address) + (vni % _SLOTS) * 256
    return ipaddress.IPv4Network((base, 24))


def gateway(net: jobnet.JobNet, index: int) -> ipaddress.IPv4Address:
    """The address node `index` of the allocation has on the job's subnet (its bridge's)."""
    return net.subnet.broadcast_address - 1 - index


def _sh(argv: list[str], what: str, check: bool = True) -> str:
    done = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )
    if check and done.returncode:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise StasisError(f"cannot {what}: `{' '.join(argv)}` failed: {why}")
    return done.stdout


def _address(node: str) -> ipaddress.IPv4Address:
    addr = scontrol.node_address(node)
    try:
        return ipaddress.IPv4Address(addr)
    except ValueError:
        return ipaddress.IPv4Address(socket.gethostbyname(addr))


def _device_of(addr: ipaddress.IPv4Address) -> str:
    """The interface of this node that holds `addr` (the VXLAN's underlay)."""
    for link in json.loads(_sh(["ip", "-j", "-4", "addr", "show"], "list addresses") or "[]"):
        for a in link.get("addr_info", []):
            if a.get("local") == str(addr):
                return str(link["ifname"])
    raise StasisError(f"no interface of this node has its Slurm address {addr}")


def _nat_rules(vni: int) -> list[list[str]]:
    """This node's NAT rules of job network `vni` (as `iptables -S` prints them)."""
    out = _sh(["iptables", "-w", "-t", "nat", "-S", "POSTROUTING"], "read NAT rules", check=False)
    tag = f"stasis-job-{vni}"
    return [line.split()[1:] for line in out.splitlines() if tag in line.split()]


def _subnet_taken(subnet: ipaddress.IPv4Network, mine: str) -> bool:
    out = _sh(["ip", "-j", "-4", "route", "show", str(subnet)], "read routes", check=False)
    return any(r.get("dev") != mine for r in json.loads(out or "[]"))


@contextmanager
def _locked() -> Iterator[None]:
    """This node's job networks to this prolog or epilog alone until it is done."""
    RECORDS.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(RECORDS, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StasisError(
                        f"{RECORDS} stayed locked {_LOCK_WAIT_S} s by another job's prolog or "
                        "epilog on this node"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # the lock goes with it


def _records() -> dict[str, int]:
    """Job id -> VNI of every job network this node's prologs recorded."""
    found: dict[str, int] = {}
    try:
        names = os.listdir(RECORDS)
    except FileNotFoundError:
        return found
    for name in names:
        if name.isdigit():
            try:
                found[name] = int((RECORDS / name).read_text())
            except (OSError, ValueError):
                continue
    return found


def _holder(vni: int, job_id: str) -> str | None:
    """Another job whose network on this node is `vni`, still holding it; records of jobs that
    no longer hold this node are dropped (their network is replaced)."""
    for other, theirs in sorted(_records().items()):
        if other == job_id or theirs != vni:
            continue
        try:
            state = scontrol.job_info(other).state
        except SlurmJobNotFoundError:
            state = "COMPLETED"
        if state not in _GONE:
            return other
        (RECORDS / other).unlink(missing_ok=True)
    return None


def _job_nodes(job_id: str) -> list[str]:
    """The job's nodes, from squeue's numeric job id and node list (no user writes either)."""
    out = _sh(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%A %N"], "ask for the job's nodes")
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == job_id:
            return scontrol.scontrol("show", "hostnames", fields[1]).split()
    raise StasisError(f"squeue lists no nodes of job {job_id}")


def _forward() -> None:
    """Let the node forward, its value before the first job network recorded."""
    if not FORWARD.exists():
        before = _FORWARD_SYSCTL.read_text().strip()
        if before not in ("0", "1"):
            raise StasisError(f"{_FORWARD_SYSCTL} reads {before!r}, not 0 or 1")
        partial = FORWARD.with_name(".ip_forward.new")
        partial.write_text(f"{before}\n")
        partial.replace(FORWARD)
    _sh(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"], "let the node forward")


def _forward_back() -> str:
    """The node's forwarding as before its first job network once it has none; what was done."""
    if _records():
        return ""
    try:
        before = FORWARD.read_text().strip()
    except FileNotFoundError:
        return ""
    if before in ("0", "1"):
        _sh(["sysctl", "-q", "-w", f"net.ipv4.ip_forward={before}"], "put forwarding back")
    FORWARD.unlink()
    return f"; the node's net.ipv4.ip_forward put back to {before}"


def prolog(job_id: str, node: str) -> str:
    """Make this node's part of job `job_id`'s network if it needs one; what was done."""
    settings = load_settings()
    if not settings.slurm_multinode:
        return ""
    # job_info refuses a record whose name or paths forge fields (AdminComment, NodeList).
    if not scontrol.job_info(job_id).token:
        return ""
    nodes = _job_nodes(job_id)
    if len(nodes) < 2:
        return ""
    if node not in nodes:
        raise StasisError(f"this node ({node}) is not in job {job_id}'s nodes {nodes}")
    vni = vni_of_job(int(job_id), settings.slurm_multinode)
    net = jobnet.JobNet(vni, subnet_of(vni))
    holder = _holder(vni, job_id)
    if holder is not None:
        raise StasisError(
            f"job network {vni} is running job {holder}'s on this node (their ids are a "
            f"multiple of 2^{VNI_BITS} apart)"
        )
    if _subnet_taken(net.subnet, net.bridge):
        raise StasisError(
            f"subnet {net.subnet} of job network {vni} is another running job's subnet there "
            f"(their ids are a multiple of {_SLOTS} apart)"
        )
    addrs = [_address(n) for n in nodes]
    index = nodes.index(node)
    parts = [jobnet.Part(net.address(i), a) for i, a in enumerate(addrs)]
    here = parts[index]
    jobnet.make_part(net, here, parts, underlay=_device_of(here.node))
    try:
        gw = gateway(net, index)
        _sh(
            ["ip", "addr", "add", f"{gw}/{net.subnet.prefixlen}", "dev", net.bridge],
            "address the job's bridge",
        )
        _sh(["ip", "-n", net.netns, "route", "add", "default", "via", str(gw)], "route the job")
        _forward()
        tag = ["-m", "comment", "--comment", f"stasis-job-{vni}"]
        rules = [["-s", str(net.subnet), "-d", str(a), *tag, "-j", "RETURN"] for a in addrs]
        rules.append(["-s", str(net.subnet), "!", "-d", str(net.subnet), *tag, "-j", "MASQUERADE"])
        for rule in rules:
            _sh(["iptables", "-w", "-t", "nat", "-A", "POSTROUTING", *rule], "masquerade the job")
        RECORDS.mkdir(mode=0o700, exist_ok=True)
        (RECORDS / job_id).write_text(f"{vni}\n")
    except BaseException:
        _remove(vni, job_id)
        raise
    return f"job network {vni} ({net.subnet}) made: part {here.address} on {node}"


def _remove(vni: int, job_id: str) -> str:
    for rule in _nat_rules(vni):
        _sh(["iptables", "-w", "-t", "nat", "-D", *rule], "remove a NAT rule", check=False)
    jobnet.remove_part(jobnet.JobNet(vni, subnet_of(vni)))
    (RECORDS / job_id).unlink(missing_ok=True)
    return _forward_back()


def epilog(job_id: str) -> str:
    """Remove job `job_id`'s network from this node (nothing there: nothing done)."""
    records = _records()
    if job_id in records:
        vni = records[job_id]
    else:
        (RECORDS / job_id).unlink(missing_ok=True)  # unreadable: what its prolog got to
        settings = load_settings()
        if not settings.slurm_multinode:
            return _forward_back().removeprefix("; ")
        vni = vni_of_job(int(job_id), settings.slurm_multinode)
        if vni in records.values():
            # Its prolog was refused there: that network is the running job's that has it.
            return _forward_back().removeprefix("; ")
    if not jobnet.netns_path(vni).exists() and not _nat_rules(vni):
        (RECORDS / job_id).unlink(missing_ok=True)
        return _forward_back().removeprefix("; ")
    return f"job network {vni} removed{_remove(vni, job_id)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stasis.slurm.jobnetnode")
    p.add_argument("what", choices=("prolog", "epilog"))
    p.add_argument("--job-id", required=True)
    p.add_argument("--node", default="")
    args = p.parse_args(argv)
    os.umask(0o022)
    try:
        scontrol.validate_slurm_job_id(args.job_id)
        with _locked():
            said = prolog(args.job_id, args.node) if args.what == "prolog" else epilog(args.job_id)
    except (StasisError, OSError, subprocess.SubprocessError, KeyError, ValueError) as e:
        then = (
            "its tasks on this node run in the node's own network"
            if args.what == "prolog"
            else "what is left of it stays until the next epilog or prolog of that job id"
        )
        print(f"stasis: job {args.job_id}'s network ({args.what}): {e}; {then}", flush=True)
        return 1
    if said:
        print(f"stasis: {said}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
