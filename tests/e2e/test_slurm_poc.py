"""`stasis slurm poc` and the payoff columns of `stasis slurm report` on a real local cluster with
accounting (slurmdbd + MariaDB, `local-cluster up --accounting`, 4 CPUs), on a history made here
and checked against sacct's own records, read here.

    before the start (the baseline; account `poc` is the opted-in set)
        Ta  --time=1, killed at its limit (TIMEOUT), and Ra after it (same name: a resubmission)
        Ma  asks for 800 MiB, uses ~100 MiB (a memory over-request)
        Pa  requeueable in `low`, preempted by root's Ha in `high`: starts over
    `stasis slurm poc start --accounts poc`
    after it
        Fb  exits 3 (FAILED: an exception)
        Sb  protected by stasis (account poc), Ub not protected (account ctl), both in `low`,
            both preempted by root's Hb: Sb resumes from its checkpoint, Ub starts over

The pages (`slurm report --html`, `slurm poc report --html`) are opened in Debian's headless
chromium and screenshotted under build/test-artifacts/slurm-report/ (STASIS_TEST_ARTIFACTS).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from stasis.config import Settings, load_settings
from stasis.dev import slurmaccounting
from stasis.interval import choose, mtbi_s
from tests.conftest import TEST_USER, ensure_test_user
from tests.e2e.conftest import COUNTER, EARLY, Cluster, Early, close_cluster, until

pytestmark = pytest.mark.timeout(600)

NODE = "n1"
FIELDS = "JobIDRaw,Account,Partition,State,Submit,Start,End,ElapsedRaw,NNodes,AdminComment"
HOG = "import time; x = bytearray(100 * 1024 * 1024); time.sleep(15)"
COST_S = 10.0  # stasis.slurm.payoff.DEFAULT_COST_S: none is measured here (no job asks auto)
ARTIFACTS = (
    Path(
        os.environ.get("STASIS_TEST_ARTIFACTS")
        or Path(__file__).resolve().parents[2] / "build" / "test-artifacts"
    )
    / "slurm-report"
)
UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
TERMINAL = ("COMPLETED", "TIMEOUT", "FAILED", "CANCELLED", "PREEMPTED", "OUT_OF_MEMORY")


class PocCluster(Cluster):
    def up(self) -> None:
        self.start("--socket-group", TEST_USER, "--accounting", "--cpus", "4", timeout_s=180)
        self.work.mkdir(exist_ok=True)
        os.chmod(self.work, 0o777)
        (self.work / "counter.py").write_text(COUNTER)


def records(c: Cluster, *jobs: str) -> list[dict[str, str]]:
    """sacct's own job records (every attempt, no steps) of `jobs`."""
    out = c.run(
        "sacct", "-a", "-D", "-X", "-n", "-P", "--noconvert", "-j", ",".join(jobs), "-o", FIELDS
    ).stdout
    names = FIELDS.split(",")
    return [dict(zip(names, line.split("|", len(names) - 1))) for line in out.splitlines() if line]


def node_hours(r: dict[str, str]) -> float:
    return int(r["NNodes"]) * int(r["ElapsedRaw"]) / 3600


def _ended(c: Cluster, jobs: dict[str, str]) -> None:
    until(lambda: not c.run("squeue", "-h", "-o", "%i").stdout.strip(), 240, "every job to end")

    def recorded() -> bool:
        for job in jobs.values():
            last = records(c, job)[-1:]
            if (
                not last
                or last[0]["State"].split()[0] not in TERMINAL
                or last[0]["End"]
                in (
                    "",
                    "Unknown",
                )
            ):
                return False
        return True

    until(recorded, 60, "slurmdbd to record every job's end")


