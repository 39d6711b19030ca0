"""`stasis slurm report` on a real local cluster with accounting (slurmdbd + MariaDB started by
`local-cluster up --accounting`): jobs run to produce each case at once, then the report's
numbers are checked against values computed here, by hand, from sacct's own records of them.

Each case runs under an account of its own, so each lands in a (user, account, partition) group
of its own:

    timeout   T1: --time=1 and 2 GPUs, runs until Slurm kills it (TIMEOUT, ~80 s: limits are
              checked periodically)
    resub     T2: the same, and R: same name and directory, started after T2 (afterany)
    mem       M: asks for 800 MiB, uses ~100 MiB for 15 s (sampled every 5 s)
    preempt   P: requeueable, preempted by H; starts over (its counter restarts at 0)
    stasis    S: opted in to stasis, runs its work in srun steps (one named, one failing, then
              the counter), preempted by H; checkpointed and restored (counter goes on); its
              steps are in sacct as Slurm records steps
    (root, root, high) H: the preemptor
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from stasis.dev import slurmaccounting
from tests.conftest import STASIS, TEST_USER, ensure_test_user
from tests.e2e.conftest import COUNTER, EARLY, Cluster, Early, close_cluster, until

# The module's jobs take ~2 min (the time-limit kill is checked only periodically): they start
# with the session (EARLY), and the first test's fixture waits for what is left of them.
pytestmark = pytest.mark.timeout(600)

NODE = "n1"
FIELDS = (
    "JobIDRaw,State,ElapsedRaw,NNodes,TimelimitRaw,ReqMem,TRESUsageInTot,Start,End," "AllocTRES"
)
ACCOUNTS = ("timeout", "resub", "mem", "preempt", "stasis")
HOG = "import time; x = bytearray(100 * 1024 * 1024); time.sleep(15)"


class AccountingCluster(Cluster):
    def up(self) -> None:
        self.start("--socket-group", TEST_USER, "--accounting", "--gpus", "2", timeout_s=180)
        self.work.mkdir(exist_ok=True)
        os.chmod(self.work, 0o777)
        (self.work / "counter.py").write_text(COUNTER)

    def report(self, *args: str, check: bool = True) -> Any:
        return self.stasis("slurm", "report", *args, check=check)


def records(c: Cluster, job: str) -> list[dict[str, str]]:
    """sacct's own records of `job` (every attempt, then its steps), as dicts."""
    out = c.run("sacct", "-a", "-D", "-n", "-P", "--noconvert", "-j", job, "-o", FIELDS).stdout
    names = FIELDS.split(",")
    return [dict(zip(names, line.split("|"))) for line in out.splitlines() if line]


def attempts(c: Cluster, job: str) -> list[dict[str, str]]:
    return [r for r in records(c, job) if "." not in r["JobIDRaw"]]


def node_hours(r: dict[str, str]) -> float:
    return int(r["NNodes"]) * int(r["ElapsedRaw"]) / 3600


TERMINAL = (
    "COMPLETED",
    "TIMEOUT",
    "FAILED",
    "CANCELLED",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
)


