"""Slurm as sites run it (`local-cluster up`, its default: proctrack/cgroup, task/cgroup,
ConstrainRAMSpace): a restored job's processes are in its own step's cgroup, where its --mem
limit holds (Slurm's OOM kill, not ours), `scancel` and the time limit end them.

The jobs resumed under a new job id (a label) are the ones that show it: CRIU, left to itself,
restores a tree into the cgroups its images name, i.e. the old job's, which Slurm removed and
CRIU makes again: outside the new job's limit, `scontrol listpids` and scancel. A job requeued
under its own id lands in a cgroup of the same path by chance.

All on one cluster of its own, run early (conftest's Early): mostly waiting on Slurm's clocks.
"""

from __future__ import annotations

import json
import re
import secrets
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stasis.poll import poll
from tests.conftest import TEST_USER, ensure_test_user
from tests.e2e.conftest import Cluster, close_cluster, early_checks, until, wait_gone

# A counter that, once `trigger` exists, allocates (and touches) memory until it is killed;
# with "noterm" it ignores SIGTERM, so only Slurm's SIGKILL to the whole cgroup ends it.
WORKLOAD = """\
import os, signal, sys, time
stop, trigger = int(sys.argv[1]), sys.argv[2]
if sys.argv[3:] == ["noterm"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
hog = []
for i in range(stop):
    print(i, flush=True)
    if os.path.exists(trigger):
        for _ in range(8):
            hog.append(bytearray(os.urandom(1)) * (16 << 20))  # 16 MiB, every page touched
        print("allocated", 16 * len(hog), "MiB", flush=True)
    time.sleep(0.5)
"""

RESTORED = "stasis: restored checkpoint"


class CgroupCluster(Cluster):
    def up(self) -> None:
        answer = json.loads(self.start("--socket-group", TEST_USER, "--cgroup"))
        assert answer["nodes"] == ["n1"]
        assert answer["cgroup"] in ("v1", "v2"), answer
        self.work.mkdir(exist_ok=True)
        self.work.chmod(0o777)
        (self.work / "workload.py").write_text(WORKLOAD)


@dataclass
class Made:
    cluster: Cluster
    # The time-limit job, started by the first check that can (it waits a minute or more).
    timed: str = ""
    timed_pids: list[int] = field(default_factory=list)


def _setup(environ: dict[str, str]) -> Made:
    ensure_test_user()
    root = Path(tempfile.mkdtemp(prefix="stasis-e2e-cgroup-"))
    root.chmod(0o755)
    c = CgroupCluster(root, environ=environ)
    try:
        c.up()
    except BaseException:
        close_cluster(c)
        raise
    return Made(c)


def _job_script(c: Cluster, name: str, *sbatch: str, noterm: bool = False) -> Path:
    trigger = c.work / f"{name}.grow"
    return c.script(
        name,
        f"exec python3 -u {c.work}/workload.py 2000 {trigger}" f"{' noterm' if noterm else ''}",
        f"--output={c.work}/{name}-%j.out",
        *sbatch,
    )


def _cgroup(pid: int, controller: str) -> str:
    """`pid`'s cgroup in `controller`'s hierarchy (v1), or its cgroup v2 path."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _task_pid(c: Cluster, job: str) -> int:
    """The batch step's task (LOCALID 0): slurmstepd put it in the step's cgroup."""
    out = c.run("scontrol", "listpids", job).stdout
    return next(
        int(f[0])
        for f in (line.split() for line in out.splitlines()[1:])
        if len(f) >= 4 and f[2] == "batch" and f[3] == "0"
    )


def _workload(c: Cluster, job: str, name: str) -> int:
    """The restored workload's pid on the node, found among ALL of this machine's processes
    (not only those Slurm lists: where it is is what is checked)."""
    script = f"{c.work}/workload.py"
    found = [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit()
        and script in _cmdline(int(p.name))
        and f"{name}.grow" in _cmdline(int(p.name))
    ]
    assert len(found) == 1, found
    return found[0]


def _memory_limit_mib(pid: int) -> int:
    """The memory limit that holds for `pid`: the lowest of its memory cgroup's and those
    above it up to its job's (v1's memory.limit_in_bytes, v2's memory.max), where Slurm
    wrote the job's --mem, as this machine sees them."""
    path = Path(_cgroup(pid, "memory").lstrip("/"))
    top = Path("/sys/fs/cgroup/memory")
    name = "memory.limit_in_bytes" if top.is_dir() else "memory.max"
    top = top if top.is_dir() else Path("/sys/fs/cgroup")
    limits = [
        int(text)
        for d in (path, *path.parents)
        if re.search(r"/job_\d+(/|$)", f"/{d}")
        for text in [(top / d / name).read_text().strip()]
        if text != "max"
    ]
    assert limits, f"no memory limit on {path} or above it in its job"
    return min(limits) >> 20