def _history(environ: dict[str, str]) -> dict[str, Any]:
    ensure_test_user()
    root = Path(tempfile.mkdtemp(prefix="stasis-e2e-poc-"))
    os.chmod(root, 0o755)
    c = PocCluster(root, environ=environ)
    try:
        c.up()
        began = datetime.now().replace(microsecond=0) - timedelta(seconds=2)
        for account in ("poc", "ctl"):
            slurmaccounting.add_user(c.lay, TEST_USER, account)
        w = c.work
        out = f"--output={w}/%x-%j.out"
        jobs: dict[str, str] = {}

        def submit(key: str, *args: str, body: str, root_job: bool = False) -> None:
            jobs[key] = c.sbatch(
                c.script(key, body, out, *args), user=None if root_job else TEST_USER
            )

        # Long enough to be preempted (GraceTime) rather than end meanwhile, short once rerun.
        rerun = (
            f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then exec python3 -u {w}/counter.py 60 1 0; '
            f"else exec python3 -u {w}/counter.py 3 1 0; fi"
        )
        protected = f"exec python3 -u {w}/counter.py 30 1 0"

        def preempted(*keys: str) -> None:
            until(
                lambda: all(
                    any(r["State"] in ("PREEMPTED", "REQUEUED") for r in records(c, jobs[k]))
                    for k in keys
                ),
                90,
                f"{', '.join(keys)} preempted (in sacct)",
            )

        # -- the baseline --------------------------------------------------------------------
        submit("Ta", "-A", "poc", "-p", "high", "--time=1", "-J", "sim", body="exec sleep 600")
        submit("Ma", "-A", "poc", "-p", "high", "--mem=800", body=f"exec python3 -c '{HOG}'")
        submit(
            "Pa",
            "-A",
            "poc",
            "-p",
            "low",
            "-c",
            "2",
            "--requeue",
            "--open-mode=append",
            body=rerun,
        )
        submit(
            "Ra",
            "-A",
            "poc",
            "-p",
            "high",
            "-J",
            "sim",
            f"--dependency=afterany:{jobs['Ta']}",
            body="sleep 2",
        )
        c.wait_number(jobs["Pa"], 3)
        submit("Ha", "-p", "high", "-c", "2", "-w", NODE, body="sleep 2", root_job=True)
        preempted("Pa")
        _ended(c, jobs)
        # -- the start -----------------------------------------------------------------------
        started = c.stasis("slurm", "poc", "start", "--accounts", "poc", "--baseline-days", "1")
        # The start is the next whole second (sacct's resolution): a job that ends before it is
        # the baseline's, so the jobs after it are submitted once that second has come.
        state = json.loads((load_settings(c.env).state_dir / "slurm-poc.json").read_text())
        until(
            lambda: datetime.now() >= datetime.fromisoformat(state["started"]),
            5,
            "the PoC's start",
        )
        # -- after it ------------------------------------------------------------------------
        submit("Fb", "-A", "poc", "-p", "high", body="exit 3")
        submit(
            "Sb",
            "-A",
            "poc",
            "-p",
            "low",
            "-c",
            "2",
            "--export=ALL,STASIS_ENABLE=1",
            body=protected,
        )
        submit(
            "Ub",
            "-A",
            "ctl",
            "-p",
            "low",
            "-c",
            "2",
            "--requeue",
            "--open-mode=append",
            body=rerun,
        )
        c.wait_number(jobs["Sb"], 3)
        c.wait_number(jobs["Ub"], 3)
        submit("Hb", "-p", "high", "-c", "4", "-w", NODE, body="sleep 2", root_job=True)
        preempted("Sb", "Ub")
        _ended(c, jobs)
        ended = datetime.now().replace(microsecond=0) + timedelta(seconds=2)
        return {
            "cluster": c,
            "jobs": jobs,
            "began": began,
            "ended": ended,
            "started": started.stdout,
        }
    except BaseException:
        close_cluster(c)
        raise


HISTORY = Early(_history, lambda run: close_cluster(run["cluster"]))
EARLY["test_slurm_poc.py"] = HISTORY


@pytest.fixture(scope="module")
def run() -> Iterator[dict[str, Any]]:
    try:
        yield HISTORY.take(570)
    finally:
        HISTORY.close()


def settings_of(c: Cluster) -> Settings:
    """The settings `stasis` reads on this cluster (its node's config)."""
    return load_settings(c.env)


def poc_json(run: dict[str, Any], what: str, *args: str) -> dict[str, Any]:
    c = run["cluster"]
    until_at = run["ended"].isoformat()
    extra = ("--until", until_at) if what == "report" else ()
    data: dict[str, Any] = json.loads(
        c.stasis("slurm", "poc", what, *extra, *args, "--json").stdout
    )
    return data