def _run_the_jobs(environ: dict[str, str]) -> dict[str, Any]:
    """Every case's job run to its end and recorded (minutes, nearly all of them waiting on
    Slurm's time-limit check): the module's early work (conftest.Early), so it runs while the
    modules before it do."""
    ensure_test_user()
    root = Path(tempfile.mkdtemp(prefix="stasis-e2e-report-"))
    os.chmod(root, 0o755)
    c = AccountingCluster(root, environ=environ)
    try:
        c.up()
        began = datetime.now().replace(microsecond=0) - timedelta(seconds=2)
        for account in ACCOUNTS:
            slurmaccounting.add_user(c.lay, TEST_USER, account)
        w = c.work
        out = f"--output={w}/%x-%j.out"
        jobs: dict[str, str] = {}

        def submit(key: str, *args: str, body: str) -> None:
            script = c.script(key, body, out, *args)
            jobs[key] = c.sbatch(script, user=TEST_USER if key != "H" else None)

        counter = f"exec python3 -u {w}/counter.py 25 1 0"
        submit(
            "P",
            "-A",
            "preempt",
            "-p",
            "low",
            "-c",
            "2",
            "-w",
            NODE,
            "--requeue",
            "--open-mode=append",
            body=counter,
        )
        submit(
            "S",
            "-A",
            "stasis",
            "-p",
            "low",
            "-c",
            "2",
            "-w",
            NODE,
            "--export=ALL,STASIS_ENABLE=1",
            body=f"srun -J first bash -c 'echo first'\n"
            f"srun bash -c 'exit 3' || echo failed as planned\n"
            f"srun python3 -u {w}/counter.py 25 1 0",
        )
        submit(
            "T1", "-A", "timeout", "-p", "high", "--time=1", "--gres=gpu:2", body="exec sleep 600"
        )
        submit("T2", "-A", "resub", "-p", "high", "--time=1", "-J", "sim", body="exec sleep 600")
        jobs["R"] = c.sbatch(
            c.script(
                "R",
                "sleep 3",
                out,
                "-A",
                "resub",
                "-p",
                "high",
                "-J",
                "sim",
                f"--dependency=afterany:{jobs['T2']}",
            ),
            user=TEST_USER,
        )
        submit("M", "-A", "mem", "-p", "high", "--mem=800", body=f"exec python3 -c '{HOG}'")
        c.wait_number(jobs["P"], 4)
        c.wait_number(jobs["S"], 4)
        # 5 CPUs on n1: only both low jobs (2 + 2) and the one free CPU make room.
        submit("H", "-p", "high", "-c", "5", "-w", NODE, body="sleep 3")
        until(lambda: not c.run("squeue", "-h", "-o", "%i").stdout.strip(), 240, "every job to end")

        def recorded() -> bool:
            for key, job in jobs.items():
                last = attempts(c, job)[-1:]
                if (
                    not last
                    or last[0]["State"].split()[0] not in TERMINAL
                    or last[0]["End"] in ("", "Unknown")
                ):
                    return False
            return True

        until(recorded, 60, "slurmdbd to record every job's end")
        ended = datetime.now().replace(microsecond=0) + timedelta(seconds=2)
        return {"cluster": c, "jobs": jobs, "began": began, "ended": ended}
    except BaseException:
        close_cluster(c)
        raise


JOBS = Early(_run_the_jobs, lambda run: close_cluster(run["cluster"]))
EARLY["test_slurm_report.py"] = JOBS


@pytest.fixture(scope="module")
def run() -> Iterator[dict[str, Any]]:
    try:
        yield JOBS.take(570)
    finally:
        JOBS.close()


def period(run: dict[str, Any]) -> list[str]:
    return ["--since", run["began"].isoformat(), "--until", run["ended"].isoformat()]


@pytest.fixture(scope="module")
def report(run: dict[str, Any]) -> dict[str, Any]:
    c = run["cluster"]
    data: dict[str, Any] = json.loads(c.report(*period(run), "--json").stdout)
    return data


def group(report: dict[str, Any], user: str, account: str, partition: str) -> dict[str, Any]:
    found = [
        g
        for g in report["groups"]
        if (g["user"], g["account"], g["partition"]) == (user, account, partition)
    ]
    assert len(found) == 1, report["groups"]
    one: dict[str, Any] = found[0]
    return one


def test_timeout(run: dict[str, Any], report: dict[str, Any]) -> None:
    c = run["cluster"]
    [t1] = attempts(c, run["jobs"]["T1"])
    assert t1["State"] == "TIMEOUT" and int(t1["ElapsedRaw"]) >= 60
    g = group(report, TEST_USER, "timeout", "high")
    assert (g["jobs"], g["timeout_jobs"], g["resubmitted_jobs"]) == (1, 1, 0)
    assert g["timeout_node_hours"] == pytest.approx(node_hours(t1), abs=1e-12)
    over_s = int(t1["ElapsedRaw"]) - 60 * int(t1["TimelimitRaw"])
    assert g["timeout_overshoot_node_hours"] == pytest.approx(over_s / 3600, abs=1e-12)
    # Slurm's own count of the GPUs the job held (the local cluster's stand-in GPUs).
    assert "gres/gpu=2" in t1["AllocTRES"].split(","), t1["AllocTRES"]
    gpu_hours = 2 * int(t1["ElapsedRaw"]) / 3600
    assert g["timeout_gpu_hours"] == pytest.approx(gpu_hours, abs=1e-12)
    assert g["gpu_hours"] == pytest.approx(gpu_hours, abs=1e-12)
    assert group(report, TEST_USER, "resub", "high")["timeout_gpu_hours"] == 0
    assert report["totals"]["timeout_jobs"] == 2
    assert report["totals"]["timeout_gpu_hours"] == pytest.approx(gpu_hours, abs=1e-12)