def _in_its_step(c: Cluster, job: str, pid: int, mem_mib: int) -> None:
    """`pid` is in `job`'s batch step cgroups (memory for the limit, freezer or v2's one
    path for proctrack): the same as the step's task, Slurm lists it, and its memory cgroup
    holds the job's --mem (`mem_mib`)."""
    # Moved there when the launcher registers, a moment after the restore says so.
    if not poll(lambda: pid in c.pids(job), 20, 0.5):
        raise AssertionError(
            f"Slurm does not list process {pid} ({_cmdline(pid)}) in job {job}: "
            f"it lists {c.pids(job)}; the process is in "
            f"{Path(f'/proc/{pid}/cgroup').read_text()!r}; output: "
            f"{c.output(job)[-600:]}"
        )
    task = _task_pid(c, job)
    for controller in ("memory", "freezer"):
        assert _cgroup(pid, controller) == _cgroup(task, controller), (controller, pid, task)
        assert re.search(rf"/job_{job}/step_batch(/|$)", _cgroup(pid, controller)), _cgroup(
            pid, controller
        )
    assert _memory_limit_mib(pid) == mem_mib, (_memory_limit_mib(pid), _cgroup(pid, "memory"))


def _resume_under_new_id(
    c: Cluster, name: str, first_mem: str, mem: str, *sbatch: str, noterm: bool = False
) -> tuple[str, int]:
    """A labelled job checkpointed (left running) and cancelled, then the same script again:
    the new job (its id, --mem `mem`) resumes the checkpoint. (new job id, value at the dump)"""
    label = f"{name}-{secrets.token_hex(3)}"
    opts = f"--export=STASIS_ENABLE=1,STASIS_CHECKPOINT={label}"
    script = _job_script(c, name, opts, *sbatch, noterm=noterm)
    first = c.sbatch(script, f"--mem={first_mem}", user=TEST_USER)
    c.wait_number(first, 3)
    c.stasis("dump", "--slurm-job", first, "--leave-running", user=TEST_USER)
    at_dump = c.numbers(first)[-1]
    c.run("scancel", first)
    c.wait_state(first, ("CANCELLED",))
    second = c.sbatch(script, f"--mem={mem}", user=TEST_USER)
    until(lambda: RESTORED in c.output(second), 90, f"job {second}'s restore")
    resumed = until(lambda: c.numbers(second), 30, f"job {second}'s counter")
    # The counter goes on from the checkpoint, not from 0.
    assert 3 <= resumed[0] <= at_dump + 2, (resumed, at_dump, c.output(second))
    return second, at_dump


def _preempted_job_resumes_in_its_step_cgroup(m: Made) -> None:
    c = m.cluster
    victim = c.sbatch(
        _job_script(c, "victim", "--export=STASIS_ENABLE=1", "--mem=200M"), user=TEST_USER
    )
    c.wait_number(victim, 4)
    preemptor = c.script(
        "preemptor",
        "sleep 1",
        "--partition=high",
        "--cpus-per-task=8",
        "--mem=100M",
        f"--output={c.work}/preemptor-%j.out",
    )
    c.sbatch(preemptor)
    until(lambda: RESTORED in c.output(victim), 150, "the victim's restore")
    out = c.output(victim)
    assert "SIGURG: taking a checkpoint" in out, out
    at_dump = [int(n) for n in re.findall(r"^(\d+)$", out[: out.index(RESTORED)], re.M)][-1]
    resumed = until(
        lambda: [
            int(n)
            for n in re.findall(
                r"^(\d+)$", c.output(victim)[c.output(victim).index(RESTORED) :], re.M
            )
        ],
        30,
        "the victim's counter after the restore",
    )
    assert resumed[0] == at_dump + 1, out
    assert c.job(victim)["Restarts"] == "1"
    pid = _workload(c, victim, "victim")
    _in_its_step(c, victim, pid, 200)
    # scancel ends the requeued and restored job too: none of its processes is left.
    pids = c.pids(victim)
    c.run("scancel", victim)
    c.wait_state(victim, ("CANCELLED",))
    wait_gone([pid, *pids])