def test_baseline_is_what_sacct_says(run: dict[str, Any]) -> None:
    c, jobs = run["cluster"], run["jobs"]
    assert "PoC started" in run["started"] and "accounts poc" in run["started"]
    state_file = settings_of(c).state_dir / "slurm-poc.json"
    st = os.stat(state_file, follow_symlinks=False)
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o644)
    state = json.loads(state_file.read_text())
    b = state["baseline"]
    ta, ra, ma = (records(c, jobs[k]) for k in ("Ta", "Ra", "Ma"))
    pa = records(c, jobs["Pa"])
    assert [r["State"] for r in ta] == ["TIMEOUT"] and ra[0]["Start"] >= ta[0]["End"]
    assert [r["State"].split()[0] for r in pa][-1] == "COMPLETED" and len(pa) >= 2
    assert all(r["State"] == "PREEMPTED" for r in pa[:-1]), pa
    # Account poc's four jobs (root's Ha is outside the set).
    assert b["jobs"] == 4 and b["timeout_jobs"] == 1 and b["preempted_jobs"] == 1
    assert b["resubmitted_jobs"] == 1
    # Ma asked 8 times what it used; the others asked for the default and used less yet.
    assert b["mem_overrequest_jobs"] == over_requests(
        c, *(jobs[k] for k in ("Ta", "Ra", "Ma", "Pa"))
    )
    assert b["mem_overrequest_jobs"] >= 1
    redone = sum(map(node_hours, pa[:-1])) + min(node_hours(ra[0]), node_hours(ta[0]))
    assert b["redone_node_hours"] == pytest.approx(redone, abs=1e-9)
    assert b["timeout_node_hours"] == pytest.approx(node_hours(ta[0]), abs=1e-9)
    every = ta + ra + ma + pa
    assert b["node_hours"] == pytest.approx(sum(map(node_hours, every)), abs=1e-9)
    assert state["scope"]["accounts"] == ["poc"] and state["thresholds"] == {
        "completion_increase_pct": 10.0,
        "queue_wait_increase_s": 300.0,
        "exceptions_increase_pct": 1.0,
    }
    # A second start is refused, in one line, the first one kept.
    again = c.stasis("slurm", "poc", "start", "--accounts", "x", check=False)
    assert again.returncode == 2 and len(again.stderr.splitlines()) == 1, again.stderr
    assert "already recorded" in again.stderr and "--force" in again.stderr
    assert json.loads(state_file.read_text()) == state


def over_requests(c: Cluster, *jobs: str) -> int:
    """Jobs with an attempt whose peak memory (the largest TRESUsageInTot mem of its steps)
    is under half of its ReqMem, from sacct's lines."""
    out = c.run(
        "sacct",
        "-a",
        "-D",
        "-n",
        "-P",
        "--noconvert",
        "-j",
        ",".join(jobs),
        "-o",
        "JobIDRaw,ReqMem,TRESUsageInTot",
    ).stdout
    over: set[str] = set()
    attempts: list[list[Any]] = []  # [job id, requested bytes, peak bytes]
    for line in out.splitlines():
        job_step, req, usage = line.split("|")
        if "." not in job_step:
            m = re.fullmatch(r"(\d+)([KMG]?)", req)
            assert m, req
            attempts.append([job_step, int(m.group(1)) * UNITS[m.group(2)], 0])
        elif attempts:
            found = re.search(r"(?:^|,)mem=(\d+)", usage)
            if found:
                attempts[-1][2] = max(attempts[-1][2], int(found.group(1)))
    for job, requested, peak in attempts:
        if peak and peak * 2 < requested:
            over.add(job)
    return len(over)


def completion_s(recs: list[dict[str, str]]) -> float:
    first, last = recs[0], recs[-1]
    return (
        datetime.fromisoformat(last["End"]) - datetime.fromisoformat(first["Submit"])
    ).total_seconds()


def test_report_since_the_start_is_what_sacct_says(run: dict[str, Any]) -> None:
    c, jobs = run["cluster"], run["jobs"]
    data = poc_json(run, "report")
    sb, ub, fb = (records(c, jobs[k]) for k in ("Sb", "Ub", "Fb"))
    assert "stasis-token=" in sb[0]["AdminComment"] and "stasis-token=" not in ub[0]["AdminComment"]
    assert len(sb) == 2 and sb[0]["State"] in ("REQUEUED", "PREEMPTED"), sb
    assert [r["State"] for r in fb] == ["FAILED"]
    p, u = data["protected"], data["unprotected"]
    # Protected: Sb alone; kept its interrupted attempt's node-hours.
    assert (p["jobs"], p["preempted_jobs"], p["timeout_jobs"]) == (1, 1, 0)
    assert p["kept_node_hours"] == pytest.approx(node_hours(sb[0]), abs=1e-9)
    assert p["redone_node_hours"] == 0 and p["exception_jobs"] == 0
    assert p["median_completion_s"] == pytest.approx(completion_s(sb))
    assert p["checkpoints"] >= 1
    assert p["spent_node_hours"] == pytest.approx(p["checkpoints"] * COST_S / 3600)
    # Unprotected: Ub (started over), Fb (an exception), root's Hb.
    assert (u["jobs"], u["preempted_jobs"], u["exception_jobs"]) == (3, 1, 1)
    assert u["redone_node_hours"] == pytest.approx(sum(map(node_hours, ub[:-1])), abs=1e-9)
    assert u["kept_node_hours"] == 0
    # Each threshold against the baseline, as agreed at the start.
    v = {x["name"]: x for x in data["verdicts"]}
    base_c = data["baseline"]["median_completion_s"]
    assert v["completion time (median)"]["passed"] == (p["median_completion_s"] <= base_c * 1.10)
    assert v["queue wait (median)"]["passed"] == (
        p["median_queue_wait_s"] <= data["baseline"]["median_queue_wait_s"] + 300
    )
    assert v["exceptions (share of jobs)"]["passed"] is True  # 0 % against 0 % + 1
    assert data["protected_outside_scope"] == 0
    weeks = data["weeks"]
    assert sum(w["protected"]["jobs"] + w["unprotected"]["jobs"] for w in weeks) == 4

    status = c.stasis("slurm", "poc", "status").stdout
    assert "day 0." in status and "of 90" in status
    assert "protected: 1 jobs" in status and "unprotected: 3 jobs" in status
    text = c.stasis("slurm", "poc", "report", "--until", run["ended"].isoformat()).stdout
    assert "completion time (median): " in text and "exceptions (share of jobs): passed" in text


