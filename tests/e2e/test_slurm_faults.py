"""Slurm jobs under faults (issue 28), on one real cluster for the whole module:

- a job that exits 0 after its stop checkpoint failed keeps its label's checkpoints, and a finish
  report without an exit status retires nothing;
- a requeued job that cannot reach the store, or whose node daemon is down, is requeued held with
  a reason (never started from the beginning), and resumes from its checkpoint once released;
- the node daemon SIGKILLed at each step of the preemption path (stasis/faults.py points
  slurm.*): the job runs on once with its state, or is requeued and resumes from a checkpoint;
  never both, never neither, nothing frozen;
- the daemon's database write-locked by another process through a preemption: the stop is
  carried out all the same (checkpoint, kill, requeue), its states written once the lock goes;
  the resumed run's checkpoints name the one it resumed from as their parent.

The store is the local cluster's shared directory; "unreachable" is that directory gone with a
file in its place (a mount gone bad): every read of it fails, nothing looks empty.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stasis.client import Client
from stasis.dev import slurmcluster
from stasis.slurm import held
from tests.e2e.conftest import Cluster, alive, until

# A counter that ends cleanly (exit 0) on SIGTERM, as many applications do.
TRAPPER = """\
import signal, sys, time
def stop(*_):
    print("trapped", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
for i in range(int(sys.argv[1])):
    print(i, flush=True)
    time.sleep(float(sys.argv[2]))
print("done", flush=True)
"""
STORE_WAIT_S = 3


def _config(c: Cluster, extra: str = "") -> None:
    """The node daemon's config with `extra` lines (and a short store wait); daemon restarted."""
    conf = c.lay.stasis_config
    base = conf.with_name("config.base.toml")
    if not base.exists():
        base.write_text(conf.read_text())
    conf.write_text(base.read_text() + f"store_wait_s = {STORE_WAIT_S}\n" + extra)
    slurmcluster.stop_daemon(c.root)
    slurmcluster.start_daemon(c.root)


def _daemon_alive(c: Cluster) -> bool:
    return bool(slurmcluster.status(c.root)["daemons"].get("stasis"))


@pytest.fixture(scope="module")
def fc(cluster: Cluster) -> Iterator[Cluster]:
    (cluster.work / "trapper.py").write_text(TRAPPER)
    _config(cluster)
    yield cluster


def cut_store(c: Cluster) -> None:
    os.rename(c.lay.store, c.lay.store.with_name("store.cut"))
    c.lay.store.write_text("the store's mount is gone\n")


def mend_store(c: Cluster) -> None:
    c.lay.store.unlink()
    os.rename(c.lay.store.with_name("store.cut"), c.lay.store)


def ids(c: Cluster, label: str) -> list[str]:
    return [str(m["id"]) for m in c.checkpoints(label)]


def trapper(c: Cluster, name: str, stop: int = 60) -> str:
    script = c.script(
        name,
        f"exec python3 -u {c.work}/trapper.py {stop} 0.5",
        f"--output={c.work}/{name}-%j.out",
        f"--export=STASIS_ENABLE=1,STASIS_CHECKPOINT={name}",
    )
    return c.sbatch(script)


def numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^(\d+)$", text, re.M)]


def resumed_in_order(text: str) -> None:
    """The counter never started again from 0, and each run after the first goes on by one from
    a value the run before reached (it resumed from a checkpoint, not from nothing, and no two
    runs printed side by side)."""
    assert numbers(text).count(0) == 1, text
    runs = [numbers(part) for part in re.split(r"^slurmstepd.*$", text, flags=re.M)]
    runs = [r for r in runs if r]
    for before, run in zip(runs, runs[1:]):
        assert run == list(range(run[0], run[0] + len(run))), text
        assert 0 < run[0] <= before[-1] + 1, text


def test_exit_0_after_a_failed_stop_checkpoint_keeps_the_label(fc: Cluster) -> None:
    job = trapper(fc, "trapper")
    fc.wait_number(job, 2)
    fc.stasis("dump", "--slurm-job", job, "--leave-running")
    kept = ids(fc, "trapper")
    assert len(kept) == 1
    cut_store(fc)
    try:
        # Preemption (or the time limit) ahead: the stop checkpoint fails, the store is gone.
        fc.run("scancel", "-b", "-s", "URG", job)
        until(lambda: "checkpoint failed" in fc.output(job), 60, "the stop checkpoint to fail")
    finally:
        mend_store(fc)
    # Grace time over: Slurm's SIGTERM; the application ends cleanly, exit 0.
    fc.run("scancel", "-b", "-s", "TERM", job)
    fc.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 60)
    out = fc.output(job)
    assert "trapped" in out, out
    assert "retired" not in out, out
    assert ids(fc, "trapper") == kept, "the checkpoint the next run needs was retired"


