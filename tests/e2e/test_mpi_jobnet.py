"""The reference MPI program across two nodes of the local cluster as an opted-in stasis job, every
task inside the job's own network (issue 31; stasis/slurm/jobnetnode.py, the SPANK plugin's
job_prolog/job_epilog and setns in task_init_privileged): with `slurm_multinode` set, the job
runs on 2 nodes, each node's ranks in the namespace of the job's VXLAN (jobnet.vni_of) with
their TCP connections on job addresses, and prints the same checksums as 4 ranks on one machine;
after it, no namespace, bridge, VXLAN, veth, NAT rule or record of it is left on any node.
Without the setting such a job is refused at submission, saying so (test_slurm_nodes)."""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.slurm import jobnetnode
from tests.conftest import TEST_USER
from tests.e2e.conftest import Cluster, close_cluster, multinode_cluster
from tests.workloads.mpi_build import MPI, MPICH, MPIS, build

ITERATIONS = 30
SLEEP_MS = 400  # long enough to look at the ranks while they run
CLUSTER_NUMBER = 1
_ITER = re.compile(r"^iter (\d+) checksum [0-9a-f]{16} max \S+$", re.M)

# Run on a node as root: the reference program's processes there (the nodes share the machine's
# PID namespace: a node's own are those in its UTS namespace), the VNI of the job network each
# is in, and the local addresses of its established TCP connections (its own netns's view).
PROBE = """\
import ipaddress, json, os, sys
from stasis.daemon import jobnet
found = []
uts = os.stat("/proc/self/ns/uts").st_ino
for name in os.listdir("/proc"):
    if not name.isdigit():
        continue
    pid = int(name)
    try:
        if not open(f"/proc/{pid}/comm").read().startswith("mpi_stencil"):
            continue
        if os.stat(f"/proc/{pid}/ns/uts").st_ino != uts:
            continue
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                  if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
        table = [line.split() for v in ("tcp", "tcp6")
                 for line in open(f"/proc/{pid}/net/{v}").read().splitlines()[1:]]
    except OSError:
        continue
    local = []
    for f in table:
        if f[9] in inodes and f[3] == "01":
            raw = bytes.fromhex(f[1].split(":")[0])
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = ipaddress.ip_address(raw)
            local.append(str(getattr(addr, "ipv4_mapped", None) or addr))
    found.append({"pid": pid, "vni": jobnet.vni_of(pid), "tcp": local})
print(json.dumps(found))
"""

# Run on a node as root: what of job network VNI is left there.
LEFT = """\
import json, subprocess, sys, os
vni = sys.argv[1]
def out(*a):
    return subprocess.run(a, capture_output=True, text=True).stdout
left = [l for l in out("ip", "netns", "list").split() if l == f"stasis-job-{vni}"]
left += [l.split(":")[1].strip().split("@")[0] for l in out("ip", "-o", "link").splitlines()
         if l.split(":")[1].strip().split("@")[0] in (f"sjb{vni}", f"sjx{vni}", f"sjv{vni}")]
left += [l for l in out("iptables", "-w", "-t", "nat", "-S").splitlines() if f"stasis-job-{vni}" in l]
left += [f for f in (os.listdir("/run/stasis-jobnet") if os.path.isdir("/run/stasis-jobnet") else [])]
print(json.dumps(left))
"""


def _iterations(text: str) -> list[str]:
    return [m.group(0) for m in _ITER.finditer(text)]


@pytest.fixture(scope="module")
def two() -> Iterator[Cluster]:
    c = multinode_cluster("mpinet", CLUSTER_NUMBER)
    try:
        (c.work / "probe.py").write_text(PROBE)
        (c.work / "left.py").write_text(LEFT)
        yield c
    finally:
        close_cluster(c)


@pytest.fixture(scope="module")
def binaries(two: Cluster) -> dict[str, Path]:
    return {mpi.name: build(mpi, two.work) for mpi in MPIS}


@pytest.fixture(scope="module")
def oracle(binaries: dict[str, Path]) -> list[str]:
    """4 ranks on this one machine, no job network: the lines every run must print."""
    out = subprocess.run(
        [MPICH.mpirun, "-np", "4", str(binaries[MPICH.name]), str(ITERATIONS), "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    lines = _iterations(out.stdout)
    assert len(lines) == ITERATIONS
    return lines


def _exports(mpi: MPI) -> str:
    # The local cluster's nodes share one kernel: UCX finds its SysV/CMA shared memory working
    # between ranks of different "nodes" and never opens a TCP connection (seen); without sm it
    # must carry everything over TCP, as between real machines.
    tcp_only = "export UCX_TLS=tcp,self\n" if mpi is MPICH else ""
    return mpi.exports() + tcp_only


def _launch(mpi: MPI, binary: Path) -> str:
    if mpi is MPICH:
        return f"srun --mpi={mpi.srun_mpi} {binary} {ITERATIONS} {SLEEP_MS}"
    return " ".join([mpi.mpirun, *mpi.mpirun_args, str(binary), str(ITERATIONS), str(SLEEP_MS)])


def _on(c: Cluster, node: str, script: str, *args: str) -> object:
    return json.loads(c.on(node, sys.executable, str(c.work / script), *args).stdout)


@pytest.mark.parametrize(
    "mpi", MPIS, ids=[f"{m.name}-{'srun' if m is MPICH else 'mpirun'}" for m in MPIS]
)
def test_ranks_in_the_job_network(
    two: Cluster, binaries: dict[str, Path], oracle: list[str], mpi: MPI
) -> None:
    name = f"{mpi.name}-net"
    script = two.script(
        name,
        _exports(mpi) + _launch(mpi, binaries[mpi.name]),
        f"--output={two.work}/{name}-%j.out",
        "--export=ALL,STASIS_ENABLE=1",
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--time=3",
    )
    job = two.sbatch(script, user=TEST_USER)
    vni = jobnetnode.vni_of_job(int(job), CLUSTER_NUMBER)
    subnet = jobnetnode.subnet_of(vni)
    deadline = time.monotonic() + 150
    while len(_iterations(two.output(job))) < 3:
        assert two.state(job) in ("PENDING", "CONFIGURING", "RUNNING"), two.output(job)
        assert time.monotonic() < deadline, two.output(job)
        time.sleep(0.5)
    seen: dict[str, list[dict[str, object]]] = {}
    for node in ("n1", "n2"):
        ranks = _on(two, node, "probe.py")
        assert isinstance(ranks, list)
        seen[node] = ranks
    state = two.wait_state(job, ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), timeout_s=150)
    out = two.output(job)
    assert state == "COMPLETED", out
    assert out.count("ranks 4 hosts n1,n1,n2,n2\n") == 1, out
    assert _iterations(out) == oracle, out
    for node, ranks in seen.items():
        assert len(ranks) == 2, (node, ranks, out)  # two ranks per node, both seen
        for rank in ranks:
            assert rank["vni"] == vni, (node, rank)  # in the job's namespace on its node
        tcp = [ipaddress.IPv4Address(a) for r in ranks for a in r["tcp"]]  # type: ignore[attr-defined]
        outside = [a for a in tcp if not a.is_loopback and a not in subnet]
        assert tcp and not outside, (node, ranks, subnet)  # MPI's TCP on job addresses
    for node in ("n1", "n2"):
        assert _on(two, node, "left.py", str(vni)) == [], node  # nothing left of the job
