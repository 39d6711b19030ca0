"""Policies run by the control plane: a periodic checkpoint of the jobs a filter picks, and
retention that deletes all but each label's newest checkpoints, on real node daemons."""

from __future__ import annotations

import pwd
import time
from pathlib import Path

from tests.conftest import new_daemon, wait_for, workload
from tests.controlplane.conftest import SQLITE_ONLY, ControlPlane
from tests.controlplane.test_node import node_env


# SQLite only: which jobs a policy picks and keeps is decided in Python; a policy's run on
# PostgreSQL is test_commands' migrate policy.
@SQLITE_ONLY
def test_a_periodic_policy_checkpoints_what_it_picks_and_retention_keeps_the_newest(
    controlplane: ControlPlane, world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
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
            2,
            "stasis: error: retain needs keep >= 1 (the newest checkpoints each label "
            "keeps), older_than_s or completed",
        )
        added = cp.json(
            "policies", "add", "often", "--every", "1", "--action", "checkpoint", "--label", "pol-*"
        )
        assert added["filters"] == {"label": "pol-*"}
        wait_for(lambda: len(ids("pol-train")) >= 3, 60, "three periodic checkpoints")
        assert len(ids("other")) == 2  # not picked
        assert d.job(picked)["state"] == "running"  # leave-running
        cp.json("policies", "rm", "often")
        # A checkpoint it queued just before may still be under way: its newest is the last.
        wait_for(
            lambda: all(c["state"] in ("done", "failed") for c in cp.json("actions")),
            60,
            "the removed policy's last checkpoint",
        )
        n = len(ids("pol-train"))
        newest = ids("pol-train")[0]
        cp.json(
            "policies",
            "add",
            "keep-1",
            "--every",
            "1s",
            "--action",
            "retain",
            "--keep",
            "1",
            "--label",
            "pol-*",
        )
        wait_for(lambda: ids("pol-train") == [newest], 60, "retention to keep the newest")
        assert n >= 3 and len(ids("other")) == 2
        assert [p["name"] for p in cp.json("policies", "list")] == ["keep-1"]
        kinds = {(a["kind"], a["state"]) for a in cp.json("actions")}
        assert ("checkpoint", "done") in kinds and ("retain", "done") in kinds
        cp.json("policies", "rm", "keep-1")

        # A webhook policy runs when called, never by itself.
        cp.json(
            "policies",
            "add",
            "hook",
            "--on",
            "webhook",
            "--action",
            "checkpoint",
            "--label",
            "other",
        )
        assert cp.json("policies", "run", "hook") == {"name": "hook", "queued": 1}
        wait_for(lambda: len(ids("other")) == 3, 30, "the webhook's checkpoint")
        time.sleep(2.5)
        assert len(ids("other")) == 3
        # Retention by age: all but the newest are older than a second.
        newest = ids("other")[0]
        cp.json(
            "policies",
            "add",
            "old",
            "--on",
            "webhook",
            "--action",
            "retain",
            "--older-than",
            "1s",
            "--label",
            "other",
        )
        time.sleep(1.5)
        cp.json("policies", "run", "old")
        wait_for(lambda: ids("other") == [newest], 30, "retention by age")
        # Retention of completed jobs: a label whose job exited 0 loses all its checkpoints;
        # a running job's label keeps its own.
        fin = d.run("python3", "-c", "import time; time.sleep(4)", label="fin")["job"]
        for _ in range(2):
            d.cli("dump", "--leave-running", fin)
        wait_for(lambda: d.job(fin)["state"] == "exited", 30, "the short job to end")
        assert len(ids("fin")) == 2
        cp.json("policies", "add", "done", "--on", "webhook", "--action", "retain", "--completed")
        cp.json("policies", "run", "done")
        wait_for(
            lambda: ids("fin") == [],
            30,
            "the completed job's checkpoints deleted: "
            f"{[a for a in cp.json('actions') if a['kind'] == 'retain'][-2:]} "
            f"{(d.root / 'daemon.log').read_text()[-1500:]}",
        )
        assert ids("other") == [newest] and ids("pol-train")  # running: kept
        r = cp.cli("policies", "run", "nope")
        assert (r.returncode, r.stderr.strip()) == (2, "stasis: error: no policy nope")
        happened = cp.json("events")
        kinds_seen = {e["kind"] for e in happened}
        assert {"node-joined", "command-done", "policy-run"} <= kinds_seen, kinds_seen
        assert any(e["message"].startswith("policy hook (webhook): 1 command(s)") for e in happened)
        assert [e["id"] for e in happened] == sorted(e["id"] for e in happened)
    finally:
        d.kill_all()
        d.stop()


