"""Users against the job networks of multi-node jobs (issue 31; stasis/slurm/jobnetnode.py, the SPANK
plugin's setns, stasis/slurm/rsh.py and stasis/slurm/parts.py), on a local 2-node cluster with
`slurm_multinode` set, through the entry points a user has: `stasis-rsh`, nsenter and setns from
a shell and from inside their own job, and the job ids Slurm gives them.

- Another local user naming a running job of the test user in SLURM_JOB_ID gets from
  `stasis-rsh` one line and exit status 255; no part of that job is started on any node.
- A user cannot enter another job's network namespace (by its /run/netns file or a task's
  /proc/PID/ns/net), from their shell, from a user namespace of their own or from a task of their
  own job; a task of a job sees lo and eth0 with its job address only, not the node's interfaces.
- A job whose id is a multiple of 16384 (the subnet) or of 2^20 (the VNI) apart from a running
  job's, which a user gets by submitting that many jobs (here slurmctld's FirstJobId skips them),
  is refused its network on the nodes: its tasks run in the node's network, never in the running
  job's namespace, and its end leaves the running job's network whole.
- The node's net.ipv4.ip_forward, which a job network needs on, is put back to its value before
  the first job network once the last one is removed, not before.
"""

from __future__ import annotations

import ipaddress
import json
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from stasis.client import Client
from stasis.slurm import jobnetnode
from tests.conftest import TEST_USER
from tests.e2e.conftest import ENDED, Cluster, close_cluster, multinode_cluster, until

CLUSTER_NUMBER = 11  # tests/e2e/test_mpi_jobnet.py has 1, test_mpi_rsh.py 2
NODES = ("n1", "n2")
INTRUDER = "stasis-intruder"
RSH = [sys.executable, "-m", "stasis.slurm.rsh"]
IP = shutil.which("ip") or "/usr/sbin/ip"
NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"

# Each task of a job writes one line into a file of its own (srun may cut long lines of two
# tasks into each other's): its rank, node, pid (that of the sleep it becomes), its network
# namespace and what `ip` shows of its interfaces.
TASKS = (
    "srun --ntasks=2 --ntasks-per-node=1 /bin/sh -c "
    "'echo \"task $SLURM_PROCID $(hostname) $$ $(readlink /proc/self/ns/net) "
    f"$({IP} -j addr show)\" > {{work}}/task-$SLURM_JOB_ID-$SLURM_PROCID; exec sleep {{sleep}}'\n"
)

# Run on a node as root: the network namespace inode of /run/netns/stasis-job-VNI (null without
# one) and of each given pid, and the VNI of the job network each pid is in (jobnet.vni_of).
PROBE = """\
import json, os, sys
from stasis.daemon import jobnet
vni, pids = sys.argv[1], sys.argv[2:]
try:
    ns = os.stat(f"/run/netns/stasis-job-{vni}").st_ino
except OSError:
    ns = None
out = {"netns": ns, "pids": {}}
for pid in pids:
    try:
        out["pids"][pid] = {"ns": os.stat(f"/proc/{pid}/ns/net").st_ino, "vni": jobnet.vni_of(int(pid))}
    except OSError:
        out["pids"][pid] = None
print(json.dumps(out))
"""


@dataclass
class Task:
    rank: int
    node: str
    pid: int
    netns: str  # as readlink prints it: net:[INODE]
    links: list[dict[str, object]]  # `ip -j addr show`


@dataclass
class Job:
    id: str
    user: str
    vni: int
    tasks: dict[str, Task]  # by node


def _intruder() -> pwd.struct_passwd:
    """A second unprivileged local user, in none of the test user's groups."""
    for _ in range(10):
        try:
            return pwd.getpwnam(INTRUDER)
        except KeyError:
            pass
        # Another session's useradd may hold /etc/passwd's lock: try again.
        subprocess.run(
            ["useradd", "--no-create-home", "--shell", "/bin/sh", INTRUDER], capture_output=True
        )
        time.sleep(0.2)
    raise AssertionError(f"useradd {INTRUDER} failed ten times")