def _restored_under_a_new_id_it_is_in_the_new_jobs_step_cgroup(m: Made) -> None:
    c = m.cluster
    # The time-limit job first: it then runs into its limit while the next checks run.
    # --signal=URG@1 (not B:, which the stasis launcher would hear and checkpoint on): a
    # warning no process of the batch step gets, so the limit ends it as Slurm would.
    m.timed, _ = _resume_under_new_id(
        c, "timed", "300M", "200M", "--time=1", "--signal=URG@1", "--partition=high", noterm=True
    )
    timed = _workload(c, m.timed, "timed")
    _in_its_step(c, m.timed, timed, 200)
    m.timed_pids = c.pids(m.timed)


def _memory_limit_holds_after_a_restore(m: Made) -> None:
    c = m.cluster
    # Checkpointed under a 400 MiB limit, resumed under 200 MiB: the new job's limit holds.
    job, _ = _resume_under_new_id(c, "hog", "400M", "200M")
    pid = _workload(c, job, "hog")
    _in_its_step(c, job, pid, 200)
    (c.work / "hog.grow").write_text("")
    c.wait_state(job, ("OUT_OF_MEMORY", "FAILED", "COMPLETED", "CANCELLED"), 60)
    out = c.output(job)
    assert c.state(job) == "OUT_OF_MEMORY", out
    grown = [int(n) for n in re.findall(r"^allocated (\d+) MiB$", out, re.M)]
    assert grown and max(grown) < 200 + 128, out  # killed near 200 MiB, never near 400
    # Slurm's own word: "oom-kill event" (22.05), "oom_kill event" (24.11).
    assert re.search(r"oom[-_]kill event", out), out
    wait_gone([pid])


def _scancel_ends_a_restored_job(m: Made) -> None:
    c = m.cluster
    job, _ = _resume_under_new_id(c, "cancelled", "300M", "300M", noterm=True)
    pid = _workload(c, job, "cancelled")
    _in_its_step(c, job, pid, 300)
    pids = c.pids(job)
    assert pid in pids
    c.run("scancel", job)
    c.wait_state(job, ("CANCELLED",))
    wait_gone([pid, *pids])


def _time_limit_ends_a_restored_job(m: Made) -> None:
    c = m.cluster
    assert m.timed, "the time-limit job was not started"
    pid = _workload(c, m.timed, "timed")
    # The limit (a minute of the restored run) and Slurm's check (every 30 s), then the
    # workload, deaf to SIGTERM, gets SIGKILL KillWait (5 s) later.
    c.wait_state(m.timed, ("TIMEOUT", "COMPLETED", "FAILED", "CANCELLED"), 150)
    out = c.output(m.timed)
    assert c.state(m.timed) == "TIMEOUT", out
    assert c.job(m.timed)["Restarts"] == "0"  # ended by the limit, not checkpointed again
    wait_gone([pid, *m.timed_pids])


CHECKS: list[Callable[[Made], None]] = [
    _preempted_job_resumes_in_its_step_cgroup,
    _restored_under_a_new_id_it_is_in_the_new_jobs_step_cgroup,
    _memory_limit_holds_after_a_restore,
    _scancel_ends_a_restored_job,
    _time_limit_ends_a_restored_job,
]
_outcome = early_checks("test_slurm_cgroup.py", _setup, lambda m: close_cluster(m.cluster), CHECKS)


def test_preempted_job_resumes_in_its_step_cgroup() -> None:
    _outcome(_preempted_job_resumes_in_its_step_cgroup)


def test_restored_under_a_new_id_it_is_in_the_new_jobs_step_cgroup() -> None:
    _outcome(_restored_under_a_new_id_it_is_in_the_new_jobs_step_cgroup)


def test_memory_limit_holds_after_a_restore() -> None:
    _outcome(_memory_limit_holds_after_a_restore)


def test_scancel_ends_a_restored_job() -> None:
    _outcome(_scancel_ends_a_restored_job)


def test_time_limit_ends_a_restored_job() -> None:
    _outcome(_time_limit_ends_a_restored_job)
