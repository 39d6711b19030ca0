"""`stasis slurm report` on a Slurm job across several nodes (issue 31): its node-hours are
sacct's NNodes x ElapsedRaw, so the hours a requeue kept by restoring a 2-node job are twice
its wall-clock hours, as those redone by a rerun of an unprotected one are. Fed as
tests/slurm/test_report.py feeds recorded sacct text (report.FIELDS, `|` for report.SEP)."""

from __future__ import annotations

import csv
import io
from datetime import datetime

import pytest

from stasis.cli.slurm_report import to_csv
from stasis.slurm import report as rep
from tests.slurm.test_report import text

# Job 21 (stasis-protected, on n1 and n2) checkpointed and requeued after an hour, restored and
# run to its end; job 22 (unprotected, 2 nodes) preempted after half an hour and rerun; job 23
# (protected, 1 node) requeued after an hour as 21 was. Steps as sacct prints them (one line
# per step, after its attempt; the batch step on the first node only).
MULTINODE = """\
21|ana|phys|cpu|mpi|/home/ana/mpi|REQUEUED|2026-12-02T08:00:00|2026-12-02T08:00:00|2026-12-02T09:00:00|3600|600|2|billing=16,cpu=16,mem=8G,node=2|4G|||stasis-token=1796352877-394382927
21.batch||phys||batch||CANCELLED|2026-12-02T08:00:00|2026-12-02T08:00:00|2026-12-02T09:00:00|3600||1|cpu=8,mem=4G,node=1||1048576|mem=1048576|
21.0||phys||orted||CANCELLED|2026-12-02T08:00:01|2026-12-02T08:00:01|2026-12-02T09:00:00|3599||1|cpu=8,mem=4G,node=1||2097152|mem=2097152|
21|ana|phys|cpu|mpi|/home/ana/mpi|COMPLETED|2026-12-02T09:00:10|2026-12-02T09:01:00|2026-12-02T09:31:00|1800|600|2|billing=16,cpu=16,mem=8G,node=2|4G|||stasis-token=1796352877-394382927
21.batch||phys||batch||COMPLETED|2026-12-02T09:01:00|2026-12-02T09:01:00|2026-12-02T09:31:00|1800||1|cpu=8,mem=4G,node=1||1048576|mem=1048576|
22|bob|chem|cpu|mpi|/home/bob/mpi|PREEMPTED|2026-12-02T08:00:00|2026-12-02T08:00:00|2026-12-02T08:30:00|1800|600|2|billing=16,cpu=16,node=2|4G|||
22|bob|chem|cpu|mpi|/home/bob/mpi|COMPLETED|2026-12-02T08:30:05|2026-12-02T08:31:00|2026-12-02T09:31:00|3600|600|2|billing=16,cpu=16,node=2|4G|||
23|ana|phys|cpu|one|/home/ana/one|REQUEUED|2026-12-02T08:00:00|2026-12-02T08:00:00|2026-12-02T09:00:00|3600|600|1|billing=8,cpu=8,node=1|4G|||stasis-token=1796352877-394382999
23|ana|phys|cpu|one|/home/ana/one|COMPLETED|2026-12-02T09:00:10|2026-12-02T09:01:00|2026-12-02T09:11:00|600|600|1|billing=8,cpu=8,node=1|4G|||stasis-token=1796352877-394382999
"""

SINCE, UNTIL = datetime(2026, 12, 1), datetime(2026, 12, 15)


def test_a_two_node_job_counts_two_node_hours_per_hour() -> None:
    records = rep.parse_sacct(text(MULTINODE))
    assert [(r.job_id, r.nnodes) for r in records] == [
        ("21", 2),
        ("21", 2),
        ("22", 2),
        ("22", 2),
        ("23", 1),
        ("23", 1),
    ]
    # The steps' single node (sacct's NNodes of a step) does not replace the job's two.
    assert records[0].node_hours == pytest.approx(2.0)
    assert records[0].peak_mem_bytes == 2097152


def test_kept_and_redone_node_hours_of_multinode_jobs() -> None:
    r = rep.compute(rep.parse_sacct(text(MULTINODE)), SINCE, UNTIL)
    t = r.totals
    assert (t.jobs, t.preempted_jobs, t.protected_jobs) == (3, 3, 2)
    # 21: an hour on 2 nodes kept; 23: an hour on 1 node kept.
    assert t.kept_node_hours == pytest.approx(2.0 + 1.0)
    # 22: half an hour on 2 nodes redone by its rerun.
    assert t.preempt_redone_node_hours == pytest.approx(1.0)
    assert t.node_hours == pytest.approx(2 * 1.5 + 2 * 1.5 + 1 * (1 + 1 / 6))
    ana = r.groups[("ana", "phys", "cpu")]
    assert ana.kept_node_hours == pytest.approx(3.0)
    assert r.groups[("bob", "chem", "cpu")].kept_node_hours == 0.0


def test_the_csv_says_the_kept_node_hours_of_a_multinode_job() -> None:
    r = rep.compute(rep.parse_sacct(text(MULTINODE)), SINCE, UNTIL)
    rows = list(csv.DictReader(io.StringIO(to_csv(r))))
    kept = {row["user"]: float(row["kept_node_hours"]) for row in rows}
    assert kept == pytest.approx({"ana": 3.0, "bob": 0.0})
