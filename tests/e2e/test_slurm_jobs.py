"""Opted-in Slurm jobs on a real cluster: preemption, manual and periodic checkpoints, users,
exit codes, scancel, the label lifecycle and bad input. Each test proves state: the counter goes on
from the checkpointed value, Restarts as Slurm counts them, no process left behind."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

from stasis.dev import slurmcluster
from stasis.slurm import scontrol
from tests.conftest import STASIS, TEST_USER
from tests.e2e.conftest import EARLY, Cluster, Early, close_cluster, new_cluster, until, wait_gone


@pytest.fixture(scope="module")
def cluster(shared_cluster: Cluster) -> Cluster:
    """The session's shared cluster (conftest): this module leaves it as it found it."""
    return shared_cluster


ENABLE = "--export=STASIS_ENABLE=1"


def after(text: str, marker: str) -> list[int]:
    """The counter values printed after the line holding `marker`."""
    tail = text[text.index(marker) :]
    return [int(n) for n in re.findall(r"^(\d+)$", tail, re.M)]


def before(text: str, marker: str) -> list[int]:
    head = text[: text.index(marker)]
    return [int(n) for n in re.findall(r"^(\d+)$", head, re.M)]


def _preempt(environ: dict[str, str]) -> dict[str, Any]:
    """A `victim` (opted in, label victim) and the same job without STASIS_ENABLE, both in the
    preemptable `low` partition, preempted by a `preemptor` taking the whole node in `high`.
    A minute of waiting on Slurm: on a cluster of its own (the preemptor takes the whole node),
    started with the session (Early), which records what the tests check and is gone after."""
    cluster = new_cluster("preempt", environ=environ)
    try:
        return _preempted_on(cluster)
    finally:
        close_cluster(cluster)


def _preempted_on(cluster: Cluster) -> dict[str, Any]:
    victim = cluster.counter_script(
        "victim", "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=victim", stop=25
    )
    plain = cluster.counter_script("plain", "--open-mode=append", stop=25)
    preemptor = cluster.script(
        "preemptor",
        "echo preemptor; sleep 2",
        "--partition=high",
        "--cpus-per-task=8",
        f"--output={cluster.work}/preemptor-%j.out",
    )
    v, p = cluster.sbatch(victim), cluster.sbatch(plain)
    cluster.wait_number(v, 5)
    cluster.wait_number(p, 5)
    pre = cluster.sbatch(preemptor)
    cluster.wait_state(v, ("COMPLETED", "FAILED", "CANCELLED"), 150)
    cluster.wait_state(p, ("COMPLETED", "FAILED", "CANCELLED"), 90)
    return {
        "victim": v,
        "plain": p,
        "preemptor": pre,
        "version": cluster.run("scontrol", "--version").stdout,
        "victim_job": cluster.job(v),
        "plain_job": cluster.job(p),
        "victim_out": cluster.output(v),
        "plain_out": cluster.output(p),
        "preemptor_state": cluster.state(pre),
        "victim_sacct": cluster.sacct(v),
        "victim_checkpoints": cluster.checkpoints("victim"),
    }


PREEMPTED = Early(_preempt, lambda _: None)
EARLY["test_slurm_jobs.py"] = PREEMPTED


@pytest.fixture(scope="module")
def preempted() -> dict[str, Any]:
    return PREEMPTED.take(300)


def test_preempted_victim_resumes_from_its_checkpoint(preempted: dict[str, Any]) -> None:
    out, job = preempted["victim_out"], preempted["victim_job"]
    assert preempted["preemptor_state"] == "COMPLETED"
    assert "SIGURG: taking a checkpoint" in out
    at_dump = before(out, "stasis: restored checkpoint")[-1]  # nothing printed after the dump
    assert at_dump >= 5
    resumed = after(out, "stasis: restored checkpoint")
    # The same output file goes on, and the counter goes on from the checkpointed value.
    assert resumed[0] == at_dump + 1, out
    assert re.findall(r"^(\d+)$", out, re.M) == [str(i) for i in range(25)], out
    assert out.rstrip().splitlines()[-2] == "done"
    assert job["Restarts"] == "1"
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0"
    assert ("COMPLETED", "0:0") in preempted["victim_sacct"]
    # Completed with exit 0: the label's checkpoints are retired.
    assert preempted["victim_checkpoints"] == []


