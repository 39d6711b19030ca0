"""STASIS_INTERVAL=auto on a real local cluster with accounting (slurmdbd + MariaDB started by
`local-cluster up --accounting`).

The history: a plain requeueable job in partition `low` is preempted by a job in `high` (which
nothing ever preempts), and slurmdbd records it. The node daemon, restarted with a floor of 1 s
and a ceiling of 120 s, reads those rates at its start. Then two opted-in counters ask for
`auto`, one in each partition: the one in `low` gets Young/Daly's interval from its measured
checkpoint cost and low's rate (seconds), checkpoints at it, and resumes from its last periodic
checkpoint after a requeue; the one in `high` gets the ceiling and no checkpoint meanwhile.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from stasis.dev import slurmaccounting, slurmcluster
from stasis.interval import daly
from tests.conftest import TEST_USER, ensure_test_user
from tests.e2e.conftest import Cluster, close_cluster, until

pytestmark = pytest.mark.timeout(300)

NODE = "n1"
FLOOR_S, CEILING_S = 1.0, 120.0


class AccountingCluster(Cluster):
    def up(self) -> None:
        self.start("--socket-group", TEST_USER, "--accounting", timeout_s=180)
        self.work.mkdir(exist_ok=True)
        os.chmod(self.work, 0o777)
        from tests.e2e.conftest import COUNTER

        (self.work / "counter.py").write_text(COUNTER)


@pytest.fixture(scope="module")
def c() -> Iterator[Cluster]:
    ensure_test_user()
    root = Path(tempfile.mkdtemp(prefix="stasis-e2e-intervals-"))
    os.chmod(root, 0o755)
    cl = AccountingCluster(root)
    try:
        cl.up()
        slurmaccounting.add_user(cl.lay, TEST_USER)
        yield cl
    finally:
        close_cluster(cl)


def attempts(c: Cluster, job: str) -> list[dict[str, str]]:
    out = c.run(
        "sacct", "-a", "-D", "-n", "-P", "-j", job, "-X", "-o", "JobIDRaw,State,End,Partition"
    ).stdout
    return [
        dict(zip(("id", "state", "end", "partition"), line.split("|")))
        for line in out.splitlines()
        if line
    ]


def intervals(c: Cluster) -> dict[str, dict[str, Any]]:
    found = json.loads(c.stasis("slurm", "intervals", "--json").stdout)
    return {e["slurm_job"]: e for e in found}


def created(m: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(str(m["created"]))


def test_auto_interval_shorter_where_preemptions_are(c: Cluster) -> None:
    w = c.work
    # -- the history: one preemption in `low` -------------------------------------------------
    plain = c.sbatch(
        c.script(
            "plain",
            f"exec python3 -u {w}/counter.py 600 1 0",
            f"--output={w}/plain-%j.out",
            "-p",
            "low",
            "--requeue",
        ),
        user=TEST_USER,
    )
    c.wait_number(plain, 2)
    preemptor = c.sbatch(
        c.script("preemptor", "sleep 1", f"--output={w}/pre-%j.out", "-p", "high", "--exclusive")
    )
    until(
        lambda: any(
            a["state"] == "PREEMPTED" and a["end"] not in ("", "Unknown")
            for a in attempts(c, plain)
        ),
        90,
        "slurmdbd to record the preemption",
    )
    c.run("scancel", plain)
    until(lambda: not c.run("squeue", "-h", "-o", "%i").stdout.strip(), 60, "the queue empty")
    until(
        lambda: all(
            a["end"] not in ("", "Unknown") for j in (plain, preemptor) for a in attempts(c, j)
        ),
        60,
        "slurmdbd to record every end",
    )
    preempted = sum(a["state"] == "PREEMPTED" for a in attempts(c, plain))
    assert preempted >= 1
    assert [a["state"] for a in attempts(c, preemptor)] == ["COMPLETED"]

    # -- the daemon with a short floor and ceiling (it reads the rates as it starts) ----------
    slurmcluster.stop_daemon(c.root)
    config = c.lay.config_of(NODE)
    config.write_text(
        config.read_text() + f"interval_min_s = {FLOOR_S}\ninterval_max_s = {CEILING_S}\n"
    )
    slurmcluster.start_daemon(c.root)

    def auto_job(name: str, partition: str) -> str:
        return c.sbatch(
            c.script(
                name,
                f"exec python3 -u {w}/counter.py 600 0.5 0",
                f"--output={w}/{name}-%j.out",
                "-p",
                partition,
                f"--export=STASIS_ENABLE=1,STASIS_CHECKPOINT={name}," "STASIS_INTERVAL=auto",
            ),
            user=TEST_USER,
        )

    low = auto_job("auto-low", "low")
    high = auto_job("auto-high", "high")
    until(
        lambda: len(c.checkpoints("auto-low", user=TEST_USER)) >= 3,
        90,
        "three periodic checkpoints of the job in low",
    )

    def both() -> dict[str, dict[str, Any]] | None:
        f = intervals(c)
        return f if low in f and high in f and f[low]["cost_measured"] else None

    found = until(both, 30, "both jobs' intervals")
    lo, hi = found[low], found[high]

    # high: nothing ever interrupted there: the ceiling, and no checkpoint meanwhile.
    assert (hi["partition"], hi["requested"], hi["bound"]) == ("high", "auto", "ceiling")
    assert hi["interval_s"] == CEILING_S and hi["mtbi_s"] is None, hi
    assert hi["rate"]["interruptions"] == 0
    assert c.checkpoints("auto-high", user=TEST_USER) == []
    # low: the rate the test caused, Young/Daly from the job's own measured cost, far shorter.
    assert lo["partition"] == "low" and lo["rate"]["interruptions"] == preempted, lo
    rate = lo["rate"]
    assert lo["mtbi_s"] == pytest.approx(3600 * rate["node_hours"] / rate["interruptions"])
    assert lo["raw_s"] == pytest.approx(daly(lo["cost_s"], lo["mtbi_s"]))
    assert lo["interval_s"] == pytest.approx(max(FLOOR_S, min(CEILING_S, lo["raw_s"])))
    assert 0 < lo["cost_s"] < 10 and lo["interval_s"] < hi["interval_s"] / 4, lo
    assert "auto: checkpoint cost" in lo["why"] and "partition low" in lo["why"]
    # Checkpoints come about that often (each gap: the interval, the dump, the ask).
    taken = sorted(c.checkpoints("auto-low", user=TEST_USER), key=created)
    gaps = [(b - a).total_seconds() for a, b in zip(map(created, taken), map(created, taken[1:]))]
    assert all(FLOOR_S * 0.9 <= g <= lo["interval_s"] * 2 + 15 for g in gaps), (gaps, lo)
    out = c.output(low)
    assert "stasis: checkpoint interval" in out and "stasis: periodic checkpoint" in out

    # `stasis ps` shows both, each with its interval and why (the owner's own listing; root's
    # has them too).
    for user in (TEST_USER, None):
        rows = json.loads(c.stasis("ps", "--json", user=user).stdout)
        shown = {r["job"]: r["interval"] for r in rows if "interval" in r}
        assert shown[low]["kind"] == shown[high]["kind"] == "slurm", shown
        assert (shown[high]["interval_s"], shown[high]["bound"]) == (CEILING_S, "ceiling")
        assert shown[low]["requested"] == "auto" and shown[low]["cost_measured"] is True
        assert shown[low]["rate_per_hour"] == pytest.approx(rate["rate_per_node_hour"])
        assert shown[low]["raw_s"] == pytest.approx(daly(shown[low]["cost_s"], lo["mtbi_s"]))
        assert "partition low" in shown[low]["why"]
    text = c.stasis("ps", user=TEST_USER).stdout
    assert re.search(rf"slurm +{low} +auto-low +", text) and "auto: checkpoint cost" in text

    # The state in them progresses: requeued (a node failure's stand-in), the job resumes from
    # its last periodic checkpoint, not from 0.
    c.run("scontrol", "requeue", low)
    until(lambda: "stasis: restored checkpoint" in c.output(low), 90, "the restore")

    def counted() -> list[int]:
        o = c.output(low)
        return [
            int(n)
            for n in o[o.index("stasis: restored checkpoint") :].split("\n")
            if n.strip().isdigit()
        ]

    resumed = until(counted, 30, "the counter after the restore")
    assert resumed[0] > 2, resumed
    for job in (low, high):
        c.run("scancel", job)
