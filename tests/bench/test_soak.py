"""`python -m bench.soak` end to end, short, so the soak of `make bench` cannot rot: the site it
builds (S3 server behind the cutting proxy, control plane, two node daemons) comes up, a real
fault runs through a cycle, and each kind of loss the soak counts is seen when it happens
(sabotage: every checkpoint deleted and the job killed, the counter SIGSTOPped, a second copy of
it outside any job). Whether stasis itself loses work under faults is the soak's figure, not this
test's: the full run (make bench) reports it."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.geteuid() != 0, reason="the node daemons need root")
def test_short_soak_counts_each_kind_of_loss(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--cycles",
            "4",
            "--seed",
            "28",
            "--jobs",
            "2",
            "--in-turn",
            "--actions",
            "dump-leave",
            "--settle",
            "5",
            "--faults",
            "sabotage,sabotage,sabotage,daemon-kill",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=170)
    took = time.monotonic() - start
    assert proc.returncode == 0, err[-3000:] + out[-3000:]
    [table] = tmp_path.glob("soak-*.csv")
    with table.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["action"], r["fault"], r["detail"]) for r in rows[:3]] == [
        ("sabotage", "sabotage", "lose"),
        ("sabotage", "sabotage", "freeze"),
        ("sabotage", "sabotage", "stray"),
    ], rows
    lose, freeze, stray, real = rows
    # Each loss counted where it happened, and only that one.
    assert (int(lose["lost_labels"]), float(lose["lost_s"]) > 0) == (1, True), lose
    assert (int(freeze["frozen"]), int(freeze["lost_labels"])) == (1, 0), freeze
    assert (int(stray["orphans"]), int(stray["frozen"])) == (1, 0), stray
    # The real fault: a leave-running dump while its daemon is SIGKILLed.
    assert (real["action"], real["fault"]) == ("dump-leave", "daemon-kill")
    assert real["detail"].startswith("SIGKILL node-"), real
    summary = table.with_suffix(".md").read_text()
    assert "| sabotage | 3 | 0 | 3 | 3 |" in summary, summary
    assert "| daemon-kill | 1 |" in summary, summary
    # Nothing of the site outlives the soak: no counter it started still runs (its labels
    # begin with soak<its pid>).
    assert (
        f" soak{proc.pid}-"
        not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    )
    assert took < 120, f"the short soak took {took:.0f} s"
