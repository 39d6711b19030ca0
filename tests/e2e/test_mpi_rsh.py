"""Open MPI across two nodes of the local cluster with every process a node daemon's part (issue 31;
stasis/slurm/rsh.py, stasis/slurm/parts.py): the batch script has its node's daemon start
`mpirun` through the launch agent (`stasis-rsh $SLURMD_NODENAME mpirun ...`), and mpirun starts
its daemon on the other node through the same agent (`plm=rsh`, `plm_rsh_agent`), so that no
process of the computation is slurmstepd's: every rank runs under the stasis daemon of its node,
in the job's network namespace there and a freezer cgroup of its own (what a cut freezes), with
its TCP on job addresses; the checksums are those of 4 ranks on one machine; the agent relays
mpirun's output and exit status as ssh would. The agent's refusals are one line each."""

from __future__ import annotations

import ipaddress
import json
import pwd
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis import wire
from stasis.client import Client
from stasis.slurm import jobnetnode
from stasis.slurm.parts import SWEEP_S
from tests.conftest import STASIS, TEST_USER
from tests.e2e.conftest import Cluster, close_cluster, multinode_cluster
from tests.e2e.test_mpi_jobnet import LEFT, PROBE
from tests.workloads.mpi_build import MPI, MPICH, MPIS, OPENMPI, build

ITERATIONS = 30
SLEEP_MS = 300
CLUSTER_NUMBER = 2
RSH = f"{sys.executable} -m stasis.slurm.rsh"

# Run on a node as root: the freezer cgroup and the uid of each of the reference program's
# processes there.
CGROUPS = """\
import json, os
uts = os.stat("/proc/self/ns/uts").st_ino
found = {}
for name in os.listdir("/proc"):
    try:
        if not name.isdigit() or not open(f"/proc/{name}/comm").read().startswith("mpi_stencil"):
            continue
        if os.stat(f"/proc/{name}/ns/uts").st_ino != uts:
            continue
        lines = open(f"/proc/{name}/cgroup").read().splitlines()
        uid = os.stat(f"/proc/{name}").st_uid
    except OSError:
        continue
    found[name] = {"uid": uid,
                   "freezer": [l.split(":", 2)[2] for l in lines if l.split(":")[1] == "freezer"]}
print(json.dumps(found))
"""


# Run on the batch node as root, as its daemon will: one cut over the job's part there (its own
# socket) and its part on the other node (that node's remote listener, root's munge credential).
COORDINATE = """\
import json, sys
from stasis.client import Client
from stasis.config import load_settings
from stasis.slurm import cut, remote, scontrol
from stasis.slurm.partclient import RemoteParts
job, here_part, other, other_part = sys.argv[1:5]
settings = load_settings()
there = RemoteParts(settings, remote.remote_node(settings, other, scontrol.node_address(other)), job)
parts = [cut.PartRef("n1", Client(settings.socket, timeout_s=120), here_part),
         cut.PartRef(other, there, other_part)]
taken = cut.take(parts, f"mpi-{job}", timeout_s=60)
print(json.dumps({"label": taken.label, "checkpoints": taken.checkpoints,
                  "stopped": taken.stopped, "unfinished": taken.unfinished}))
"""

# Run on the batch node as root: a checkpoint of the job's part on the other node deleted there
# (what an abandoned cut does).
DELETE = """\
import json, sys
from stasis.config import load_settings
from stasis.slurm import remote, scontrol
from stasis.slurm.partclient import RemoteParts
job, other, checkpoint = sys.argv[1:4]
settings = load_settings()
there = RemoteParts(settings, remote.remote_node(settings, other, scontrol.node_address(other)), job)
print(json.dumps(there.delete_checkpoint(checkpoint)))
"""

# Run on the batch node as the job's user: a cut's operation on the other node's part, refused.
AS_USER = """\
import sys
from stasis.config import load_settings
from stasis.errors import StasisError
from stasis.slurm import remote, scontrol
from stasis.slurm.partclient import RemoteParts
job, other, other_part = sys.argv[1:4]
settings = load_settings()
there = RemoteParts(settings, remote.remote_node(settings, other, scontrol.node_address(other)), job)
for ask in (lambda: there.freeze(other_part, timeout_s=5), there.listing,
            lambda: there.net(True), lambda: there.restore("20261207T000000Z-000000", other_part)):
    try:
        ask()
        print("DONE")
    except StasisError as e:
        print(type(e).__name__, e)
"""


def _iterations(text: str) -> list[str]:
    import re

    return re.findall(r"^iter \d+ checksum [0-9a-f]{16} max \S+$", text, re.M)


