"""The node daemon SIGKILLed at each step of a restore (issue 28), in every restore mode:
in place (a root-only local store, the daemon's gate), streamed (compressed images in a local
store), lazy with pages served by the daemon (a store CRIU cannot read), fetched (a full
restore from S3). Then started again: the job runs once (adopted if its tree resumed before
the daemon recorded it), or not at all with its checkpoint still listed and a restore asked
again running it once; nothing frozen, no tree without a row."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_restore_state import numbers
from tests.faults import kit
from tests.s3server import S3Server

MODES = ("inplace", "streamed", "lazy", "fetched")
STEPS = ("recorded", "before-resume", "after-resume")


def _daemon(mode: str, make_daemon: MakeDaemon, world_tmp: Path, request: Any) -> Daemon:
    if mode == "lazy":  # a store CRIU cannot read: the daemon serves the pages
        return make_daemon(store=f"dir::file://{world_tmp}/lazy-{os.urandom(4).hex()}")
    if mode == "fetched":  # S3: fetched, checked, then restored in full
        s3: S3Server = request.getfixturevalue("s3")
        bucket = request.getfixturevalue("s3_bucket")
        return make_daemon(store=f"s3://{bucket}/f", env=s3.env())
    return make_daemon()


def counted(d: Daemon, job_id: str) -> list[int]:
    return numbers((d.state_dir / "logs" / f"{job_id}.log").read_text())


def _trees(label: str) -> list[int]:
    """Processes of the label's counter (its init and the counter), wherever they run."""
    return [p for p in kit.tree_pids_of(label) if p != os.getpid()]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("mode", MODES)
def test_daemon_killed_during_a_restore(
    make_daemon: MakeDaemon, world_tmp: Path, request: Any, mode: str, step: str
) -> None:
    d = _daemon(mode, make_daemon, world_tmp, request)
    label = f"fr-{os.urandom(3).hex()}"
    job = d.run(*workload("counter.py", 0.05, 8, label), label=label)
    wait_for(lambda: len(counted(d, job["job"])) >= 3, 20, "counting")
    compress = ["--compress", "zstd"] if mode == "streamed" else []
    d.json("dump", *compress, job["job"])
    mark = counted(d, job["job"])[-1]
    lazy = ["--lazy"] if mode == "lazy" else []
    kit.kill_at(d, f"restore.{mode}.{step}", "restore", *lazy, "--label", label)
    # The next start settles what the restore left: no row stays `restoring`.
    wait_for(
        lambda: not [j for j in d.json("ps") if j["state"] == "restoring"],
        15,
        "no job left restoring",
    )
    live = kit.live_jobs(d, label)
    assert len(live) <= 1, live
    kit.assert_nothing_frozen([j["pid"] for j in live])
    kit.assert_not_lost(d, label)
    if step == "after-resume" and mode != "lazy":
        # It resumed before the daemon could record it: adopted, not lost, not restarted.
        assert len(live) == 1, d.json("ps")
    if not live:
        # Nothing runs of it: a restore asked again runs it once.
        assert not _trees(label), "a tree runs without a row"
        again = d.json("restore", *lazy, "--label", label)
        live = kit.live_jobs(d, label)
        assert [j["job"] for j in live] == [again["job"]]
    wait_for(lambda: counted(d, job["job"])[-1] > mark + 2, 20, "the counter to go on")
    # One count, continued from the checkpoint: never restarted from 0, never two counters.
    values = counted(d, job["job"])
    assert values.count(0) == 1, "counted from the beginning again"
    assert len(_trees(label)) <= 2, f"the job runs twice: {_trees(label)}"
    for j in live:
        d.cli("kill", j["job"])


def test_a_job_started_but_not_recorded_is_adopted(make_daemon: MakeDaemon) -> None:
    """The daemon killed after the job's supervisor started it, before its row was written:
    the next start adopts it from its directory (job.json, pid.json), listed and the owner's
    to stop, its counter going on; nothing started twice."""
    d = make_daemon()
    label = f"fo-{os.urandom(3).hex()}"
    kit.kill_at(
        d, "run.after-start", "run", "--label", label, "--", *workload("counter.py", 0.05, 0, label)
    )
    live = kit.live_jobs(d, label)
    assert len(live) == 1, d.json("ps")
    job = live[0]
    assert job["state"] == "running" and job["label"] == label
    assert "adopted job" in (d.root / "daemon.log").read_text()
    wait_for(lambda: len(counted(d, job["job"])) >= 5, 20, "the counter to go on")
    assert len(_trees(label)) <= 2, f"the job runs twice: {_trees(label)}"
    d.cli("kill", job["job"])
    assert not kit.live_jobs(d, label)