def test_a_finish_report_without_exit_status_retires_nothing(fc: Cluster) -> None:
    job = trapper(fc, "nostatus")
    fc.wait_number(job, 2)
    fc.stasis("dump", "--slurm-job", job, "--leave-running")
    kept = ids(fc, "nostatus")
    try:
        with Client(fc.lay.stasis_socket, 20.0) as client:
            answer = client.request("POST", f"/slurm/jobs/{job}/finish", {})
        assert answer == {"retired": []}
        assert ids(fc, "nostatus") == kept
    finally:
        fc.run("scancel", job)


def _held(c: Cluster, job: str, why: str) -> dict[str, str]:
    def held() -> dict[str, str] | None:
        j = c.job(job)
        return j if j.get("JobState") == "PENDING" and why in j.get("Comment", "") else None

    return until(held, 90, f"job {job} requeued held ({why})")


def test_cannot_tell_holds_the_job_instead_of_starting_over(fc: Cluster) -> None:
    job = trapper(fc, "unsure", stop=80)
    fc.wait_number(job, 3)
    fc.stasis("dump", "--slurm-job", job, "--leave-running")
    kept = ids(fc, "unsure")
    # The store is unreachable when the job starts again.
    cut_store(fc)
    try:
        fc.run("scontrol", "requeue", job)
        j = _held(fc, job, "store unreachable")
        assert "Held" in j.get("Reason", "") or j.get("Priority") == "0", j
        out = fc.output(job)
        assert numbers(out).count(0) == 1, f"the job started over:\n{out}"
        # Its output says why (written before the requeue, which kills the batch step).
        assert "checkpoint store unreachable" in out and "requeued held" in out, out
    finally:
        mend_store(fc)
    assert ids(fc, "unsure") == kept
    # Nobody releases it: the node that held it does, once the store answers again.
    until(
        lambda: fc.output(job).count("stasis: restored checkpoint") == 1,
        90,
        "the job to be released and to resume",
    )
    fc.wait_number(job, numbers(fc.output(job))[-1] + 2)
    # The node daemon is down when it starts again: the same.
    slurmcluster.stop_daemon(fc.root)
    try:
        fc.run("scontrol", "requeue", job)
        _held(fc, job, "node daemon")
        out = fc.output(job)
        assert numbers(out).count(0) == 1
        assert "node daemon does not answer" in out, out
        time.sleep(held.RECHECK_S + 1)
        assert fc.job(job).get("JobState") == "PENDING"
    finally:
        slurmcluster.start_daemon(fc.root)
    until(
        lambda: fc.output(job).count("stasis: restored checkpoint") == 2,
        90,
        "the job to be released once its node daemon is back, and to resume again",
    )
    fc.wait_number(job, numbers(fc.output(job))[-1] + 2)
    fc.run("scancel", job)
    resumed_in_order(fc.output(job))


def test_a_user_cannot_have_the_daemon_release_a_job_held_by_someone_else(
    fc: Cluster, test_user: Any
) -> None:
    """The daemon releases only what its node held (its own root-owned notes), never a job whose
    Comment merely says so: an admin's hold stays an admin's hold."""
    # Not eligible before an hour: still pending when root holds it (a free node would start it).
    job = fc.sbatch(
        fc.counter_script("adminheld", stop=30), "--begin=now+1hour", user=test_user.pw_name
    )
    fc.run("scontrol", "hold", job)  # root: an admin's hold
    fc.run(
        "scontrol",
        "update",
        f"JobId={job}",
        "Comment=stasis: held: checkpoint store unreachable",
        user=test_user.pw_name,
    )
    time.sleep(held.RECHECK_S * 2 + 1)
    j = fc.job(job)
    assert j.get("JobState") == "PENDING" and j.get("Priority") == "0", j
    fc.run("scancel", job)


def test_fresh_when_asked_even_if_the_store_is_unreachable(fc: Cluster) -> None:
    """STASIS_FRESH=1: the user accepts a start from the beginning when stasis cannot tell."""
    script = fc.script(
        "freshly",
        f"exec python3 -u {fc.work}/trapper.py 60 0.5",
        f"--output={fc.work}/freshly-%j.out",
        "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=freshly,STASIS_FRESH=1",
    )
    cut_store(fc)
    try:
        job = fc.sbatch(script)
        fc.wait_number(job, 1)
        assert "store" in fc.output(job)
    finally:
        mend_store(fc)
        fc.run("scancel", job, check=False)


