"""Policies run by the control plane: a periodic checkpoint of the jobs a filter picks, and
retention that deletes all but each label's newest checkpoints, on real node daemons."""

from __future__ import annotations

import pwd
import time
from pathlib import Path

from tests.conftest import new_daemon, wait_for, workload
from tests.controlplane.conftest import ControlPlane
from tests.controlplane.test_node import node_env


def test_a_periodic_policy_checkpoints_what_it_picks_and_retention_keeps_the_newest(
        controlplane: ControlPlane, world_tmp: Path, test_user: pwd.struct_passwd) -> None:
    cp = controlplane
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    d = new_daemon(world_tmp, "node-p", env=node_env(cp, cluster, "node-p"))
    d.start()

    def ids(label: str) -> list[str]:
        return [c["id"] for c in d.json("checkpoints") if c["label"] == label]

    try:
        picked = d.run(*workload("counter.py"), label="pol-train")["job"]
        other = d.run(*workload("counter.py"), label="other")["job"]
        for _ in range(2):
            d.cli("dump", "--leave-running", other)
        wait_for(lambda: len(cp.json("jobs")) == 2, 30, "the jobs' report")
        r = cp.cli("policies", "add", "p", "--every", "1", "--action", "retain")
        assert (r.returncode, r.stderr.strip()) == (
            2, "stasis: error: retain needs keep >= 1 (the newest checkpoints each label keeps) "
               "or older_than_s")
        added = cp.json("policies", "add", "often", "--every", "1", "--action", "checkpoint",
                        "--label", "pol-*")
        assert added["filters"] == {"label": "pol-*"}
        wait_for(lambda: len(ids("pol-train")) >= 3, 60, "three periodic checkpoints")
        assert len(ids("other")) == 2  # not picked
        assert d.job(picked)["state"] == "running"  # leave-running
        cp.json("policies", "rm", "often")
        n = len(ids("pol-train"))
        newest = ids("pol-train")[0]
        cp.json("policies", "add", "keep-1", "--every", "1s", "--action", "retain", "--keep",
                "1", "--label", "pol-*")
        wait_for(lambda: ids("pol-train") == [newest], 60, "retention to keep the newest")
        assert n >= 3 and len(ids("other")) == 2
        assert [p["name"] for p in cp.json("policies", "list")] == ["keep-1"]
        kinds = {(a["kind"], a["state"]) for a in cp.json("actions")}
        assert ("checkpoint", "done") in kinds and ("retain", "done") in kinds
        cp.json("policies", "rm", "keep-1")

        # A webhook policy runs when called, never by itself.
        cp.json("policies", "add", "hook", "--on", "webhook", "--action", "checkpoint",
                "--label", "other")
        assert cp.json("policies", "run", "hook") == {"name": "hook", "queued": 1}
        wait_for(lambda: len(ids("other")) == 3, 30, "the webhook's checkpoint")
        time.sleep(2.5)
        assert len(ids("other")) == 3
        # Retention by age: all but the newest are older than a second.
        newest = ids("other")[0]
        cp.json("policies", "add", "old", "--on", "webhook", "--action", "retain",
                "--older-than", "1s", "--label", "other")
        time.sleep(1.5)
        cp.json("policies", "run", "old")
        wait_for(lambda: ids("other") == [newest], 30, "retention by age")
        r = cp.cli("policies", "run", "nope")
        assert (r.returncode, r.stderr.strip()) == (2, "stasis: error: no policy nope")
        happened = cp.json("events")
        kinds_seen = {e["kind"] for e in happened}
        assert {"node-joined", "command-done", "policy-run"} <= kinds_seen, kinds_seen
        assert any(e["message"].startswith("policy hook (webhook): 1 command(s)")
                   for e in happened)
        assert [e["id"] for e in happened] == sorted(e["id"] for e in happened)
    finally:
        d.kill_all()
        d.stop()
