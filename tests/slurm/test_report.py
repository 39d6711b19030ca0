"""stasis.slurm.report's parsing and sums on recorded sacct text (Slurm 22.05.8, `sacct -a -D -n
-P --noconvert -o FIELDS`), the date handling, the CSV/HTML renderings, and the CLI's one-line
errors. The same numbers on a real slurmdbd: tests/e2e/test_slurm_report.py."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from stasis.cli.slurm_report import to_csv
from stasis.errors import SlurmError, UsageError
from stasis.slurm import report as rep
from stasis.slurm import report_html
from tests.conftest import STASIS

# Recorded on the local cluster (PreemptMode=REQUEUE, jobacct_gather/linux): job 3 preempted and
# rerun, job 4 (stasis-protected) checkpointed, requeued and restored; 1 and 2 ran through; 5 is
# the preemptor. Fields in report.FIELDS order, `|` standing for report.SEP.
RECORDED = """\
1|root|local|low|wrap|/w|COMPLETED|2026-12-04T02:54:02|2026-12-04T02:54:02|2026-12-04T02:54:10|8|UNLIMITED|1|billing=1,cpu=1,node=1|200M|||
1.batch||local||batch||COMPLETED|2026-12-04T02:54:02|2026-12-04T02:54:02|2026-12-04T02:54:10|8||1|cpu=1,mem=0,node=1||67805184|cpu=00:00:00,energy=0,fs/disk=1690069,mem=67805184,pages=3,vmem=72052736|
2|root|local|low|wrap|/w|COMPLETED|2026-12-04T02:54:02|2026-12-04T02:54:02|2026-12-04T02:54:09|7|UNLIMITED|1|billing=1,cpu=1,node=1|1000M|||stasis-token=1796352842-840187718
2.batch||local||batch||COMPLETED|2026-12-04T02:54:02|2026-12-04T02:54:02|2026-12-04T02:54:09|7||1|cpu=1,mem=0,node=1||48128000|cpu=00:00:00,energy=0,fs/disk=12115166,mem=48128000,pages=1,vmem=64135168|
3|root|local|low|plain.sh|/w|PREEMPTED|2026-12-04T02:54:37|2026-12-04T02:54:38|2026-12-04T02:55:02|24|UNLIMITED|1|billing=4,cpu=4,node=1|400M|||
3.batch||local||batch||CANCELLED by 0|2026-12-04T02:54:38|2026-12-04T02:54:38|2026-12-04T02:55:02|24||1|cpu=4,mem=0,node=1||13754368|cpu=00:00:00,energy=0,fs/disk=1694626,mem=13754368,pages=0,vmem=16961536|
4|root|local|low|prot.sh|/w|REQUEUED|2026-12-04T02:54:37|2026-12-04T02:54:38|2026-12-04T02:54:46|8|UNLIMITED|1|billing=4,cpu=4,node=1|1000M|||stasis-token=1796352877-394382927
4.batch||local||batch||CANCELLED|2026-12-04T02:54:38|2026-12-04T02:54:38|2026-12-04T02:54:51|13||1|cpu=4,mem=0,node=1||58667008|cpu=00:00:00,energy=0,fs/disk=12104170,mem=58667008,pages=0,vmem=75497472|
5|root|local|high|wrap|/w|COMPLETED|2026-12-04T02:54:45|2026-12-04T02:55:02|2026-12-04T02:55:07|5|UNLIMITED|1|billing=8,cpu=8,node=1|1000M|||
5.batch||local||batch||COMPLETED|2026-12-04T02:55:02|2026-12-04T02:55:02|2026-12-04T02:55:07|5||1|cpu=8,mem=0,node=1||3350528|cpu=00:00:00,energy=0,fs/disk=11083,mem=3350528,pages=0,vmem=5644288|
4|root|local|low|prot.sh|/w|COMPLETED|2026-12-04T02:54:51|2026-12-04T02:55:08|2026-12-04T02:55:42|34|UNLIMITED|1|billing=4,cpu=4,node=1|1000M|||stasis-token=1796352877-394382927
4.batch||local||batch||COMPLETED|2026-12-04T02:55:08|2026-12-04T02:55:08|2026-12-04T02:55:42|34||1|cpu=4,mem=0,node=1||53596160|cpu=00:00:00,energy=0,fs/disk=27140968,mem=53596160,pages=0,vmem=75497472|
3|root|local|low|plain.sh|/w|COMPLETED|2026-12-04T02:55:02|2026-12-04T02:55:08|2026-12-04T02:55:49|41|UNLIMITED|1|billing=4,cpu=4,node=1|400M|||
3.batch||local||batch||COMPLETED|2026-12-04T02:55:08|2026-12-04T02:55:08|2026-12-04T02:55:49|41||1|cpu=4,mem=0,node=1||13729792|cpu=00:00:00,energy=0,fs/disk=1694626,mem=13729792,pages=0,vmem=16961536|
"""

# Modelled on the above: a 2-node GPU job killed at its 1-minute limit after 78 s, its
# resubmission (same user, name and directory) starting 10 min later, and an unrelated job of
# the same name in another directory; a job that reuses id 9 later (slurmctld started clean).
TIMEOUTS = """\
9|ana|phys|gpu|train|/home/ana/run|TIMEOUT|2026-12-01T10:00:00|2026-12-01T10:00:00|2026-12-01T10:01:18|78|1|2|billing=8,cpu=8,gres/gpu=4,gres/gpu:a100=4,mem=8G,node=2|8G|||
9.batch||phys||batch||CANCELLED|2026-12-01T10:00:00|2026-12-01T10:00:00|2026-12-01T10:01:18|78||1|cpu=4,mem=8G,node=1||||
10|ana|phys|gpu|train|/home/ana/run|COMPLETED|2026-12-01T10:00:05|2026-12-01T10:11:18|2026-12-01T10:11:48|30|1|2|billing=8,cpu=8,gres/gpu=4,mem=8G,node=2|8G|||
11|ana|phys|gpu|train|/home/ana/other|COMPLETED|2026-12-01T10:05:00|2026-12-01T10:05:00|2026-12-01T10:06:00|60|1|1|billing=4,cpu=4,node=1|8G|||
9|ana|phys|gpu|train|/home/ana/run|COMPLETED|2026-12-09T09:00:00|2026-12-09T09:00:00|2026-12-09T09:01:00|60|5|1|billing=1,cpu=1,node=1|1G|||
12|bob|chem|cpu|md|/home/bob|RUNNING|2026-12-09T09:00:00|2026-12-09T09:00:00|Unknown|120|60|1|billing=1,cpu=1,node=1|1G|||
"""


def text(recorded: str) -> str:
    assert all(len(line.split("|")) == len(rep.FIELDS) for line in recorded.splitlines())
    return recorded.replace("|", rep.SEP)


SINCE, UNTIL = datetime(2026, 12, 1), datetime(2026, 12, 15)


def test_parse_folds_steps_into_their_attempt() -> None:
    records = rep.parse_sacct(text(RECORDED))
    assert [(r.job_id, r.state) for r in records] == [
        ("1", "COMPLETED"),
        ("2", "COMPLETED"),
        ("3", "PREEMPTED"),
        ("4", "REQUEUED"),
        ("5", "COMPLETED"),
        ("4", "COMPLETED"),
        ("3", "COMPLETED"),
    ]
    first4, last4 = records[3], records[5]
    assert first4.peak_mem_bytes == 58667008 and last4.peak_mem_bytes == 53596160
    assert first4.protected and not records[2].protected
    assert records[0].req_mem_bytes == 200 * 1024**2 and records[0].timelimit_min is None
    assert records[0].node_hours == 8 / 3600


def test_preemption_redone_and_kept() -> None:
    r = rep.compute(rep.parse_sacct(text(RECORDED)), SINCE, UNTIL)
    t = r.totals
    assert t.jobs == 5
    assert t.node_hours == pytest.approx((8 + 7 + 24 + 8 + 5 + 34 + 41) / 3600)
    assert (t.preempted_jobs, t.protected_jobs) == (2, 1)
    assert t.preempt_redone_node_hours == pytest.approx(24 / 3600)  # job 3 started over
    assert t.kept_node_hours == pytest.approx(8 / 3600)  # job 4 was restored
    assert t.lost_node_hours == pytest.approx(24 / 3600)
    assert set(r.groups) == {("root", "local", "low"), ("root", "local", "high")}
    assert list(r.weeks) == ["2026-W49"]


def test_memory_over_request() -> None:
    r = rep.compute(rep.parse_sacct(text(RECORDED)), SINCE, UNTIL)
    one = r.groups[("root", "local", "high")]  # job 5: 1000M asked, 3350528 bytes used
    req = 1000 * 1024**2
    assert (one.mem_measured_jobs, one.mem_overrequest_jobs) == (1, 1)
    assert (one.mem_requested_bytes, one.mem_peak_bytes) == (req, 3350528)
    assert one.mem_blocked_node_hours == pytest.approx(5 / 3600 * (req - 3350528) / req)


def test_a_peak_over_half_the_request_is_no_over_request() -> None:
    line = (
        "7|u|a|p|j|/d|COMPLETED|2026-12-02T00:00:00|2026-12-02T00:00:00|"
        "2026-12-02T01:00:00|3600|120|1|cpu=1,node=1|100M|||\n"
        "7.0||a||j||COMPLETED|2026-12-02T00:00:00|2026-12-02T00:00:00|"
        "2026-12-02T01:00:00|3600||1|cpu=1,node=1||60M|cpu=1,mem=60M|\n"
    )
    c = rep.compute(rep.parse_sacct(text(line)), SINCE, UNTIL).totals
    assert (c.mem_measured_jobs, c.mem_overrequest_jobs, c.mem_blocked_node_hours) == (1, 0, 0)
    assert c.mem_peak_bytes == 60 * 1024**2


def test_timeout_and_resubmission() -> None:
    r = rep.compute(rep.parse_sacct(text(TIMEOUTS)), SINCE, UNTIL)
    t = r.totals
    assert t.jobs == 4  # 12 still runs: not counted yet
    assert t.timeout_jobs == 1
    assert t.timeout_node_hours == pytest.approx(2 * 78 / 3600)
    assert t.timeout_gpu_hours == pytest.approx(4 * 78 / 3600)  # gres/gpu, not gres/gpu:a100
    assert t.timeout_overshoot_node_hours == pytest.approx(2 * 18 / 3600)
    # 10 follows 9 (submitted before 9 ended, started after: a dependency); 11 is elsewhere.
    assert t.resubmitted_jobs == 1
    assert t.resubmit_redone_node_hours == pytest.approx(2 * 30 / 3600)  # min(10's, 9's)
    assert sorted(r.weeks) == ["2026-W49", "2026-W50"]
    assert r.weeks["2026-W50"].jobs == 1  # the later job reusing id 9
    assert r.groups[("ana", "phys", "gpu")].gpu_hours == pytest.approx(4 * 108 / 3600)


def test_resubmission_outside_the_window_is_not_one() -> None:
    r = rep.compute(rep.parse_sacct(text(TIMEOUTS)), SINCE, UNTIL, window_s=5 * 60)
    assert r.totals.resubmitted_jobs == 0


def test_a_timeout_before_the_period_still_explains_a_resubmission_in_it() -> None:
    r = rep.compute(rep.parse_sacct(text(TIMEOUTS)), datetime(2026, 12, 1, 10, 5), UNTIL)
    assert (r.totals.timeout_jobs, r.totals.resubmitted_jobs) == (0, 1)


def test_sizes_and_tres() -> None:
    assert rep.size_bytes("1.5G") == int(1.5 * 1024**3)
    assert rep.size_bytes("100Mc", ncpus=4) == 400 * 1024**2  # older releases: per CPU
    assert rep.size_bytes("2Gn", nnodes=3) == 6 * 1024**3
    assert rep.size_bytes("") is None and rep.size_bytes("16?") is None
    assert rep.tres("cpu=2,gres/gpu=1")["gres/gpu"] == "1"


def test_a_short_line_is_a_slurm_error() -> None:
    with pytest.raises(SlurmError, match="fields"):
        rep.parse_sacct("1" + rep.SEP + "root\n")


def test_the_separator_in_an_admin_comment_is_kept() -> None:
    line = RECORDED.splitlines()[2].replace("|", rep.SEP) + " x" + rep.SEP + "y"
    [r] = rep.parse_sacct(line)
    assert r.protected


def test_dates() -> None:
    now = datetime(2026, 12, 4, 12, 30)
    assert rep.period(None, None, now) == (datetime(2026, 11, 4), now)
    assert rep.period("2026-12-01", "2026-12-02T06:00", now) == (
        datetime(2026, 12, 1),
        datetime(2026, 12, 2, 6),
    )
    with pytest.raises(UsageError, match="--since 'soon' is not a date"):
        rep.period("soon", None, now)
    with pytest.raises(UsageError, match="is not after --since"):
        rep.period("2026-12-02", "2026-12-02", now)
    with_zone = rep.parse_date("2026-12-01T00:00:00+00:00", "--since")
    assert with_zone.tzinfo is None


def test_sacct_arguments_are_steady_across_releases() -> None:
    args = rep.sacct_args(datetime(2026, 12, 1), datetime(2026, 12, 2, 3, 4, 5))
    assert args[:6] == ["sacct", "-a", "-D", "-n", "-P", "--noconvert"]
    assert args[args.index("-S") + 1] == "2026-12-01T00:00:00"
    assert args[args.index("-E") + 1] == "2026-12-02T03:04:05"
    assert "--json" not in args


def test_csv_has_one_row_per_group() -> None:
    r = rep.compute(rep.parse_sacct(text(RECORDED + TIMEOUTS)), SINCE, UNTIL)
    rows = list(csv.DictReader(io.StringIO(to_csv(r))))
    assert [(x["user"], x["account"], x["partition"]) for x in rows] == sorted(r.groups)
    assert list(rows[0]) == list(rep.GROUP_COLUMNS)
    ana = rows[0]
    assert float(ana["timeout_gpu_hours"]) == pytest.approx(4 * 78 / 3600)


def test_html_is_self_contained_and_escaped() -> None:
    hostile = TIMEOUTS.replace("ana|phys", "<script>alert(1)</script>|ph&ys")
    r = rep.compute(rep.parse_sacct(text(RECORDED + hostile)), SINCE, UNTIL)
    page = report_html.render(r, now=datetime(2026, 12, 15))
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "ph&amp;ys" in page
    assert "http://" not in page and "https://" not in page and "<link" not in page
    for svg in ("where", "users", "partitions", "trend"):
        assert f'<svg id="{svg}"' in page
    # Every week of the period is drawn, those without jobs too.
    assert all(w in page for w in ("2026-W49", "2026-W50", "2026-W51"))


def test_html_of_an_empty_period() -> None:
    r = rep.compute([], SINCE, UNTIL)
    page = report_html.render(r)
    assert "No job ended in this period." in page


def run_cli(*args: str, conf: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STASIS_CONFIG": ""}
    if conf:
        env["SLURM_CONF"] = str(conf)
    return subprocess.run(
        [STASIS, "slurm", "report", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["--since", "last week"], "--since 'last week' is not a date"),
        (["--until", "2024-02-30"], "--until '2024-02-30' is not a date"),
        (["--since", "2024-05-02", "--until", "2024-05-01"], "is not after --since"),
        (["--json", "--csv"], "not allowed with argument"),
        (["--window-h", "-1"], "--window-h"),
        (["--html", "/nonexistent/dir/r.html"], "does not exist"),
    ],
)
def test_cli_usage_errors_are_one_line(args: list[str], says: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2, result
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
    assert says in result.stderr


def test_cli_without_accounting_is_one_line(tmp_path: Path) -> None:
    """A slurm.conf whose slurmdbd port nobody listens on: sacct fails at once."""
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=c\nSlurmctldHost=localhost(127.0.0.1)\n"
        "AccountingStorageType=accounting_storage/slurmdbd\n"
        "AccountingStorageHost=127.0.0.1\nAccountingStoragePort=1\n"
        f"AuthType=auth/munge\nAccountingStoragePass={tmp_path}/munge.sock\n"
    )
    result = run_cli("--json", conf=conf)
    assert result.returncode == 1, result
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("stasis: error: cannot read Slurm's accounting (sacct): ")
    json.dumps(result.stderr)
