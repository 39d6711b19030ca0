"""What nodes report of their checkpoints and restores, and the savings shown from it: a job
checkpointed on its node (not through the control plane) is listed with its size, CRIU's time
and frozen time; restored after it was stopped, it keeps the work it had done, counted as
node-hours per cluster and per user; a report sent again counts once."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.conftest import new_daemon, wait_for, workload
from tests.controlplane.conftest import SQLITE_ONLY, ControlPlane
from tests.controlplane.test_commands import scrape
from tests.controlplane.test_node import node_credential, node_env


def test_checkpoints_and_restores_reported_with_the_work_they_keep(
    controlplane: ControlPlane, world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    cp = controlplane
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    d = new_daemon(world_tmp, "node-r", env=node_env(cp, cluster, "node-r"))
    d.start()
    try:
        job = d.run(*workload("counter.py"), label="kept", user=test_user.pw_name)["job"]
        time.sleep(2.0)  # work the checkpoint will hold
        first = d.json("dump", job, "--leave-running")
        ckpts: list[Any] = wait_for(
            lambda: cp.json("checkpoints") or None, 20, "the checkpoint report"
        )
        (c,) = ckpts
        assert (c["id"], c["job"], c["label"], c["user"], c["node"], c["cluster"]) == (
            first["checkpoint"],
            job,
            "kept",
            test_user.pw_name,
            "node-r",
            "hpc",
        )
        assert c["size_bytes"] == first["size_bytes"] > 0
        assert c["duration_s"] == first["duration_s"] and c["frozen_s"] > 0
        assert c["leave_running"] is True and c["reason"] == "asked"
        assert c["store"] == d.store and 2.0 <= c["work_s"] < 30, c
        (j,) = cp.json("jobs")
        assert j["last_checkpoint"] == first["checkpoint"] and j["last_checkpoint_age_s"] >= 0
        assert cp.json("savings")["node_hours"] == 0

        time.sleep(1.0)
        stopped = d.json("dump", job)  # stops it
        wait_for(lambda: len(cp.json("checkpoints")) == 2, 20, "the second report")
        restored = d.json("restore", stopped["checkpoint"])
        saved: dict[str, Any] = wait_for(
            lambda: (s := cp.json("savings"))["restores"] and s, 20, "the restore report"
        )
        (stop_ckpt,) = [x for x in cp.json("checkpoints") if x["id"] == stopped["checkpoint"]]
        assert stop_ckpt["leave_running"] is False and stop_ckpt["work_s"] > c["work_s"]
        hours = round(stop_ckpt["work_s"] / 3600, 4)
        assert saved["node_hours"] == hours and saved["restores"] == 1, saved
        assert saved["clusters"] == [{"cluster": "hpc", "node_hours": hours}]
        assert saved["users"] == [{"user": test_user.pw_name, "node_hours": hours}]
        assert [x["node_hours"] for x in saved["days"]] == [hours]
        kinds = [e["kind"] for e in cp.json("events")]
        assert kinds.count("checkpoint") == 2 and kinds.count("restore") == 1, kinds
        (r,) = [e for e in cp.json("events") if e["kind"] == "restore"]
        assert f"restored from checkpoint {stopped['checkpoint']}" in r["message"]

        # The restored job counts on from the work it was restored with.
        time.sleep(1.0)
        again = d.json("dump", restored["job"], "--leave-running")
        wait_for(lambda: len(cp.json("checkpoints")) == 3, 20, "the third report")
        (third,) = [x for x in cp.json("checkpoints") if x["id"] == again["checkpoint"]]
        assert third["work_s"] > stop_ckpt["work_s"] + 0.9, (third, stop_ckpt)

        # The same report twice (a heartbeat whose answer was lost) changes nothing.
        report = {
            "kind": "restore",
            "checkpoint": stopped["checkpoint"],
            "label": "kept",
            "job": restored["job"],
            "user": test_user.pw_name,
            "size_bytes": 1,
            "work_s": 99.0,
            "duration_s": 0.1,
            "at": time.time(),
        }
        status, _ = cp.call(
            "POST",
            "/api/v1/nodes/node-r/heartbeat",
            node_credential(d),
            {"jobs": [], "activity": [report]},
        )
        assert status == 200
        assert cp.json("savings")["node_hours"] == hours
        status, body = cp.call(
            "POST",
            "/api/v1/nodes/node-r/heartbeat",
            node_credential(d),
            {"jobs": [], "activity": [{**report, "checkpoint": "../x"}]},
        )
        assert status == 400 and "checkpoint" in body["error"], body
        metrics = scrape(cp, cp.admin)
        assert 'stasis_reported_checkpoints_total{cluster="hpc"} 3\n' in metrics, metrics
        assert "stasis_restores_total 1\n" in metrics
        assert f'stasis_saved_node_hours_total{{cluster="hpc"}} {hours}\n' in metrics
        # Another cluster's token sees none of it.
        other = cp.json("clusters", "add", "other", "--kind", "slurm")
        status, listed = cp.call("GET", "/api/v1/checkpoints", other["token"])
        assert (status, listed) == (200, [])
        status, theirs = cp.call("GET", "/api/v1/savings", other["token"])
        assert status == 200 and theirs["node_hours"] == 0
    finally:
        d.kill_all()
        d.stop()


@SQLITE_ONLY  # the frozen time is summed on the node
def test_a_dump_tried_again_reports_the_time_every_try_held_the_job(
    controlplane: ControlPlane,
    world_tmp: Path,
    test_user: pwd.struct_passwd,
    started: list[subprocess.Popen[str]],
) -> None:
    """A dump that caught its job mid-call to a server outside (daemon/dumping.py's retry)
    held the job frozen for its failed try too: the frozen time the node reports, which the
    interval policies weigh, counts it, not only CRIU's time of the try that succeeded."""
    cp = controlplane
    cluster = cp.json("clusters", "add", "retried", "--kind", "slurm")
    sockets = Path(tempfile.mkdtemp(prefix="sockets-", dir=world_tmp))
    os.chown(sockets, test_user.pw_uid, test_user.pw_gid)
    server = subprocess.Popen(
        workload("unixserver.py", sockets / "service.sock", 0.06),
        stdout=subprocess.PIPE,
        text=True,
    )
    started.append(server)
    assert server.stdout is not None and server.stdout.readline() == "listening\n"
    d = new_daemon(world_tmp, "node-t", env=node_env(cp, cluster, "node-t"))
    d.start()
    try:
        user = test_user.pw_name
        # A call 0.06 s long every 0.09 s: a dump's first try often catches one.
        calls = workload("unixclient.py", sockets / "service.sock", "per-call", 0.03)
        job = d.run(*calls, user=user)
        wait_for(lambda: "echo 2\n" in d.log_of(job["job"]), what="its first calls")
        # One caught at every try fails: the next one is asked.
        for _ in range(40):
            dumped = d.cli("dump", "--json", "--leave-running", job["job"], user=user, check=False)
            retried = json.loads(dumped.stdout) if dumped.returncode == 0 else {"notes": []}
            if any(n.startswith("dumped at try ") for n in retried["notes"]):
                break
        else:
            raise AssertionError("no dump of 40 caught the job mid-call")
        reported: dict[str, Any] = wait_for(
            lambda: next(
                (c for c in cp.json("checkpoints") if c["id"] == retried["checkpoint"]), None
            ),
            20,
            "the report of the dump tried again",
        )
        assert reported["duration_s"] == retried["duration_s"]
        assert reported["frozen_s"] > reported["duration_s"], reported
    finally:
        d.kill_all()
        d.stop()
