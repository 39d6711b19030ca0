"""A policy's `--every auto` on a real node daemon: no interruption seen, the ceiling and no
checkpoint; once a node of the cluster is lost, each job is checkpointed at Young/Daly's
interval from its own measured frozen time and the cluster's interruption rate (the number
checked against stasis.interval.choose with the inputs the test reads back: the checkpoints'
frozen times, the nodes' times in the cluster). The dashboard's jobs page shows the interval and
why; its savings page shows node-hours kept (a real restore) against node-hours spent (the
checkpoints' frozen time), per cluster, checked against what the test caused. In headless
Chromium, on SQLite and PostgreSQL (the rate is counted in SQL, by time)."""

from __future__ import annotations

import pwd
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from stasis import interval
from tests.conftest import new_daemon, wait_for, workload
from tests.controlplane.conftest import ControlPlane
from tests.controlplane.fakenode import FakeNode
from tests.controlplane.test_dashboard import browser, shot  # noqa: F401 (a fixture)
from tests.controlplane.test_node import node_env

FLOOR_S, CEILING_S = 1, 86400  # the fixture's --min-interval 1; the default ceiling


def _hours(node: dict[str, Any], now: float) -> float:
    begun = datetime.fromisoformat(node["registered"]).timestamp()
    return ((node["lost_since"] or now) - begun) / 3600