def test_report_rates_are_the_preemptions_caused(run: dict[str, Any]) -> None:
    c, jobs = run["cluster"], run["jobs"]
    data = json.loads(
        c.stasis(
            "slurm",
            "report",
            "--since",
            run["began"].isoformat(),
            "--until",
            run["ended"].isoformat(),
            "--json",
        ).stdout
    )
    every = records(c, *jobs.values())
    parts = {p["partition"]: p for p in data["partitions"]}
    low = [r for r in every if r["Partition"] == "low"]
    caused = [r for r in low if r["State"].split()[0] in ("PREEMPTED", "REQUEUED")]
    assert len(caused) >= 3  # Pa, Sb and Ub, each preempted at least once
    assert parts["low"]["interruptions"] == len(caused)
    assert parts["low"]["node_hours"] == pytest.approx(
        sum(map(node_hours, low)), abs=len(low) * 2 / 3600
    )
    assert parts["high"]["interruptions"] == 0
    settings = settings_of(c)
    floor_s, ceiling_s = settings.interval_min_s, settings.interval_max_s
    rate = parts["low"]["rate_per_node_hour"]
    assert rate == pytest.approx(len(caused) / parts["low"]["node_hours"])
    want = choose(COST_S, mtbi_s(rate), floor_s, ceiling_s)
    assert parts["low"]["interval_s"] == pytest.approx(want.interval_s)
    assert parts["low"]["cost_s"] == COST_S and parts["low"]["nodes"] == 1
    assert (parts["high"]["interval_s"], parts["high"]["bound"]) == (ceiling_s, "ceiling")
    # Kept against spent, per account and partition, on one line.
    rows = {(r["account"], r["partition"]): r for r in data["accounts"]}
    sb = records(c, jobs["Sb"])
    poc_low = rows[("poc", "low")]
    assert poc_low["kept_node_hours"] == pytest.approx(node_hours(sb[0]), abs=1e-9)
    assert poc_low["net_node_hours"] == pytest.approx(
        poc_low["kept_node_hours"] - poc_low["spent_node_hours"]
    )
    assert rows[("ctl", "low")]["spent_node_hours"] == 0
    text = c.stasis(
        "slurm", "report", "--since", run["began"].isoformat(), "--until", run["ended"].isoformat()
    ).stdout
    assert "Interruptions and STASIS_INTERVAL=auto per partition" in text
    assert "checkpointing protected jobs: " in text and "net kept" in text


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,1800",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def test_pages_in_a_browser(run: dict[str, Any], browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    c = run["cluster"]
    poc_page, report_page = tmp_path / "poc.html", tmp_path / "report.html"
    said = c.stasis(
        "slurm", "poc", "report", "--until", run["ended"].isoformat(), "--html", str(poc_page)
    ).stdout
    assert "1 protected and 3 unprotected jobs" in said
    c.stasis(
        "slurm",
        "report",
        "--since",
        run["began"].isoformat(),
        "--until",
        run["ended"].isoformat(),
        "--html",
        str(report_page),
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.get(poc_page.as_uri())
    results = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#thresholds td:last-child")]
    assert len(results) == 3 and all(r in ("passed", "FAILED") for r in results), results
    assert "exceptions" in browser.find_element(By.ID, "thresholds").text
    assert browser.find_elements(By.CSS_SELECTOR, "svg#weekly rect")
    assert browser.find_element(By.ID, "measures").text.count("\n") >= 15
    assert browser.save_screenshot(str(ARTIFACTS / "poc-report.png"))
    browser.get(report_page.as_uri())
    low = [
        row.text
        for row in browser.find_elements(By.CSS_SELECTOR, "#partitions-auto tr")
        if row.text.startswith("low ")
    ]
    assert len(low) == 1 and "default" in low[0], low
    assert any(
        row.text.startswith("poc low ") for row in browser.find_elements(By.CSS_SELECTOR, "#net tr")
    )
    assert browser.save_screenshot(str(ARTIFACTS / "slurm-report.png"))
    assert (ARTIFACTS / "poc-report.png").stat().st_size > 10_000