# SQLite only: the memory filter is Python; lost nodes on PostgreSQL: test_node.
@SQLITE_ONLY
def test_memory_trigger_filters_and_lost_nodes(
    controlplane: ControlPlane, world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    """A job above a share of its node's memory is checkpointed (again only after the
    cooldown); size and age filters pick; a node that stops reporting is said lost once, and
    back when it reports again."""
    cp = controlplane
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    d = new_daemon(world_tmp, "node-m", env=node_env(cp, cluster, "node-m"))
    d.start()

    def ids(label: str) -> list[str]:
        return [c["id"] for c in d.json("checkpoints") if c["label"] == label]

    try:
        big = d.run(*workload("memhold.py", 64), label="mem-big")["job"]
        small = d.run(*workload("counter.py"), label="mem-small")["job"]
        jobs = wait_for(
            lambda: (js := {j["job"]: j for j in cp.json("jobs")})
            and js.get(big, {}).get("rss_bytes", 0) > 60 << 20
            and js,
            30,
            "the jobs' sizes reported",
        )
        assert 0 < jobs[small]["rss_bytes"] < 60 << 20
        (node,) = cp.json("nodes")
        total = node["mem_total_bytes"]
        assert total > 1 << 30 and node["scheduler_state"] is None  # no Slurm here
        pct = 100 * (48 << 20) / total  # between the two jobs' shares
        r = cp.cli("policies", "add", "m", "--on", "memory", "--action", "checkpoint")
        assert (r.returncode, r.stderr.strip()) == (
            2,
            "stasis: error: a memory trigger needs threshold_pct, above 0 and at most 100",
        )
        cp.json(
            "policies",
            "add",
            "mem",
            "--on",
            "memory",
            "--above",
            f"{pct:.6f}",
            "--every",
            "600",
            "--action",
            "checkpoint",
        )
        wait_for(lambda: len(ids("mem-big")) == 1, 30, "the big job's checkpoint")
        time.sleep(3)  # the trigger is looked at every second: once in the cooldown
        assert len(ids("mem-big")) == 1 and ids("mem-small") == []
        (c,) = [c for c in cp.json("checkpoints") if c["label"] == "mem-big"]
        assert c["reason"] == "policy mem"
        cp.json("policies", "rm", "mem")
        # Size and age filters on a webhook policy.
        cp.json(
            "policies",
            "add",
            "sized",
            "--on",
            "webhook",
            "--action",
            "checkpoint",
            "--min-size",
            "32M",
        )
        assert cp.json("policies", "run", "sized")["queued"] == 1  # the big one only
        cp.json(
            "policies",
            "add",
            "aged",
            "--on",
            "webhook",
            "--action",
            "checkpoint",
            "--min-age",
            "1h",
        )
        assert cp.json("policies", "run", "aged")["queued"] == 0  # none has run an hour
        r = cp.cli(
            "policies",
            "add",
            "bad",
            "--on",
            "webhook",
            "--action",
            "checkpoint",
            "--min-size",
            "lots",
        )
        assert r.returncode == 2 and "bad size 'lots'" in r.stderr
        wait_for(lambda: len(ids("mem-big")) == 2, 30, "the sized policy's checkpoint")

        d.kill_all()
        d.stop()
        wait_for(
            lambda: any(e["kind"] == "node-lost" for e in cp.json("events")),
            20,
            "the node-lost event",
        )
        (lost,) = [e for e in cp.json("events") if e["kind"] == "node-lost"]
        assert lost["node"] == "node-m" and "is lost: silent for" in lost["message"]
        time.sleep(2)
        assert [e["kind"] for e in cp.json("events")].count("node-lost") == 1  # said once
        d.start()
        wait_for(
            lambda: any(e["kind"] == "node-back" for e in cp.json("events")),
            20,
            "the node-back event",
        )
    finally:
        d.kill_all()
        d.stop()
