"""A job with --time=1 whose work needs about 3 minutes finishes across several checkpoint,
requeue and restore cycles (cli_filter asks for SIGURG ahead of the limit)."""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import TIME_LIMIT_WORK_S, LongJob


@pytest.mark.timeout(600)
def test_job_longer_than_its_time_limit_finishes(time_limit_job: LongJob) -> None:
    c, job = time_limit_job.cluster, time_limit_job.job_id
    c.wait_state(job, ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), 540)
    info, out = c.job(job), c.output(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    assert info["TimeLimit"] == "00:01:00"
    restarts = int(info["Restarts"])
    assert restarts >= 2, out  # far more work than one time limit allows
    assert out.count("stasis: restored checkpoint") == restarts
    assert out.count("SIGURG: taking a checkpoint") == restarts
    # Every value exactly once, in order: each cycle went on where the previous one stopped.
    assert re.findall(r"^(\d+)$", out, re.M) == [str(i) for i in range(TIME_LIMIT_WORK_S)]
    # The workload's last word, once. stasis's and Slurm's own lines may follow it: the time
    # limit can come between the workload's last print and its exit, and that last checkpoint is
    # taken, restored and finished after "done" (CI saw exactly this).
    lines = out.rstrip().splitlines()
    own = [ln for ln in lines if not ln.startswith(("stasis:", "slurmstepd"))]
    assert own[-1] == "done" and lines.count("done") == 1, out
    assert lines[-1].startswith("stasis: job completed"), out