def test_resubmission_after_timeout(run: dict[str, Any], report: dict[str, Any]) -> None:
    c = run["cluster"]
    [t2] = attempts(c, run["jobs"]["T2"])
    [r] = attempts(c, run["jobs"]["R"])
    assert t2["State"] == "TIMEOUT" and r["State"] == "COMPLETED"
    assert r["Start"] >= t2["End"]
    g = group(report, TEST_USER, "resub", "high")
    assert (g["jobs"], g["timeout_jobs"], g["resubmitted_jobs"]) == (2, 1, 1)
    assert g["timeout_node_hours"] == pytest.approx(node_hours(t2), abs=1e-12)
    # R redoes at most what T2 ran, and at most what R itself ran: here R's 3 s.
    assert g["resubmit_redone_node_hours"] == pytest.approx(
        min(node_hours(r), node_hours(t2)), abs=1e-12
    )
    assert g["resubmit_redone_node_hours"] > 0
    assert g["node_hours"] == pytest.approx(node_hours(t2) + node_hours(r), abs=1e-12)


def test_memory_over_request(run: dict[str, Any], report: dict[str, Any]) -> None:
    c = run["cluster"]
    recs = records(c, run["jobs"]["M"])
    [job] = [r for r in recs if "." not in r["JobIDRaw"]]
    peaks = [
        int(m.group(1))
        for r in recs
        if "." in r["JobIDRaw"]
        for m in [re.search(r"(?:^|,)mem=(\d+)(?:,|$)", r["TRESUsageInTot"])]
        if m
    ]
    peak = max(peaks)
    requested = 800 * 1024 * 1024
    assert job["ReqMem"] == "800M"
    assert 100 * 1024 * 1024 <= peak < requested / 2, peak
    g = group(report, TEST_USER, "mem", "high")
    assert (g["mem_measured_jobs"], g["mem_overrequest_jobs"]) == (1, 1)
    assert (g["mem_requested_bytes"], g["mem_peak_bytes"]) == (requested, peak)
    assert g["mem_blocked_node_hours"] == pytest.approx(
        node_hours(job) * (requested - peak) / requested, abs=1e-12
    )
    assert g["mem_blocked_node_hours"] > 0


def test_preempted_without_stasis_is_redone(run: dict[str, Any], report: dict[str, Any]) -> None:
    c = run["cluster"]
    recs = attempts(c, run["jobs"]["P"])
    # Preempted once or more: Slurm 24.11 (Debian 13) may start the requeued P again while H
    # still waits for S's checkpoint (its grace time), and H then preempts it once more.
    preempted = len(recs) - 1
    assert preempted >= 1, recs
    assert [r["State"] for r in recs] == ["PREEMPTED"] * preempted + ["COMPLETED"], recs
    numbers = c.numbers(run["jobs"]["P"])
    assert numbers.count(0) == preempted + 1, numbers  # it started over each time
    g = group(report, TEST_USER, "preempt", "low")
    assert (g["jobs"], g["preempted_jobs"], g["protected_jobs"]) == (1, 1, 0)
    assert g["preempt_redone_node_hours"] == pytest.approx(
        sum(map(node_hours, recs[:-1])), abs=1e-12
    )
    assert g["preempt_redone_node_hours"] > 0 and g["kept_node_hours"] == 0
    assert g["node_hours"] == pytest.approx(sum(map(node_hours, recs)), abs=1e-12)


def test_preempted_with_stasis_is_kept(run: dict[str, Any], report: dict[str, Any]) -> None:
    c = run["cluster"]
    recs = attempts(c, run["jobs"]["S"])
    assert len(recs) == 2 and recs[-1]["State"] == "COMPLETED", recs
    assert recs[0]["State"] in ("REQUEUED", "PREEMPTED")
    numbers = c.numbers(run["jobs"]["S"])
    # Restored: it went on from its checkpoint, never from 0 again.
    assert numbers.count(0) == 1 and sorted(set(numbers)) == list(range(25)), numbers
    g = group(report, TEST_USER, "stasis", "low")
    assert (g["jobs"], g["preempted_jobs"], g["protected_jobs"]) == (1, 1, 1)
    assert g["kept_node_hours"] == pytest.approx(node_hours(recs[0]), abs=1e-12)
    assert g["kept_node_hours"] > 0 and g["preempt_redone_node_hours"] == 0


def test_steps_stasis_ran_are_in_sacct_as_slurm_records_steps(run: dict[str, Any]) -> None:
    """S's steps ran inside its tree (our srun), yet sacct lists them run by run: the first run's
    three (the counter's cut by the requeue), the restored run's one (the counter step, which
    resumed: the steps that had ended are not run, nor listed, again)."""
    c = run["cluster"]
    out = c.run(
        "sacct",
        "-a",
        "-D",
        "-n",
        "-P",
        "-j",
        run["jobs"]["S"],
        "-o",
        "JobIDRaw,JobName,State,ExitCode,NTasks",
    ).stdout
    runs: list[list[tuple[str, ...]]] = []
    for line in out.splitlines():
        job_step, name, state, code, ntasks = line.split("|")
        if "." not in job_step:
            runs.append([])
        elif job_step.split(".")[1].isdigit():
            runs[-1].append((job_step.split(".")[1], name, state.split()[0], code, ntasks))
    assert len(runs) == 2, out
    assert runs[0][:2] == [
        ("0", "first", "COMPLETED", "0:0", "1"),
        ("1", "bash", "FAILED", "3:0", "1"),
    ], out
    assert runs[0][2][:2] == ("2", "python3") and runs[0][2][2] == "CANCELLED", out
    assert runs[1] == [("0", "python3", "COMPLETED", "0:0", "1")], out
    assert "failed as planned" in c.output(run["jobs"]["S"])


