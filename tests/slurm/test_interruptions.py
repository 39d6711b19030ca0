"""stasis.slurm.interruptions (rates per partition from sacct's records) and the daemon's
interval choice for STASIS_INTERVAL=auto (stasis.slurm.intervals), on recorded sacct text. The
same on a real slurmdbd: tests/e2e/test_slurm_intervals.py."""

from __future__ import annotations

from datetime import datetime

import pytest

from stasis.config import Settings
from stasis.daemon.activity import Activity
from stasis.daemon.users import Caller
from stasis.interval import daly
from stasis.slurm import interruptions, report
from stasis.slurm.intervals import Intervals
from tests.slurm.test_report import RECORDED, TIMEOUTS, text

SINCE, UNTIL = datetime(2026, 11, 20), datetime(2026, 12, 10)


def test_rates_count_preemptions_and_requeues_not_timeouts() -> None:
    records = report.parse_sacct(text(RECORDED) + text(TIMEOUTS))
    found = interruptions.rates(records, SINCE, UNTIL)
    low = found["low"]
    # Job 3 PREEMPTED and job 4 REQUEUED (stasis' stop checkpoint); their reruns, 1 and 2 not.
    assert low.interruptions == 2
    assert low.node_hours == pytest.approx((8 + 7 + 24 + 8 + 34 + 41) / 3600)
    assert low.rate_per_node_hour == pytest.approx(2 / low.node_hours)
    assert found["high"].interruptions == 0 and found["high"].rate_per_node_hour == 0
    # A TIMEOUT is no interruption (the time-limit checkpoint covers it); 2 nodes count twice.
    gpu = found["gpu"]
    assert gpu.interruptions == 0
    assert gpu.node_hours == pytest.approx((2 * 78 + 2 * 30 + 60 + 60) / 3600)
    # A job still running counts up to the window's end.
    assert found["cpu"].node_hours == pytest.approx(
        (UNTIL - datetime(2026, 12, 9, 9)).total_seconds() / 3600
    )


def test_window_clips_exposure_and_events() -> None:
    records = report.parse_sacct(text(RECORDED))
    found = interruptions.rates(records, datetime(2026, 12, 4, 2, 54, 50), UNTIL)
    # Job 3's PREEMPTED end (02:55:02) is inside, job 4's REQUEUED end (02:54:46) is not.
    assert found["low"].interruptions == 1


def test_cache_without_sacct_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    cache = interruptions.RateCache()
    assert cache.get("low") == (None, "not read yet")
    cache.refresh()
    rate, why = cache.get("low")
    assert rate is None and "sacct is not installed" in why


def _reg(uid: int = 1000) -> dict[str, object]:
    return {"user": "ana", "uid": uid, "label": "l"}


def test_auto_interval_from_rate_and_measured_cost() -> None:
    iv = Intervals(Settings(interval_min_s=1.0, interval_max_s=3600.0))
    iv.rates.put(interruptions.rates(report.parse_sacct(text(RECORDED)), SINCE, UNTIL))
    low = iv.ask("4", "auto", _reg(), "low", rss_bytes=250_000_000)  # ~1 s estimated
    assert low["cost_s"] == pytest.approx(1.0) and not low["cost_measured"]
    mtbi = 3600 / (2 / ((8 + 7 + 24 + 8 + 34 + 41) / 3600))
    assert low["mtbi_s"] == pytest.approx(mtbi)
    assert low["interval_s"] == pytest.approx(daly(1.0, mtbi)) and low["bound"] == ""
    assert "estimated" in low["why"] and "2 interruption(s)" in low["why"]
    # The job's checkpoint measured 0.3 s frozen: the next ask uses it.
    iv.heard(
        Activity(
            kind="checkpoint",
            checkpoint="c",
            label="l",
            job="4",
            user="ana",
            size_bytes=1,
            work_s=1,
            duration_s=0.3,
            frozen_s=0.3,
        )
    )
    again = iv.ask("4", "auto", _reg(), "low", rss_bytes=250_000_000)
    assert again["cost_measured"] and again["interval_s"] == pytest.approx(daly(0.3, mtbi))
    # No interruption in "high": the ceiling.
    high = iv.ask("5", "auto", _reg(), "high", rss_bytes=0)
    assert high["interval_s"] == 3600 and high["bound"] == "ceiling"
    assert again["interval_s"] < high["interval_s"]
    # A fixed interval is shown as asked, unbounded.
    fixed = iv.ask("6", "0.5", _reg(2000), "low", rss_bytes=0)
    assert fixed["interval_s"] == 0.5 and fixed["why"] == "asked: STASIS_INTERVAL=0.5"
    # Each user sees their own; root all; ended jobs are forgotten.
    assert [e["slurm_job"] for e in iv.listing(Caller(pid=1, uid=2000, gid=2000))] == ["6"]
    assert [e["slurm_job"] for e in iv.listing(Caller(pid=1, uid=0, gid=0))] == ["4", "5", "6"]
    iv.forget_except({"5"})
    assert [e["slurm_job"] for e in iv.listing(Caller(pid=1, uid=0, gid=0))] == ["5"]