def test_same_job_without_stasis_restarts_from_zero(preempted: dict[str, Any]) -> None:
    out, job = preempted["plain_out"], preempted["plain_job"]
    numbers = [int(n) for n in re.findall(r"^(\d+)$", out, re.M)]
    # The first run, then the requeued run from the start. Slurm 24.11 (seen) requeues a preempted
    # job once more when that run ends: a third run, Slurm's own doing, with or without stasis.
    runs = 3 if _slurm(preempted) >= (24, 11) else 2
    assert numbers.count(0) == runs, out
    second = numbers[numbers.index(0, 1) :]
    assert second == list(range(25)) * (runs - 1)
    assert "stasis" not in out
    assert job["Restarts"] == str(runs - 1) and job["JobState"] == "COMPLETED"


def _slurm(preempted: dict[str, Any]) -> tuple[int, int]:
    return scontrol.parse_version(preempted["version"])


def test_non_root_job_manual_dump_resumes_and_keeps_its_exit_code(cluster: Cluster) -> None:
    script = cluster.counter_script("user", ENABLE, stop=24, interval=0.5, code=3)
    job = cluster.sbatch(script, user=TEST_USER)
    assert cluster.job(job)["UserId"].startswith(TEST_USER)
    cluster.wait_number(job, 4)
    before_pids = cluster.pids(job)
    inner_before = _namespace_pids(before_pids)
    assert inner_before[0] == 1  # tini, the namespace's init: host pid 1 is always taken
    answer = json.loads(cluster.stasis("dump", "--slurm-job", job, "--json", user=TEST_USER).stdout)
    assert answer["requeued"] is True and answer["label"] == job
    wait_gone(before_pids)
    until(lambda: "stasis: restored checkpoint" in cluster.output(job), 90, "the restore")
    after_pids = cluster.pids(job)
    # Restored with the original pids inside its namespace, under new pids on the node.
    assert _namespace_pids(after_pids) == inner_before
    assert not set(after_pids) & set(before_pids)
    assert all(_uid(p) == cluster_uid(TEST_USER) for p in after_pids if _uid(p) is not None)
    cluster.wait_state(job, ("FAILED", "COMPLETED"), 120)
    out = cluster.output(job)
    resumed = after(out, "stasis: restored checkpoint")
    assert resumed[0] == before(out, "stasis: restored checkpoint")[-1] + 1, out
    assert re.findall(r"^(\d+)$", out, re.M) == [str(i) for i in range(24)], out
    info = cluster.job(job)
    assert info["Restarts"] == "1"
    assert info["ExitCode"] == "3:0" and info["JobState"] == "FAILED"
    assert ("FAILED", "3:0") in cluster.sacct(job)
    # Kept after a failure; owned by the user, not by root (whose label series is empty).
    kept = cluster.checkpoints(job, user=TEST_USER)
    assert cluster.checkpoints(job) == []
    assert [c["id"] for c in kept] == [answer["checkpoint"]]
    assert kept[0]["uid"] != 0 and kept[0]["user"] == TEST_USER


def test_other_users_cannot_checkpoint_a_job_or_use_its_label(cluster: Cluster) -> None:
    label = f"shared-{secrets.token_hex(3)}"
    opt = f"--export=STASIS_ENABLE=1,STASIS_CHECKPOINT={label}"
    job = cluster.sbatch(cluster.counter_script("rootjob", opt, stop=200, interval=0.5))
    cluster.wait_number(job, 2)
    result = cluster.stasis("dump", "--slurm-job", job, user=TEST_USER, check=False)
    assert result.returncode == 2 and "permission denied" in result.stderr
    bad = cluster.stasis("dump", "--slurm-job", "../1", check=False)
    assert bad.returncode == 2 and "not a Slurm job id" in bad.stderr
    # Nor set its checkpoint interval (the route its own srun launcher asks), nor see it.
    ask = cluster.run(
        str(Path(STASIS).parent / "python"),
        "-c",
        "import sys\n"
        "from stasis.client import Client\n"
        "from stasis.config import load_settings\n"
        "from stasis.errors import StasisError\n"
        "try:\n"
        f"    Client(load_settings().socket).slurm_interval({job!r}, '1')\n"
        "except StasisError as e:\n"
        "    sys.exit(str(e))\n",
        user=TEST_USER,
        check=False,
    )
    assert ask.returncode == 1 and "permission denied" in ask.stderr, ask
    listed = json.loads(cluster.stasis("slurm", "intervals", "--json", user=TEST_USER).stdout)
    assert job not in [e["slurm_job"] for e in listed]
    assert "stasis: checkpoint interval" not in cluster.output(job)
    assert cluster.state(job) == "RUNNING"
    cluster.stasis("dump", "--slurm-job", job, "--leave-running")
    # Another user's job with the same label: labels are per owner, so it starts from its own
    # (empty) series, protected, never restores root's checkpoint, and completing with exit 0
    # retires only its own checkpoints of the label, not root's.
    theirs = cluster.sbatch(
        cluster.counter_script("theirs", opt, stop=3, interval=0.2), user=TEST_USER
    )
    cluster.wait_state(theirs, ("COMPLETED",))
    out = cluster.output(theirs)
    assert "restored" not in out and cluster.numbers(theirs) == [0, 1, 2]
    assert f"no checkpoint with label {label} to resume from" in out, out
    assert "WITHOUT checkpoint protection" not in out
    assert len(cluster.checkpoints(label)) == 1
    assert cluster.checkpoints(label, user=TEST_USER) == []
    cluster.run("scancel", job)
    cluster.wait_state(job, ("CANCELLED",))