def test_every_auto_checkpoints_at_young_daly_and_the_dashboard_shows_why(
    controlplane: ControlPlane, world_tmp: Path, test_user: pwd.struct_passwd, browser: WebDriver
) -> None:
    cp, driver = controlplane, browser
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    d = new_daemon(world_tmp, "node-a", env=node_env(cp, cluster, "node-a"))
    d.start()

    def auto_checkpoints() -> list[dict[str, Any]]:  # oldest first
        return sorted(
            (c for c in cp.json("checkpoints") if c["reason"] == "policy auto"),
            key=lambda c: c["created"],
        )

    try:
        job = d.run(*workload("counter.py"), label="auto-train")["job"]
        wait_for(lambda: len(cp.json("jobs")) == 1, 30, "the job's report")
        r = cp.cli("policies", "add", "bad", "--every", "auto", "--action", "retain", "--keep", "1")
        assert (r.returncode, r.stderr.strip()) == (
            2,
            "stasis: error: every auto checkpoints each job at its own interval: it takes "
            "the checkpoint action and no --on (not retain); give --every N for the others",
        )
        added = cp.json(
            "policies",
            "add",
            "auto",
            "--every",
            "auto",
            "--action",
            "checkpoint",
            "--label",
            "auto-*",
        )
        assert added["every_s"] == "auto" and added["hook"] is False
        assert [p["every_s"] for p in cp.json("policies", "list")] == ["auto"]

        # No interruption in the cluster yet: the ceiling, and no checkpoint.
        (j,) = cp.json("jobs")
        shown = j["interval"]
        assert (shown["interval_s"], shown["bound"], shown["mtbi_s"]) == (
            CEILING_S,
            "ceiling",
            None,
        )
        assert "no interruption seen" in shown["why"] and "policy auto" in shown["why"]
        time.sleep(2.5)
        assert auto_checkpoints() == []

        # A node of the cluster goes silent: lost, an interruption.
        gone = FakeNode(cp, cluster, "node-gone")
        gone.register()
        gone.heartbeat([])
        wait_for(
            lambda: any(e["kind"] == "node-lost" for e in cp.json("events")), 30, "the lost node"
        )
        # No cost measured yet: 0, the floor: the first checkpoint measures it; then each at
        # its interval from the frozen times measured.
        wait_for(lambda: len(auto_checkpoints()) >= 4, 120, "four auto checkpoints")
        # The interval shown, against stasis.interval.choose with the inputs read back (read
        # again if a checkpoint was reported meanwhile).
        for _ in range(20):
            before = cp.json("checkpoints")
            (j,) = cp.json("jobs")
            nodes = cp.json("nodes")
            now = time.time()
            if [c["id"] for c in cp.json("checkpoints")] == [c["id"] for c in before]:
                break
        shown = j["interval"]
        mine = [c for c in before if c["label"] == "auto-train"]  # newest first
        frozen = [c["frozen_s"] for c in mine[:5]]
        assert shown["cost_samples"] == len(frozen) == min(5, len(mine)) and len(mine) >= 4
        assert shown["cost_s"] == pytest.approx(sum(frozen) / len(frozen)) and shown["cost_s"] > 0
        assert shown["interruptions"] == 1
        node_hours = sum(_hours(n, now) for n in nodes)
        assert shown["node_hours"] == pytest.approx(node_hours, abs=3 / 3600)
        assert shown["rate_per_node_hour"] == pytest.approx(1 / shown["node_hours"])
        assert shown["mtbi_s"] == pytest.approx(3600 / shown["rate_per_node_hour"])
        expected = interval.choose(shown["cost_s"], shown["mtbi_s"], FLOOR_S, CEILING_S)
        assert shown["interval_s"] == pytest.approx(expected.interval_s)
        assert (shown["bound"], shown["raw_s"]) == (expected.bound, pytest.approx(expected.raw_s))
        assert FLOOR_S <= shown["interval_s"] < 60, shown
        assert expected.why() in shown["why"], shown

        # Checkpointed at that interval: the last gap between two of them is the interval
        # (growing slowly as the cluster's node-hours do), give or take a policy round (1 s)
        # and the command's lease and report.
        created = [c["created"] for c in auto_checkpoints()]
        gap = created[-1] - created[-2]
        assert 0.6 * shown["interval_s"] - 0.5 <= gap <= shown["interval_s"] + 3.0, (
            gap,
            shown,
            created,
        )
        cp.json("policies", "rm", "auto")
        wait_for(  # its last checkpoint done and reported
            lambda: all(c["state"] in ("done", "failed") for c in cp.json("actions"))
            and len(auto_checkpoints())
            == sum(1 for c in cp.json("actions") if c["state"] == "done"),
            60,
            "the removed policy's last checkpoint",
        )

        # A restore keeps what the checkpoint held; checkpointing spent its frozen time.
        stopped = d.json("dump", job)
        restored = d.json("restore", stopped["checkpoint"])
        saved: dict[str, Any] = wait_for(
            lambda: (s := cp.json("savings"))["restores"] and s, 30, "the restore report"
        )
        ckpts = cp.json("checkpoints")
        (stop_ckpt,) = [c for c in ckpts if c["id"] == stopped["checkpoint"]]
        kept = stop_ckpt["work_s"] / 3600
        spent = sum(c["frozen_s"] for c in ckpts) / 3600
        (hpc,) = saved["per_cluster"]
        assert hpc["cluster"] == "hpc" and hpc["interruptions"] == 1, hpc
        assert hpc["kept_node_hours"] == round(kept, 4)
        assert hpc["spent_node_hours"] == pytest.approx(spent, abs=2e-6) and spent > 0
        assert hpc["net_node_hours"] == pytest.approx(kept - spent, abs=1e-4)
        assert saved["spent_node_hours"] == hpc["spent_node_hours"]
        r = cp.cli("savings")
        # The CLI prints the API's (rounded) figures: 0.0045 may print as 0.004 or 0.005.
        shown = (
            f"cluster hpc: kept {hpc['kept_node_hours']:.3f}, spent {hpc['spent_node_hours']:.4f}"
        )
        assert shown in r.stdout, r.stdout

        # The dashboard: the job's interval and why; kept against spent per cluster and day.
        cp.json(
            "policies",
            "add",
            "auto",
            "--every",
            "auto",
            "--action",
            "checkpoint",
            "--label",
            "auto-*",
        )
        driver.get(cp.url + "/ui/login")
        driver.find_element(By.ID, "token").send_keys(cp.admin)
        driver.find_element(By.ID, "login").click()
        wait_for(lambda: driver.current_url.endswith("/ui/"), 10, "the nodes page")
        driver.get(cp.url + "/ui/jobs")
        cell = wait_for(
            lambda: driver.find_elements(
                By.CSS_SELECTOR, f'#jobs tr[data-job="{restored["job"]}"] td.interval'
            ),
            30,
            "the restored job's interval",
        )[0]
        text = cell.text
        (j,) = cp.json("jobs")
        assert "policy auto (every auto): checkpoint cost" in text, text
        assert "1 interruption(s) in" in text and "Young/Daly" in text, text
        seconds = float(
            cell.find_element(By.CSS_SELECTOR, ".interval-s").get_attribute("data-interval-s") or 0
        )
        assert seconds == pytest.approx(j["interval"]["interval_s"], rel=0.2), (seconds, j)
        shot(driver, "jobs-intervals")
        cp.json("policies", "rm", "auto")

        def page_and_reports() -> tuple[Any, float] | None:
            # The removed policy's last checkpoint may still be reported after the page is
            # made: the page must show what was reported by then, so read the reports on both
            # sides of the page and take a page they did not change across.
            def frozen() -> list[float]:
                return [c["frozen_s"] for c in cp.json("checkpoints")]

            before = frozen()
            driver.get(cp.url + "/ui/savings")
            row = driver.find_element(By.CSS_SELECTOR, '#kept-spent tr[data-cluster="hpc"]')
            after = frozen()
            if sorted(before) != sorted(after):
                return None
            return row, sum(after) / 3600

        row, spent = wait_for(page_and_reports, 60, "the savings page with every report in")
        assert float(row.get_attribute("data-kept") or 0) == round(kept, 4)
        assert float(row.get_attribute("data-spent") or 0) == pytest.approx(spent, abs=2e-6)
        page_kept = float(row.get_attribute("data-kept") or 0)
        page_spent = float(row.get_attribute("data-spent") or 0)
        assert f"{page_kept:.3f}" in row.text and f"{page_spent:.4f}" in row.text, row.text
        (bar_kept,) = driver.find_elements(By.CSS_SELECTOR, "#chart rect.kept")
        (bar_spent,) = driver.find_elements(By.CSS_SELECTOR, "#chart path.spent")
        assert float(bar_kept.get_attribute("data-node-hours") or 0) == pytest.approx(
            kept, abs=1e-4
        )
        assert float(bar_spent.get_attribute("data-node-hours") or 0) == pytest.approx(
            spent, abs=2e-6
        )
        assert "spent" in driver.find_element(By.ID, "net").text
        shot(driver, "savings-kept-spent")
    finally:
        d.kill_all()
        d.stop()


