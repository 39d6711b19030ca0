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
one node have different subnets unless their ids are a multiple of 16384 apart (refused then:
the second job's tasks run in the node's network, with a warning in the node's log).

A job's tasks must still reach Slurm (srun inside the batch step talks to slurmctld and to the
other nodes' slurmd, which call it back): each node's bridge has an address of the job's subnet
(the gateway of the part there, counted down from the subnet's top: node i has .254 - i), the
node forwards between the job and its own network, and the job's traffic to anything but its
own nodes is masqueraded behind the node's address. Traffic between the job and its nodes'
slurmd/slurmstepd is routed, not translated: they see the job address and answer it through
their own bridge, over the VXLAN, so their callbacks to srun reach it.

Failures never fail the prolog (Slurm would drain the node): the job's tasks then run in the
node's own network, and the reason is on stdout, which the plugin puts into slurmd's log.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from stasis.config import load_settings
from stasis.daemon import jobnet
from stasis.errors import StasisError
from stasis.slurm import scontrol

VNI_BITS = 20  # a cluster's block: 2^20 VNIs, one per job id modulo that
_POOL = ipaddress.IPv4Network("100.64.0.0/10")
_SLOTS = _POOL.num_addresses // 256
RECORDS = Path("/run/stasis-jobnet")  # <job id> -> its VNI, read by the SPANK plugin
_TIMEOUT_S = 30


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


def prolog(job_id: str, node: str) -> str:
    """Make this node's part of job `job_id`'s network if it needs one; what was done."""
    settings = load_settings()
    if not settings.slurm_multinode:
        return ""
    info = scontrol.parse_record(scontrol.scontrol("show", "job", "-o", job_id).splitlines()[0])
    if "stasis-token=" not in info.get("AdminComment", "") or int(info.get("NumNodes", "1")) < 2:
        return ""
    nodes = scontrol.scontrol("show", "hostnames", info["NodeList"]).split()
    if node not in nodes:
        raise StasisError(f"this node ({node}) is not in job {job_id}'s nodes {nodes}")
    vni = vni_of_job(int(job_id), settings.slurm_multinode)
    net = jobnet.JobNet(vni, subnet_of(vni))
    if _subnet_taken(net.subnet, net.bridge):
        raise StasisError(f"subnet {net.subnet} of job network {vni} is another job's on this node")
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
        _sh(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"], "let the node forward")
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


def _remove(vni: int, job_id: str) -> None:
    for rule in _nat_rules(vni):
        _sh(["iptables", "-w", "-t", "nat", "-D", *rule], "remove a NAT rule", check=False)
    jobnet.remove_part(jobnet.JobNet(vni, subnet_of(vni)))
    try:
        (RECORDS / job_id).unlink()
    except FileNotFoundError:
        pass


def epilog(job_id: str) -> str:
    """Remove job `job_id`'s network from this node (nothing there: nothing done)."""
    try:
        vni = int((RECORDS / job_id).read_text())
    except (OSError, ValueError):
        settings = load_settings()
        if not settings.slurm_multinode:
            return ""
        vni = vni_of_job(int(job_id), settings.slurm_multinode)
    if not jobnet.netns_path(vni).exists() and not _nat_rules(vni):
        (RECORDS / job_id).unlink(missing_ok=True)
        return ""
    _remove(vni, job_id)
    return f"job network {vni} removed"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stasis.slurm.jobnetnode")
    p.add_argument("what", choices=("prolog", "epilog"))
    p.add_argument("--job-id", required=True)
    p.add_argument("--node", default="")
    args = p.parse_args(argv)
    os.umask(0o022)
    try:
        scontrol.validate_slurm_job_id(args.job_id)
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