def test_periodic_checkpoint_then_requeue_resumes_and_scancel_leaves_nothing(
    cluster: Cluster,
) -> None:
    script = cluster.counter_script(
        "periodic", "--export=STASIS_ENABLE=1,STASIS_INTERVAL=3", stop=400, interval=0.5
    )
    job = cluster.sbatch(script)
    cluster.wait_number(job, 1)  # running (a busy machine may start it late)
    until(lambda: len(cluster.checkpoints(job)) >= 2, 60, "two periodic checkpoints")
    out = cluster.output(job)
    assert out.count("stasis: periodic checkpoint") >= 2
    assert cluster.state(job) == "RUNNING"  # leave-running
    cluster.run("scontrol", "requeue", job)  # standing in for a node failure
    latest = cluster.checkpoints(job)[0]["id"]
    until(lambda: "stasis: restored checkpoint" in cluster.output(job), 90, "the restore")
    out = cluster.output(job)
    assert f"stasis: restored checkpoint {latest}" in out
    last_before = before(out, "stasis: restored checkpoint")[-1]
    resumed = until(
        lambda: after(cluster.output(job), "stasis: restored checkpoint"),
        30,
        "counter after the restore",
    )
    # Resumed from the last periodic checkpoint: not from 0, not past where it was killed.
    assert 0 < resumed[0] <= last_before + 1
    assert cluster.job(job)["Restarts"] == "1"
    pids = cluster.pids(job)
    workload = [p for p in pids if "counter.py" in _cmdline(p)]
    assert workload, pids  # the restored processes belong to the job
    cluster.run("scancel", job)
    cluster.wait_state(job, ("CANCELLED",))
    wait_gone(pids)
    assert not _processes_running(f"{cluster.work}/counter.py 400")


def test_label_lifecycle_resume_under_new_id_then_retire(cluster: Cluster) -> None:
    label = f"life-{secrets.token_hex(3)}"
    script = cluster.counter_script(
        "life", f"--export=STASIS_ENABLE=1,STASIS_CHECKPOINT={label}", stop=24, interval=0.5
    )  # 10 s after the 4th number: time for the dump and the scancel on a loaded machine
    first = cluster.sbatch(script)
    cluster.wait_number(first, 4)
    cp = json.loads(
        cluster.stasis("dump", "--slurm-job", first, "--leave-running", "--json").stdout
    )
    assert cp["requeued"] is False
    cluster.run("scancel", first)
    cluster.wait_state(first, ("CANCELLED",))
    assert [c["id"] for c in cluster.checkpoints(label)] == [cp["checkpoint"]]  # kept
    at_dump_max = cluster.numbers(first)[-1]

    second = cluster.sbatch(script)  # a new job id, the same label: resumes
    assert second != first
    cluster.wait_state(second, ("COMPLETED",), 90)
    out = cluster.output(second)
    assert f"stasis: restored checkpoint {cp['checkpoint']}" in out
    # The new job's own output holds only the restored counter (the launcher's "restored" line
    # may land after its first value).
    resumed = cluster.numbers(second)
    assert 4 <= resumed[0] <= at_dump_max + 1 and resumed[-1] == 23
    assert resumed == list(range(resumed[0], 24))
    assert cluster.checkpoints(label) == []  # COMPLETED with 0: retired

    third = cluster.sbatch(script)  # starts fresh
    cluster.wait_number(third, 2)
    out = cluster.output(third)
    assert f"no checkpoint with label {label}" in out
    assert cluster.numbers(third)[:3] == [0, 1, 2]
    cluster.run("scancel", third)
    cluster.wait_state(third, ("CANCELLED",))