def _forwarding(c: Cluster, node: str) -> str:
    return c.on(node, "sysctl", "-n", "net.ipv4.ip_forward").stdout.strip()


@pytest.fixture(scope="module")
def two() -> Iterator[Cluster]:
    _intruder()
    c = multinode_cluster("jobnetatk", CLUSTER_NUMBER)
    try:
        (c.work / "probe.py").write_text(PROBE)
        # The node's own value before any job network: off, so that a job network's leaving
        # it on shows.
        for node in NODES:
            c.on(node, "sysctl", "-q", "-w", "net.ipv4.ip_forward=0")
            assert _forwarding(c, node) == "0"
        yield c
    finally:
        close_cluster(c)


def _submit(c: Cluster, name: str, user: str, sleep_s: int) -> str:
    script = c.script(
        name,
        TASKS.format(work=c.work, sleep=sleep_s),
        f"--output={c.work}/{name}-%j.out",
        "--export=ALL,STASIS_ENABLE=1",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--time=5",
    )
    return c.sbatch(script, user=user)


def _next_job_id(c: Cluster, job_id: int) -> None:
    """Have Slurm give `job_id` to the next job submitted (what a user gets by submitting jobs
    until then; sbatch has no --jobid): slurmctld takes FirstJobId when it is above its count."""
    lines = [
        line
        for line in c.lay.slurm_conf.read_text().splitlines()
        if not line.startswith("FirstJobId=")
    ]
    c.lay.slurm_conf.write_text("\n".join([*lines, f"FirstJobId={job_id}", ""]))
    c.run("scontrol", "reconfigure")


def _tasks(c: Cluster, job: str, timeout_s: float = 120) -> dict[str, Task]:
    """The job's task on each node, once both have printed their line."""

    def printed() -> dict[str, Task] | None:
        assert c.state(job) in ("PENDING", "CONFIGURING", "RUNNING"), c.output(job)
        found: dict[str, Task] = {}
        for path in c.work.glob(f"task-{job}-*"):
            words = path.read_text().split(maxsplit=5)
            if len(words) == 6 and words[0] == "task" and words[5].endswith("]\n"):
                found[words[2]] = Task(
                    int(words[1]), words[2], int(words[3]), words[4], json.loads(words[5])
                )
        return found if set(found) == set(NODES) else None

    return until(printed, timeout_s, f"job {job}'s tasks on both nodes")


def _job(c: Cluster, job: str, user: str) -> Job:
    opted = c.job(job).get("AdminComment", "")
    assert "stasis-token=" in opted, c.job(job)  # a job stasis makes a network for
    vni = jobnetnode.vni_of_job(int(job), CLUSTER_NUMBER)
    return Job(job, user, vni, _tasks(c, job))


def _probe(c: Cluster, node: str, vni: int, *pids: int) -> dict[str, object]:
    out = c.on(node, sys.executable, str(c.work / "probe.py"), str(vni), *map(str, pids)).stdout
    found: dict[str, object] = json.loads(out)
    return found


@pytest.fixture(scope="module")
def jobs(two: Cluster) -> dict[str, Job]:
    """A running job of the test user's and one of the intruder's, each on both nodes."""
    mine = _submit(two, "victim", TEST_USER, 600)
    theirs = _submit(two, "other", INTRUDER, 600)
    return {"mine": _job(two, mine, TEST_USER), "theirs": _job(two, theirs, INTRUDER)}


def _parts(c: Cluster, node: str, job: str) -> list[str]:
    client = Client(c.lay.node_socket(node), timeout_s=60)
    try:
        return [j["job"] for j in client.jobs() if j["label"] == f"slurm-{job}-part"]
    finally:
        client.close()