def test_a_clusters_interruptions_and_a_node_reported_interval(controlplane: ControlPlane) -> None:
    """What counts as an interruption (a drain sent, a checkpoint that stopped a job for a
    preemption; not a leave-running one, not another cluster's), the rate an auto policy uses,
    and a job's own interval as its node reports it (GET /intervals on the node)."""
    cp = controlplane
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    other = cp.json("clusters", "add", "other", "--kind", "slurm")
    n1 = FakeNode(cp, hpc, "n1")
    n1.register()
    n2 = FakeNode(cp, other, "n2")
    n2.register()
    now = time.time()

    def checkpoint(name: str, leave_running: bool, reason: str, frozen_s: float) -> dict[str, Any]:
        return {
            "kind": "checkpoint",
            "checkpoint": f"20261206T000000Z-{name}",
            "label": "train",
            "job": "4242",
            "user": "alice",
            "size_bytes": 1,
            "work_s": 10.0,
            "duration_s": 0.5,
            "frozen_s": frozen_s,
            "leave_running": leave_running,
            "reason": reason,
            "at": now,
        }

    n1.beat(
        jobs=[
            {
                "job": "4242",
                "label": "train",
                "user": "alice",
                "state": "running",
                "kind": "slurm",
                "interval_s": 600.0,
                "interval_why": "asked: STASIS_INTERVAL=600",
            }
        ],
        activity=[
            checkpoint("aaaa", False, "preemption or time limit", 3.0),
            checkpoint("bbbb", True, "interval", 5.0),
        ],
        scheduler_state="MIXED",
    )
    n2.beat(jobs=[], activity=[{**checkpoint("cccc", False, "Slurm requeue", 1.0)}])
    status, drained = cp.call("POST", "/api/v1/nodes/n1/drain", cp.admin, {"cluster": "hpc"})
    assert status == 201 and drained["drain"], drained  # its drain command, queued
    status, body = cp.call(
        "POST",
        "/api/v1/nodes/n1/heartbeat",
        n1.token,
        {"jobs": [{"job": "1", "state": "running", "interval_why": "a\x1b[31m"}]},
    )
    assert status == 400 and "interval_why" in body["error"], body

    (j,) = [x for x in cp.json("jobs") if x["cluster"] == "hpc"]
    assert j["interval"] == {
        "source": "node",
        "interval_s": 600.0,
        "why": "asked: STASIS_INTERVAL=600",
    }
    saved = cp.json("savings")
    per = {c["cluster"]: c for c in saved["per_cluster"]}
    # hpc: the preemption's stop and the drain; other: its requeue.
    assert (per["hpc"]["interruptions"], per["other"]["interruptions"]) == (2, 1), per
    assert per["hpc"]["rate_per_node_hour"] == pytest.approx(2 / per["hpc"]["node_hours_seen"])
    assert per["hpc"]["spent_node_hours"] == round(8.0 / 3600, 6)
    assert per["other"]["spent_node_hours"] == round(1.0 / 3600, 6)
    assert saved["spent_node_hours"] == round(9.0 / 3600, 6)

    # An auto policy: the job's cost is its label's mean frozen time; the rate, hpc's.
    cp.json("policies", "add", "auto", "--every", "auto", "--action", "checkpoint")
    (j,) = [x for x in cp.json("jobs") if x["cluster"] == "hpc"]
    shown = j["interval"]
    assert (shown["cost_s"], shown["cost_samples"], shown["interruptions"]) == (4.0, 2, 2)
    expected = interval.choose(4.0, shown["mtbi_s"], FLOOR_S, CEILING_S)
    assert shown["interval_s"] == pytest.approx(expected.interval_s)
    assert shown["mtbi_s"] == pytest.approx(3600 * shown["node_hours"] / 2)
    # Edited in place: a period ends auto, auto ends the period.
    assert cp.json("policies", "edit", "auto", "--every", "2m")["every_s"] == 120
    (j,) = [x for x in cp.json("jobs") if x["cluster"] == "hpc"]
    assert j["interval"]["source"] == "node"  # no auto policy picks it now: its node's
    assert cp.json("policies", "edit", "auto", "--every", "auto")["every_s"] == "auto"
    edits = [e["message"] for e in cp.json("events") if e["kind"] == "policy-edited"]
    assert edits == [
        "policy auto edited: every_s 0 -> 120; every_auto True -> False",
        "policy auto edited: every_s 120 -> 0; every_auto False -> True",
    ], edits
    r = cp.cli("policies", "edit", "auto", "--on", "memory", "--above", "50")
    assert r.returncode == 2 and "it takes the checkpoint action and no --on" in r.stderr, r.stderr