def test_unknown_label_runs_from_the_start_with_a_warning(cluster: Cluster) -> None:
    # Cedana's variable names work too; srun steps inside an opted-in job still work.
    script = cluster.script(
        "unknown",
        f"srun /bin/echo step-ok\nexec python3 -u {cluster.work}/counter.py 3 0.2 0",
        "--export=CEDANA_ENABLE=1,CEDANA_CHECKPOINT=never-seen-label",
        f"--output={cluster.work}/unknown-%j.out",
    )
    job = cluster.sbatch(script)
    cluster.wait_state(job, ("COMPLETED",))
    out = cluster.output(job)
    assert "warning: no checkpoint with label never-seen-label" in out
    assert "step-ok" in out
    assert cluster.numbers(job) == [0, 1, 2]
    assert cluster.job(job)["Restarts"] == "0"


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(cluster: Cluster) -> None:
    label = f"corrupt-{secrets.token_hex(3)}"
    script = cluster.counter_script(
        "corrupt", f"--export=STASIS_ENABLE=1,STASIS_CHECKPOINT={label}", stop=400, interval=0.5
    )
    first = cluster.sbatch(script)
    cluster.wait_number(first, 3)
    older = json.loads(
        cluster.stasis("dump", "--slurm-job", first, "--leave-running", "--json").stdout
    )["checkpoint"]
    older_max = cluster.numbers(first)[-1]
    cluster.wait_number(first, older_max + 8)
    newer = json.loads(
        cluster.stasis("dump", "--slurm-job", first, "--leave-running", "--json").stdout
    )["checkpoint"]
    cluster.run("scancel", first)
    cluster.wait_state(first, ("CANCELLED",))
    pages = max((cluster.lay.store / newer).glob("pages-*.img"), key=lambda p: p.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(bytes(data))

    second = cluster.sbatch(script)
    until(lambda: "stasis: restored checkpoint" in cluster.output(second), 60, "the restore")
    cluster.wait_number(second, 1)
    out = until(
        lambda: o if (o := cluster.output(second)) and after(o, "restored checkpoint") else "",
        30,
        "output after the restore",
    )
    assert f"skipping checkpoint {newer}" in out and "corrupt" in out and pages.name in out
    assert f"stasis: restored checkpoint {older}" in out
    # The second job's own output holds only the restored counter: its first value is where the
    # older checkpoint was (the launcher's "restored" line may land after it).
    first_restored = int(re.findall(r"^(\d+)$", out, re.M)[0])
    assert 0 < first_restored <= older_max + 1, out
    cluster.run("scancel", second)
    cluster.wait_state(second, ("CANCELLED",))


def test_daemon_down_job_runs_unprotected_and_says_so(cluster: Cluster) -> None:
    slurmcluster.stop_daemon(cluster.root)
    try:
        job = cluster.sbatch(cluster.counter_script("nodaemon", ENABLE, stop=3, interval=0.2))
        cluster.wait_state(job, ("COMPLETED",))
    finally:
        slurmcluster.start_daemon(cluster.root)
    out = cluster.output(job)
    assert "cannot reach the stasis daemon" in out and "WITHOUT checkpoint protection" in out
    assert cluster.numbers(job) == [0, 1, 2]
    assert cluster.job(job)["ExitCode"] == "0:0"


def _namespace_pids(pids: list[int]) -> list[int]:
    """The pids inside their namespace of those `pids` that live in a child PID namespace."""
    inner = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        levels = re.search(r"^NSpid:\s+(.*)$", status, re.M)
        if levels and len(levels.group(1).split()) == 2:
            inner.append(int(levels.group(1).split()[1]))
    return sorted(inner)


def _uid(pid: int) -> int | None:
    try:
        return Path(f"/proc/{pid}").stat().st_uid
    except OSError:
        return None


def cluster_uid(user: str) -> int:
    import pwd

    return pwd.getpwnam(user).pw_uid


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _processes_running(pattern: str) -> bool:
    return subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 0