def test_another_user_cannot_start_a_part_of_a_users_job(
    two: Cluster, jobs: dict[str, Job]
) -> None:
    job = jobs["mine"].id
    for here, target in (("n1", "n2"), ("n1", "n1"), ("n2", "n1")):
        r = two.on(
            here,
            "env",
            f"STASIS_CONFIG={two.lay.config_of(here)}",
            f"SLURM_JOB_ID={job}",
            *RSH,
            target,
            "touch /tmp/intruded; sleep 60",
            user=INTRUDER,
            check=False,
        )
        assert r.returncode == 255, (here, target, r.stdout, r.stderr)
        assert r.stderr.startswith(f"stasis-rsh: {target}: permission denied"), r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        assert f"the job is {TEST_USER}'s" in r.stderr, r.stderr
        assert r.stdout == "", r.stdout
    for node in NODES:
        assert _parts(two, node, job) == [], node  # nothing started, as root sees it
        assert two.on(node, "test", "-e", "/tmp/intruded", check=False).returncode == 1
    assert two.state(job) == "RUNNING"


def _refused(r: subprocess.CompletedProcess[str]) -> bool:
    return r.returncode != 0 and "ok" not in r.stdout


def test_a_user_cannot_enter_another_jobs_network(two: Cluster, jobs: dict[str, Job]) -> None:
    mine, theirs = jobs["mine"], jobs["theirs"]
    for node in NODES:
        targets = [f"/run/netns/stasis-job-{theirs.vni}", f"/proc/{theirs.tasks[node].pid}/ns/net"]
        # The targets are there: root enters them.
        for target in targets:
            r = two.on(node, NSENTER, f"--net={target}", IP, "-j", "-4", "addr", "show", "eth0")
            (eth0,) = json.loads(r.stdout)
            here = [ipaddress.ip_address(a["local"]) for a in eth0["addr_info"]]
            assert here and all(a in jobnetnode.subnet_of(theirs.vni) for a in here), here
        for target in targets:
            enter = [NSENTER, f"--net={target}", "echo", "ok"]
            # From the user's shell, and as root of a user namespace of their own.
            for argv in (enter, [UNSHARE, "-Ur", *enter]):
                r = two.on(node, *argv, user=TEST_USER, check=False)
                assert _refused(r), (node, argv, r.stdout, r.stderr)
            # From a task of their own job (a step of it on that node, in its network).
            r = two.run(
                "srun",
                f"--jobid={mine.id}",
                "--overlap",
                "-N1",
                "-n1",
                f"-w{node}",
                "/bin/sh",
                "-c",
                f"readlink /proc/self/ns/net; {' '.join(enter)}; "
                f"{UNSHARE} -Ur {' '.join(enter)}",
                user=TEST_USER,
                check=False,
            )
            lines = r.stdout.splitlines()
            assert lines[:1] == [mine.tasks[node].netns], (node, r.stdout, r.stderr)
            assert "ok" not in lines, (node, target, r.stdout, r.stderr)
            assert (
                r.stderr.count(f"nsenter: cannot open {target}")
                + r.stderr.count("nsenter: reassociate to namespace 'ns/net' failed")
                >= 2
            ), (node, target, r.stderr)
    # The other job is still where it was.
    for node in NODES:
        seen = _probe(two, node, theirs.vni, theirs.tasks[node].pid)
        assert seen["pids"] == {
            str(theirs.tasks[node].pid): {"ns": seen["netns"], "vni": theirs.vni}
        }


def test_a_task_sees_only_its_jobs_interfaces(two: Cluster, jobs: dict[str, Job]) -> None:
    for job in jobs.values():
        subnet = jobnetnode.subnet_of(job.vni)
        for index, node in enumerate(NODES):
            task = job.tasks[node]
            names = sorted(str(link["ifname"]) for link in task.links)
            assert names == ["eth0", "lo"], (job.id, node, task.links)
            (eth0,) = [link for link in task.links if link["ifname"] == "eth0"]
            inet = [a for a in eth0["addr_info"] if a["family"] == "inet"]  # type: ignore[attr-defined]
            want = {"local": str(subnet.network_address + 1 + index), "prefixlen": 24}
            assert [{k: a[k] for k in want} for a in inet] == [want], (job.id, node, inet)
            # ... and that is the namespace of the job's network on the node.
            seen = _probe(two, node, job.vni, task.pid)
            assert task.netns == f"net:[{seen['netns']}]", (job.id, node, seen)
            assert seen["pids"] == {str(task.pid): {"ns": seen["netns"], "vni": job.vni}}