def test_totals_weeks_and_groups_agree(run: dict[str, Any], report: dict[str, Any]) -> None:
    c = run["cluster"]
    every = [a for job in run["jobs"].values() for a in attempts(c, job)]
    t = report["totals"]
    assert t["jobs"] == len(run["jobs"]) == 7
    assert t["node_hours"] == pytest.approx(sum(map(node_hours, every)), abs=1e-9)
    assert sum(w["node_hours"] for w in report["weeks"]) == pytest.approx(t["node_hours"])
    assert sum(g["jobs"] for g in report["groups"]) == 7
    h = group(report, "root", "root", "high")
    assert (h["jobs"], h["timeout_jobs"], h["preempted_jobs"]) == (1, 0, 0)


def test_csv_and_table_say_the_same(run: dict[str, Any], report: dict[str, Any]) -> None:
    c = run["cluster"]
    rows = list(csv.DictReader(io.StringIO(c.report(*period(run), "--csv").stdout)))
    assert [(r["user"], r["account"], r["partition"]) for r in rows] == [
        (g["user"], g["account"], g["partition"]) for g in report["groups"]
    ]
    for r, g in zip(rows, report["groups"]):
        assert float(r["timeout_node_hours"]) == pytest.approx(g["timeout_node_hours"])
        assert int(r["preempted_jobs"]) == g["preempted_jobs"]
    text = c.report(*period(run)).stdout
    assert "TIMEOUT: 2 jobs" in text
    assert "resubmitted after a TIMEOUT: 1 jobs" in text
    for account in ACCOUNTS:
        assert re.search(rf"^{re.escape(TEST_USER)}\s+{account}\s", text, re.M), text


def test_html_page(run: dict[str, Any], tmp_path: Path) -> None:
    c = run["cluster"]
    page = tmp_path / "report.html"
    result = c.report(*period(run), "--html", str(page))
    assert "wrote" in result.stdout and "7 jobs" in result.stdout
    html = page.read_text()
    for svg in ("where", "users", "partitions", "trend"):
        assert f'<svg id="{svg}"' in html
    assert TEST_USER in html and "<script" not in html and "http" not in html.split("</head>")[1]


def test_period_outside_the_jobs_is_empty(run: dict[str, Any]) -> None:
    c = run["cluster"]
    before = run["began"] - timedelta(days=2)
    data = json.loads(
        c.report(
            "--since", before.date().isoformat(), "--until", run["began"].isoformat(), "--json"
        ).stdout
    )
    assert data["totals"]["jobs"] == 0 and data["groups"] == []
    # An --until of its own: `ended` is 2 s ahead of the jobs' end, and on a fast machine this
    # test runs before the clock gets there (the default --until, now, was then before --since).
    after = run["ended"] + timedelta(hours=1)
    data = json.loads(
        c.report("--since", run["ended"].isoformat(), "--until", after.isoformat(), "--json").stdout
    )
    assert data["totals"]["jobs"] == 0


def test_bad_dates_are_one_line(run: dict[str, Any]) -> None:
    c = run["cluster"]
    for args in (
        ["--since", "yesterday"],
        ["--until", "2024-02-30"],
        ["--since", "2024-05-02", "--until", "2024-05-01"],
    ):
        result = c.report(*args, check=False)
        assert result.returncode == 2, result
        assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith("stasis: error: --")


def test_unreachable_slurmdbd_is_one_line(run: dict[str, Any], tmp_path: Path) -> None:
    c = run["cluster"]
    conf = re.sub(
        r"(?m)^AccountingStoragePort=\d+$", "AccountingStoragePort=1", c.lay.slurm_conf.read_text()
    )
    assert "AccountingStoragePort=1\n" in conf
    (tmp_path / "slurm.conf").write_text(conf)
    started = time.monotonic()
    result = c.run(STASIS, "slurm", "report", check=False)  # the real one answers
    assert result.returncode == 0, result.stderr
    env = {**c.env, "SLURM_CONF": str(tmp_path / "slurm.conf")}
    result = subprocess.run(
        [STASIS, "slurm", "report"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "cannot read Slurm's accounting" in result.stderr
    assert time.monotonic() - started < 60