def test_daemon_down_with_nothing_to_resume_runs_unprotected_and_says_so(fc: Cluster) -> None:
    """Nothing to lose (the store lists no checkpoint of the label): after the wait the job runs,
    unprotected, and says so in its output and its Comment."""
    script = fc.script(
        "bare",
        f"exec python3 -u {fc.work}/trapper.py 60 0.5",
        f"--output={fc.work}/bare-%j.out",
        "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=bare",
    )
    slurmcluster.stop_daemon(fc.root)
    try:
        job = fc.sbatch(script)
        fc.wait_number(job, 1)
        assert "WITHOUT checkpoint protection" in fc.output(job)
        assert "WITHOUT checkpoint protection" in fc.job(job).get("Comment", "")
    finally:
        slurmcluster.start_daemon(fc.root)
        fc.run("scancel", job, check=False)


@pytest.mark.parametrize(
    "point", ["slurm.checkpoint-asked", "slurm.after-publish", "slurm.before-requeue"]
)
def test_daemon_killed_in_the_preemption_sequence(fc: Cluster, point: str) -> None:
    name = "pre-" + point.split(".")[1]
    _config(fc, f"test_fault_points = [{point!r}]\n".replace("'", '"'))
    try:
        job = trapper(fc, name, stop=30)
        fc.wait_number(job, 3)
        fc.run("scancel", "-b", "-s", "URG", job)  # what Slurm sends at preemption
        until(lambda: not _daemon_alive(fc), 60, f"the daemon to die at {point}")
    finally:
        _config(fc)  # started again, disarmed
    # Nothing stays frozen once the daemon is back.
    time.sleep(3)
    for pid in fc.pids(job):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        assert state not in ("T", "t"), f"process {pid} of job {job} is left stopped"
    fc.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 180)
    out = fc.output(job)
    j = fc.job(job)
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0", (j, out)
    # Runs once with its state, or resumed from its checkpoint: never from 0 again, never two
    # runs printing side by side.
    resumed_in_order(out)
    assert sorted(set(numbers(out))) == list(range(30)), out
    assert "\ndone\n" in out, out


def _frozen(pids: list[int]) -> list[int]:
    found = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state in ("T", "t"):
            found.append(pid)
    return found


def test_a_preemption_while_the_database_is_locked_stops_requeues_and_resumes(fc: Cluster) -> None:
    """Another process (an admin's sqlite3, a backup) holds the daemon's database write lock
    through a preemption: the stop checkpoint is taken, the job killed at it (never left
    SIGSTOPped) and requeued, nobody reads SQLAlchemy's text; the run it resumes in names that
    checkpoint as its checkpoints' parent (lineage, not clocks)."""
    _config(fc, "db_busy_timeout_s = 1\n")
    try:
        job = trapper(fc, "dblocked", stop=40)
        fc.wait_number(job, 3)
        pids = fc.pids(job)
        holder = sqlite3.connect(
            fc.lay.stasis / "state" / "jobs.db", isolation_level=None, timeout=0
        )
        try:
            holder.execute("BEGIN IMMEDIATE")
            fc.run("scancel", "-b", "-s", "URG", job)  # what Slurm sends at preemption
            until(lambda: ids(fc, "dblocked"), 60, "the stop checkpoint")
            until(lambda: not [p for p in pids if alive(p)], 30, "the stopped job to end")
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        (stop,) = ids(fc, "dblocked")
        until(
            lambda: "stasis: restored checkpoint" in fc.output(job),
            120,
            "the requeued job to resume",
        )
        assert not _frozen(fc.pids(job))
        fc.wait_number(job, numbers(fc.output(job))[-1] + 1)
        child = fc.stasis("dump", "--slurm-job", job, "--leave-running", "--json")
        checkpoint = json.loads(child.stdout)["checkpoint"]
        parents = {c["id"]: c.get("parent") for c in fc.checkpoints("dblocked")}
        assert parents[checkpoint] == stop, parents
        fc.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 120)
        out = fc.output(job)
        assert "OperationalError" not in out and "sqlalchemy" not in out.lower(), out
        assert fc.job(job)["JobState"] == "COMPLETED", out
        resumed_in_order(out)
        assert sorted(set(numbers(out))) == list(range(40)) and "\ndone\n" in out, out
        assert not list(
            (fc.lay.stasis / "state" / "dumps").glob("*.json")
        ), "a dump's journal entry stays"
    finally:
        _config(fc)