@pytest.fixture(scope="module")
def two() -> Iterator[Cluster]:
    c = multinode_cluster("mpirsh", CLUSTER_NUMBER)
    try:
        for name, text in (
            ("probe.py", PROBE),
            ("left.py", LEFT),
            ("cgroups.py", CGROUPS),
            ("coordinate.py", COORDINATE),
            ("as_user.py", AS_USER),
            ("delete.py", DELETE),
        ):
            (c.work / name).write_text(text)
        yield c
    finally:
        close_cluster(c)


@pytest.fixture(scope="module")
def binaries(two: Cluster) -> dict[str, Path]:
    return {mpi.name: build(mpi, two.work) for mpi in MPIS}


@pytest.fixture(scope="module")
def binary(binaries: dict[str, Path]) -> Path:
    return binaries[OPENMPI.name]


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


def _on(c: Cluster, node: str, script: str, *args: str) -> object:
    return json.loads(c.on(node, sys.executable, str(c.work / script), *args).stdout)


def _mpirun(c: Cluster, mpi: MPI, binary: Path) -> str:
    """mpirun as its node's part: its environment is the command line's (the agent passes none
    on, as ssh), its hosts the allocation's (it sees no SLURM_* variables there)."""
    env = {
        "STASIS_CONFIG": str(c.lay.config_of("n1")),
        "SLURM_CONF": str(c.lay.slurm_conf),
    }
    if mpi is OPENMPI:
        env |= dict(OPENMPI.env)
        # Open MPI 4 (Debian 12) launches through ORTE's rsh component; Open MPI 5 (Debian 13)
        # through PRRTE's, named ssh, whose variables it reads under PRTE_MCA_ (the OMPI_MCA_
        # ones are not passed on to it): each ignores the other's.
        env |= {
            "OMPI_MCA_plm": "rsh",
            "OMPI_MCA_plm_rsh_agent": RSH,
            "OMPI_MCA_plm_rsh_no_tree_spawn": "1",
            "PRTE_MCA_plm": "ssh",
            "PRTE_MCA_plm_ssh_agent": RSH,
            "PRTE_MCA_plm_ssh_no_tree_spawn": "1",
        }
        launch = ["-host", "n1:2,n2:2"]
    else:
        # TCP between nodes, as test_mpi_jobnet (the local cluster's nodes share one kernel).
        env |= {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}
        agent = c.work / "stasis-rsh"  # Hydra's -launcher-exec takes a program, no arguments
        agent.write_text(f'#!/bin/sh\nexec {RSH} "$@"\n')
        agent.chmod(0o755)
        launch = ["-launcher", "ssh", "-launcher-exec", str(agent), "-hosts", "n1:2,n2:2"]
        launch += ["-iface", "eth0"]
    words = [
        "env",
        *(f"{k}={v}" for k, v in env.items()),
        mpi.mpirun,
        *launch,
        "-np",
        "4",
        str(binary),
        str(ITERATIONS),
        str(SLEEP_MS),
    ]
    return " ".join(shlex.quote(w) for w in words)


@pytest.mark.parametrize("mpi", MPIS, ids=[m.name for m in MPIS])
def test_every_rank_a_daemon_part_in_the_job_network(
    two: Cluster, binaries: dict[str, Path], oracle: list[str], mpi: MPI
) -> None:
    expected = oracle
    name = f"{mpi.name}-rsh"
    script = two.script(
        name,
        f"export STASIS_CONFIG={shlex.quote(str(two.lay.config_of('n1')))}\n"
        f'{RSH} "$SLURMD_NODENAME" {shlex.quote(_mpirun(two, mpi, binaries[mpi.name]))}\n'
        'echo "agent exit $?"\n',
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
    seen = {node: _on(two, node, "probe.py") for node in ("n1", "n2")}
    cgroups = {node: _on(two, node, "cgroups.py") for node in ("n1", "n2")}
    parts = {node: json.loads(two.on(node, STASIS, "ps", "--json").stdout) for node in ("n1", "n2")}
    state = two.wait_state(job, ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), timeout_s=150)
    out = two.output(job)
    assert state == "COMPLETED", out
    assert out.count("ranks 4 hosts n1,n1,n2,n2\n") == 1, out
    assert _iterations(out) == expected, out
    assert out.endswith("agent exit 0\n"), out  # mpirun's exit status, relayed
    for node, ranks in seen.items():
        assert isinstance(ranks, list) and len(ranks) == 2, (node, ranks, out)
        for rank in ranks:
            assert rank["vni"] == vni, (node, rank)  # in the job's namespace on its node
        tcp = [ipaddress.IPv4Address(a) for r in ranks for a in r["tcp"]]
        assert tcp and all(a.is_loopback or a in subnet for a in tcp), (node, ranks, subnet)
        # A daemon's part: its freezer cgroup is the part's, not Slurm's; the job's user's.
        found = cgroups[node]
        assert isinstance(found, dict) and len(found) == 2, (node, found)
        assert {r["uid"] for r in found.values()} == {pwd.getpwnam(TEST_USER).pw_uid}, found
        # ... that of a part of that node's daemon labelled after the Slurm job (Hydra may
        # start its proxy on its own node through the agent too: a second part there).
        mine = {
            f"/stasis-part-{p['job']}"
            for p in parts[node]
            if p.get("label", "").startswith(f"slurm-{job}-part-")
        }
        assert mine, (node, parts[node])
        for r in found.values():
            assert len(r["freezer"]) == 1 and r["freezer"][0] in mine, (node, found, mine)
    for node in ("n1", "n2"):
        ended = json.loads(two.on(node, STASIS, "ps", "--json").stdout)
        assert all(p["state"] != "running" for p in ended), (node, ended)
        assert _on(two, node, "left.py", str(vni)) == [], node  # nothing left of the job