def _slurmd_log(c: Cluster, node: str) -> str:
    return (c.lay.node_dir(node) / "slurmd.log").read_text(errors="replace")


@pytest.mark.parametrize(
    ("apart", "why"),
    [
        (16384, "another running job's subnet there"),
        (1 << 20, "is running job {job}'s on this node"),
    ],
    ids=["same-subnet", "same-vni"],
)
def test_a_job_colliding_with_a_running_one_does_not_get_its_network(
    two: Cluster, jobs: dict[str, Job], apart: int, why: str
) -> None:
    mine = jobs["mine"]
    wanted = str(int(mine.id) + apart)
    _next_job_id(two, int(wanted))
    collider = _submit(two, f"collider-{apart}", INTRUDER, 15)
    assert collider == wanted
    theirs = _job(two, collider, INTRUDER)
    assert jobnetnode.subnet_of(theirs.vni) == jobnetnode.subnet_of(mine.vni)
    for node in NODES:
        said = [line for line in _slurmd_log(two, node).splitlines() if f"job {collider}'s" in line]
        assert any(why.format(job=mine.id) in line for line in said), (node, said)
        # Its task runs in the node's network: not in the running job's namespace.
        task = theirs.tasks[node]
        assert task.netns != mine.tasks[node].netns, (node, task)
        seen = _probe(two, node, mine.vni, task.pid)
        entry = seen["pids"][str(task.pid)]  # type: ignore[index]
        assert entry["vni"] is None and entry["ns"] != seen["netns"], (node, seen)
        node_ns = two.on(node, "readlink", "/proc/self/ns/net").stdout.strip()
        assert task.netns == node_ns, (node, task.netns, node_ns)
    state = two.wait_state(collider, ENDED, timeout_s=90)
    assert state == "COMPLETED", two.output(collider)
    # Its end (the epilog) leaves the running job's network whole.
    for node in NODES:
        task = mine.tasks[node]
        seen = _probe(two, node, mine.vni, task.pid)
        assert seen["netns"] is not None and task.netns == f"net:[{seen['netns']}]", seen
        assert seen["pids"] == {str(task.pid): {"ns": seen["netns"], "vni": mine.vni}}
        r = two.on(node, NSENTER, f"--net=/run/netns/stasis-job-{mine.vni}", IP, "-j", "addr")
        assert sorted(str(link["ifname"]) for link in json.loads(r.stdout)) == ["eth0", "lo"]
    assert two.state(mine.id) == "RUNNING"


def _ended(c: Cluster, job: Job) -> None:
    c.run("scancel", job.id)
    # COMPLETING until every node's epilog is done.
    state = c.wait_state(job.id, ENDED, timeout_s=90)
    assert state == "CANCELLED", state
    for node in NODES:
        record = str(jobnetnode.RECORDS / job.id)
        assert c.on(node, "test", "-e", record, check=False).returncode == 1, (node, record)
        assert (
            c.on(node, "test", "-e", f"/run/netns/stasis-job-{job.vni}", check=False).returncode
            == 1
        )


def test_forwarding_is_put_back_after_the_last_job_network(
    two: Cluster, jobs: dict[str, Job]
) -> None:
    for node in NODES:
        assert _forwarding(two, node) == "1", node  # a job network needs it
    _ended(two, jobs["mine"])
    for node in NODES:
        assert _forwarding(two, node) == "1", node  # the other job's network still does
    _ended(two, jobs["theirs"])
    for node in NODES:
        assert _forwarding(two, node) == "0", node  # as before the first job network
        left = two.on(node, "ls", "-A", str(jobnetnode.RECORDS)).stdout.split()
        assert left == [], (node, left)
