"""stasis.slurm.payoff (per partition: the rate used, auto's interval for the typical job; per
protected job: checkpoints spent) and stasis.slurm.poc (the proof of concept's measures,
thresholds and state file) on recorded sacct text (tests/slurm/test_report.py's). The same on a
real slurmdbd: tests/e2e/test_slurm_poc.py."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from stasis.errors import UsageError
from stasis.interval import daly
from stasis.slurm import payoff, poc, poc_html, report_html
from stasis.slurm import report as rep
from tests.conftest import STASIS
from tests.slurm.test_report import RECORDED, SINCE, TIMEOUTS, UNTIL, text

MODEL = payoff.Model(floor_s=1.0, ceiling_s=3600.0, default_cost_s=2.0)


def test_partition_rates_and_auto_interval() -> None:
    records = rep.parse_sacct(text(RECORDED + TIMEOUTS))
    parts = payoff.partitions(records, SINCE, UNTIL, MODEL)
    low = parts["low"]
    hours = (8 + 7 + 24 + 8 + 34 + 41) / 3600
    assert low.interruptions == 2 and low.node_hours == pytest.approx(hours)
    assert low.mtbi_s == pytest.approx(3600 * hours / 2)
    assert low.interval_s == pytest.approx(daly(2.0, 3600 * hours / 2))
    assert (low.cost_s, low.cost_source, low.nodes, low.bound) == (
        2.0,
        "default (--checkpoint-cost-s)",
        1,
        "",
    )
    # Never interrupted: the ceiling. gpu's typical job has 2 nodes (median_low of 2, 2, 1, 1).
    assert (parts["high"].interval_s, parts["high"].bound) == (3600.0, "ceiling")
    assert parts["gpu"].nodes == 1 and parts["gpu"].mtbi_s is None


def test_measured_costs_win_over_the_default() -> None:
    records = rep.parse_sacct(text(RECORDED))
    model = payoff.Model(floor_s=1, ceiling_s=3600, measured={"low": [0.5, 0.25, 4.0]})
    low = payoff.partitions(records, SINCE, UNTIL, model)["low"]
    assert (low.cost_s, low.cost_source) == (0.5, "measured: median of 3 job(s)")


def test_kept_against_spent_on_one_line() -> None:
    records = rep.parse_sacct(text(RECORDED))
    r = payoff.apply(rep.compute(records, SINCE, UNTIL), records, MODEL)
    interval = r.partitions["low"].interval_s
    # Job 4 (protected): its interruption's checkpoint, and the periodic ones in 8 s and 34 s;
    # job 2 (protected, never interrupted): the periodic ones in its 7 s.
    n = 1 + int(8 // interval) + int(34 // interval) + int(7 // interval)
    t = r.totals
    assert t.checkpoints == n and n >= 1
    assert t.spent_node_hours == pytest.approx(n * 2.0 / 3600)
    assert t.net_node_hours == pytest.approx(8 / 3600 - n * 2.0 / 3600)
    [low] = [row for row in r.account_rows() if row["partition"] == "low"]
    assert low["kept_node_hours"] == pytest.approx(8 / 3600)
    assert low["spent_node_hours"] == pytest.approx(t.spent_node_hours)
    assert low["interval_s"] == interval and low["interruptions"] == 2
    data = json.loads(json.dumps(r.as_dict()))
    assert [p["partition"] for p in data["partitions"]] == ["high", "low"]
    page = report_html.render(r)
    assert 'id="partitions-auto"' in page and 'id="net"' in page


def measured(recorded: str, since: datetime, until: datetime, scope: poc.Scope) -> poc.Split:
    return poc.measure(rep.parse_sacct(text(recorded)), since, until, scope, 24 * 3600, MODEL)


def test_poc_measures_split_protected_and_unprotected() -> None:
    split = measured(RECORDED + TIMEOUTS, SINCE, UNTIL, poc.Scope(accounts=["local"]))
    p, u = split.protected, split.unprotected
    assert (p.jobs, u.jobs) == (2, 7)  # 2 and 4; 1, 3, 5, 9, 10, 11 and 9 again
    assert p.preempted_jobs == 1 and p.kept_node_hours == pytest.approx(8 / 3600)
    assert u.preempted_jobs == 1 and u.redone_node_hours == pytest.approx((24 + 60) / 3600)
    assert (u.timeout_jobs, u.resubmitted_jobs) == (1, 1)
    # Job 4: submitted 02:54:37, ended 02:55:42; waited 1 s, then 17 s after its requeue.
    assert sorted(p.completion_s) == [7.0, 65.0] and sorted(p.queue_wait_s) == [0.0, 18.0]
    assert split.in_scope.jobs == 5 and split.protected_outside == 0
    assert sum(w[0].jobs + w[1].jobs for w in split.weeks.values()) == 9


def state_of(split: poc.Split) -> poc.State:
    return poc.State(
        started=datetime(2026, 12, 4),
        days=90,
        baseline_since=datetime(2026, 9, 5),
        scope=poc.Scope(accounts=["local"]),
        thresholds=poc.Thresholds(queue_wait_increase_s=10),
        window_h=24,
        baseline=poc.baseline_of(split.in_scope),
    )


def test_poc_thresholds_pass_or_fail() -> None:
    base = measured(TIMEOUTS, SINCE, UNTIL, poc.Scope(accounts=["phys"]))
    state = state_of(base)
    assert state.baseline.median_queue_wait_s == 0  # 9, 10, 11, 9 waited 0, 10 min 13 s, 0, 0
    now = measured(RECORDED, SINCE, UNTIL, poc.Scope(accounts=["local"]))
    verdicts = {v.name: v for v in poc.verdicts(state, now.protected)}
    # Protected median queue wait 9 s: within 0 + 10 s.
    assert verdicts["queue wait (median)"].passed is True
    assert verdicts["queue wait (median)"].protected == 9.0
    # Protected median completion 36 s against the baseline's 60 s: passed.
    assert verdicts["completion time (median)"].passed is True
    assert verdicts["exceptions (share of jobs)"].passed is True
    stricter = state.model_copy(update={"thresholds": poc.Thresholds(queue_wait_increase_s=5)})
    assert poc.verdicts(stricter, now.protected)[1].passed is False
    # No protected job: not decided.
    assert poc.verdicts(state, poc.Measures())[0].passed is None
    page = poc_html.render(state, now, poc.verdicts(state, now.protected), UNTIL)
    assert '<svg id="weekly"' in page and "<script" not in page
    assert page.count('<td class="pass">passed</td>') == 3 and 'class="fail"' not in page


def test_poc_state_file_round_trip_and_refusals(tmp_path: Path) -> None:
    state = state_of(measured(TIMEOUTS, SINCE, UNTIL, poc.Scope(accounts=["phys"])))
    path = tmp_path / "poc.json"
    poc.save(path, state, replace=False)
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert poc.load(path) == state
    with pytest.raises(UsageError, match="already recorded.*--force"):
        poc.save(path, state, replace=False)
    poc.save(path, state, replace=True)
    link = tmp_path / "link.json"
    link.symlink_to(path)
    with pytest.raises(UsageError, match="cannot read the PoC"):
        poc.load(link)  # a link is never followed
    path.write_text(json.dumps({"format": 1}))
    with pytest.raises(UsageError, match="unreadable.*start it again"):
        poc.load(path)
    with pytest.raises(UsageError, match="no PoC recorded.*poc start"):
        poc.load(tmp_path / "none.json")
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        with pytest.raises(UsageError, match="root reads only a file of root's"):
            poc.load(path)


@pytest.mark.parametrize(
    "args, says",
    [
        (["start"], "poc start needs the opted-in set: --users, --accounts or --partitions"),
        (["status", "--state", "/nonexistent/poc.json"], "no PoC recorded in /nonexistent"),
        (["report", "--json", "--html", "x.html"], "not allowed with argument"),
        (["start", "--accounts", "a", "--days", "0"], "--days"),
    ],
)
def test_poc_cli_refusals_are_one_line(args: list[str], says: str) -> None:
    result = subprocess.run(
        [STASIS, "slurm", "poc", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "STASIS_CONFIG": ""},
    )
    assert result.returncode == 2, result
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
    assert says in result.stderr