def test_the_agent_refuses_in_one_line(two: Cluster) -> None:
    env = {"STASIS_CONFIG": str(two.lay.config_of("n1"))}
    outside = two.on(
        "n1",
        "env",
        *(f"{k}={v}" for k, v in env.items()),
        *RSH.split(),
        "n2",
        "true",
        user=TEST_USER,
        check=False,
    )
    assert outside.returncode == 255
    assert outside.stderr.startswith("stasis-rsh: n2: no SLURM_JOB_ID here"), outside.stderr
    assert outside.stderr.count("\n") == 1, outside.stderr
    # A job that is not the caller's (nor running): refused by the node's daemon.
    other = two.on(
        "n1",
        "env",
        *(f"{k}={v}" for k, v in env.items()),
        "SLURM_JOB_ID=1",
        *RSH.split(),
        "n2",
        "true",
        user=TEST_USER,
        check=False,
    )
    assert other.returncode == 255, other.stderr
    assert other.stderr.startswith("stasis-rsh: n2: "), other.stderr
    assert other.stderr.count("\n") == 1, other.stderr


def test_a_cut_over_the_parts_leaves_the_job_running(
    two: Cluster, binary: Path, oracle: list[str]
) -> None:
    """stasis.slurm.cut.take over the two parts the agent had the daemons start (mpirun with its
    node's ranks, orted with the other's), coordinated from the batch node as root: its own part
    through its socket, the other node's through that node's remote listener (stasis.slurm.
    partclient). One consistent checkpoint of the running MPI job, both parts listed under one
    label, and the job goes on to the same checksums, each printed once. The job's own user
    may not freeze a part."""
    expected = oracle
    name = "openmpi-rsh-cut"
    script = two.script(
        name,
        f"export STASIS_CONFIG={shlex.quote(str(two.lay.config_of('n1')))}\n"
        f'{RSH} "$SLURMD_NODENAME" {shlex.quote(_mpirun(two, OPENMPI, binary))}\n'
        'echo "agent exit $?"\n',
        f"--output={two.work}/{name}-%j.out",
        "--export=ALL,STASIS_ENABLE=1",
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--time=3",
    )
    job = two.sbatch(script, user=TEST_USER)
    deadline = time.monotonic() + 150
    while len(_iterations(two.output(job))) < 5:
        assert two.state(job) in ("PENDING", "CONFIGURING", "RUNNING"), two.output(job)
        assert time.monotonic() < deadline, two.output(job)
        time.sleep(0.5)
    clients = {node: Client(two.lay.node_socket(node), timeout_s=120) for node in ("n1", "n2")}
    part = {}
    for node, client in clients.items():
        mine = [j for j in client.jobs() if j["label"].startswith(f"slurm-{job}-part-")]
        assert len(mine) == 1 and mine[0]["state"] == "running", (node, mine)
        # This node's by its daemon's job id, the other's by its key (the remote routes').
        part[node] = mine[0]["job"] if node == "n1" else mine[0]["label"].rsplit("-", 1)[1]
    refused = two.on(
        "n1", sys.executable, str(two.work / "as_user.py"), job, "n2", part["n2"], user=TEST_USER
    ).stdout
    # A cut's operations and a restore's are root's alone: freeze, list, hold the network,
    # restore.
    lines = refused.splitlines()
    assert len(lines) == 4, refused
    for line in lines[:2]:
        assert line.startswith(
            "PermissionDeniedError permission denied: only root (a cut's "
        ), refused
    for line in lines[2:4]:
        assert line.startswith(
            "PermissionDeniedError permission denied: only root (a restore's coordinator)"
        ), refused
    taken = _on(two, "n1", "coordinate.py", job, part["n1"], "n2", part["n2"])
    at = len(_iterations(two.output(job)))
    assert isinstance(taken, dict), taken
    assert not taken["stopped"] and taken["unfinished"] == "", taken
    assert set(taken["checkpoints"]) == {"n1", "n2"}, taken
    listed = clients["n1"].checkpoints(label=taken["label"], user=TEST_USER)  # the job user's
    assert {m["id"] for m in listed} == set(taken["checkpoints"].values())
    gone = taken["checkpoints"]["n2"]
    assert _on(two, "n1", "delete.py", job, "n2", gone) == {"deleted": gone}
    listed = clients["n1"].checkpoints(label=taken["label"], user=TEST_USER)
    assert {m["id"] for m in listed} == {taken["checkpoints"]["n1"]}
    state = two.wait_state(job, ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), timeout_s=150)
    out = two.output(job)
    assert state == "COMPLETED", out
    assert at < ITERATIONS, (at, out)  # the cut was taken while it ran
    assert _iterations(out) == expected, out
    assert out.endswith("agent exit 0\n"), out
    for client in clients.values():
        client.close()


def test_no_part_outlives_its_job(two: Cluster) -> None:
    """scancel: Slurm ends the agents (seen: without a signal they could pass on) and the job;
    its parts on the other node, one of which ignores SIGTERM, are killed by that node's daemon
    once the job no longer runs there (stasis.slurm.parts.sweep)."""
    config = shlex.quote(str(two.lay.config_of("n1")))
    script = two.script(
        "parts-cancelled",
        f"export STASIS_CONFIG={config}\n"
        f"{RSH} n2 'trap \"\" TERM; echo deaf; sleep 600' &\n"
        f"{RSH} n2 'echo plain; sleep 600' &\n"
        "wait\n",
        f"--output={two.work}/parts-cancelled-%j.out",
        "--export=ALL,STASIS_ENABLE=1",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--time=3",
    )
    job = two.sbatch(script, user=TEST_USER)
    n2 = Client(two.lay.node_socket("n2"), timeout_s=60)

    def parts() -> dict[str, wire.Job]:
        found = [j for j in n2.jobs() if j["label"].startswith(f"slurm-{job}-part-")]
        return {"deaf" if "deaf" in " ".join(j["command"]) else "plain": j for j in found}

    deadline = time.monotonic() + 120
    while not (two.output(job).count("deaf") and two.output(job).count("plain")):
        assert two.state(job) in ("PENDING", "CONFIGURING", "RUNNING"), two.output(job)
        assert time.monotonic() < deadline, two.output(job)
        time.sleep(0.5)
    assert {k: j["state"] for k, j in parts().items()} == {"deaf": "running", "plain": "running"}
    two.run("scancel", job)
    cancelled = time.monotonic()
    while any(j["state"] == "running" for j in parts().values()):
        # Slurm's KillWait (5 s here), then the daemon's next sweep.
        assert time.monotonic() - cancelled < 5 + 2 * SWEEP_S + 15, parts()
        time.sleep(0.5)
    assert two.wait_state(job, ("CANCELLED",), timeout_s=30) == "CANCELLED"
    n2.close()


def test_a_signal_to_the_agent_reaches_its_part(two: Cluster) -> None:
    """SIGTERM to the agent is passed on to its part, which ends of it; the agent's exit status
    is then the part's, as ssh's."""
    config = shlex.quote(str(two.lay.config_of("n1")))
    script = two.script(
        "agent-signalled",
        f"export STASIS_CONFIG={config}\n"
        f"{RSH} n2 'echo plain; exec sleep 600' &\n"
        "agent=$!\n"
        "sleep 4\n"
        'kill -TERM "$agent"\n'
        'wait "$agent"\n'
        'echo "agent exit $?"\n',
        f"--output={two.work}/agent-signalled-%j.out",
        "--export=ALL,STASIS_ENABLE=1",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--time=3",
    )
    job = two.sbatch(script, user=TEST_USER)
    state = two.wait_state(job, ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), timeout_s=60)
    out = two.output(job)
    assert state == "COMPLETED", out
    assert out.endswith("agent exit 143\n"), out  # 128 + SIGTERM, the part's end
