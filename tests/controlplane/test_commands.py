"""Commands from the control plane to a node (leased, carried out, acknowledged), the first of
them a checkpoint of a job: taken once, even when the control plane dies between the node's
lease and its acknowledgement."""

from __future__ import annotations

import contextlib
import pwd
import signal
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.conftest import Daemon, new_daemon, wait_for, workload
from tests.controlplane.conftest import ControlPlane
from tests.controlplane.test_node import node_env


def test_a_job_is_checkpointed_from_the_control_plane_and_goes_on(
    controlplane: ControlPlane, world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    cp = controlplane
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    d = new_daemon(world_tmp, "node-c", env=node_env(cp, cluster, "node-c"))
    d.start()
    try:
        job = d.run(*workload("counter.py"), label="cp-cmd")["job"]
        wait_for(lambda: [j["job"] for j in cp.json("jobs")] == [job], 30, "the job to be reported")
        (reported,) = cp.json("jobs")
        assert (reported["node"], reported["label"], reported["state"]) == (
            "node-c",
            "cp-cmd",
            "running",
        )
        done = cp.json("checkpoint", job)
        assert done["state"] == "done" and done["attempts"] == 1, done
        ckpt = done["result"]["checkpoint"]
        assert [c["id"] for c in d.json("checkpoints") if c["label"] == "cp-cmd"] == [ckpt]
        assert d.job(job)["state"] == "running"  # leave-running
        r = cp.cli("checkpoint", job)
        assert (
            r.returncode == 0
            and r.stdout.startswith("checkpoint ")
            and f"of job {job} on node node-c (label cp-cmd)" in r.stdout
        ), r.stderr
        r = cp.cli("checkpoint", "nope")
        assert (r.returncode, r.stderr.strip()) == (
            2,
            "stasis: error: no node reports a job nope: `stasis controlplane jobs` lists them",
        )
        actions = cp.json("actions")
        assert [(a["kind"], a["state"]) for a in actions] == [("checkpoint", "done")] * 2
        # A node token may not queue commands.
        status, _ = cp.call(
            "POST", "/api/v1/commands", cluster["token"], {"kind": "checkpoint", "job": job}
        )
        assert status == 403
        metrics = scrape(cp, cp.admin)
        assert "stasis_checkpoints_total 2\n" in metrics, metrics
        assert 'stasis_nodes{cluster="hpc",state="ready"} 1\n' in metrics
        assert 'stasis_jobs{cluster="hpc",node="node-c"} 1\n' in metrics
        assert 'stasis_commands{kind="checkpoint",state="done"} 2\n' in metrics
        assert "stasis_checkpoint_bytes_total 0\n" not in metrics
        for token, code in ((cluster["token"], 403), ("", 401)):
            try:
                scrape(cp, token)
                raise AssertionError("metrics served")
            except urllib.error.HTTPError as e:
                assert e.code == code
    finally:
        d.kill_all()
        d.stop()


def scrape(cp: ControlPlane, token: str) -> str:
    req = urllib.request.Request(cp.url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=20) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        return str(r.read().decode())


def test_a_command_whose_acknowledgement_is_lost_is_carried_out_once(
    world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    root = Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp))
    cp = ControlPlane(root, str(root / "cp.db"))
    cp.start("--command-lease", "2")
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    d = new_daemon(world_tmp, "node-o", env=node_env(cp, cluster, "node-o"))
    d.start()
    try:
        # Enough memory that its dump takes a while: the window between lease and ack.
        job = d.run(*workload("memhold.py", 192), label="cp-once")["job"]
        wait_for(lambda: "ready" in d.log_of(job), 30, "the job to fill its memory")
        wait_for(lambda: [j["job"] for j in cp.json("jobs")] == [job], 30, "the job report")
        status, cmd = cp.call(
            "POST", "/api/v1/commands", cp.admin, {"kind": "checkpoint", "job": job}
        )
        assert status == 201
        wait_for(
            lambda: cp.call("GET", f"/api/v1/commands/{cmd['id']}", cp.admin)[1]["state"]
            == "leased",
            30,
            "the node to lease the command",
        )
        # The control plane dies while the node is at work: its acknowledgement is lost.
        assert cp.proc is not None
        cp.proc.send_signal(signal.SIGKILL)
        cp.proc.wait()
        wait_for(
            lambda: len([c for c in d.json("checkpoints") if c["label"] == "cp-once"]),
            60,
            "the node's checkpoint",
        )
        time.sleep(1)
        cp.start("--command-lease", "2")

        def acknowledged() -> dict[str, Any] | None:
            c: dict[str, Any] = cp.call("GET", f"/api/v1/commands/{cmd['id']}", cp.admin)[1]
            return c if c["state"] == "done" else None

        final = wait_for(acknowledged, 60, "the command to be acknowledged")
        assert final["attempts"] == 2, final
        (only,) = [c["id"] for c in d.json("checkpoints") if c["label"] == "cp-once"]
        assert final["result"]["checkpoint"] == only
        assert "was carried out already: answered again" in (d.root / "daemon.log").read_text()
    finally:
        d.kill_all()
        d.stop()
        cp.stop()


@contextlib.contextmanager
def site_nodes(
    cp: ControlPlane, world_tmp: Path, site_key: Path, *names: str, separate: bool = False
) -> Iterator[dict[str, Daemon]]:
    """Daemons that are nodes of one cluster and one site: a store they share, a site key
    they all sign and trust with. `separate`: each a host of its own (tests/nodes.py; the
    control plane must then listen on the nodes' network: the site_controlplane fixture)."""
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    store = Path(tempfile.mkdtemp(prefix="shared-store-", dir=world_tmp))
    daemons = {
        n: new_daemon(
            world_tmp,
            n,
            store=str(store),
            separate=separate,
            env={**node_env(cp, cluster, n), "STASIS_SITE_KEY": str(site_key)},
        )
        for n in names
    }
    started = []
    try:
        for d in daemons.values():
            d.start()
            started.append(d)
        yield daemons
    finally:
        for d in started:
            d.kill_all()
            d.stop()


def test_a_job_migrated_to_another_node_continues_its_count_there(
    site_controlplane: ControlPlane, world_tmp: Path, site_key: Path, test_user: pwd.struct_passwd
) -> None:
    cp = site_controlplane
    with site_nodes(cp, world_tmp, site_key, "node-a", "node-b", separate=True) as nodes:
        a, b = nodes["node-a"], nodes["node-b"]
        job = a.run(*workload("counter.py"), label="cp-move", user=test_user.pw_name)["job"]
        wait_for(lambda: len(a.log_of(job).split()) >= 5, 30, "the counter to count")
        wait_for(lambda: [j["job"] for j in cp.json("jobs")] == [job], 30, "the job report")
        r = cp.cli("migrate", job, "--to", "node-a")
        assert (r.returncode, r.stderr.strip()) == (
            2,
            f"stasis: error: job {job} runs on node-a already",
        )
        r = cp.cli("migrate", job, "--to", "node-z")
        assert (r.returncode, r.stderr.strip()) == (
            2,
            "stasis: error: no node node-z in " "cluster hpc",
        )
        moved = cp.json("migrate", job, "--to", "node-b")
        assert (moved["from_node"], moved["node"], moved["from_job"]) == ("node-a", "node-b", job)
        before = [int(x) for x in a.log_of(job).split()]
        assert a.job(job)["state"] == "checkpointed"
        new = moved["job"]
        wait_for(
            lambda: len(b.log_of(new).split()) >= len(before) + 3, 30, "the counter to go on on B"
        )
        # The job's log travels with it: what it wrote on A, then what it counts on B.
        after = [int(x) for x in b.log_of(new).split()]
        assert after[: len(before)] == before
        assert after[len(before)] == before[-1] + 1, (before[-3:], after[len(before) :][:3])
        wait_for(
            lambda: [(j["node"], j["job"]) for j in cp.json("jobs")] == [("node-b", new)],
            30,
            "the job to be reported on node-b",
        )
        assert cp.json("jobs")[0]["user"] == test_user.pw_name  # still its owner's
        assert [(x["kind"], x["node"], x["state"]) for x in cp.json("actions")] == [
            ("checkpoint", "node-a", "done"),
            ("restore", "node-b", "done"),
        ]


def test_a_drain_moves_every_job_off_a_node_and_each_goes_on_elsewhere(
    site_controlplane: ControlPlane, world_tmp: Path, site_key: Path, test_user: pwd.struct_passwd
) -> None:
    cp = site_controlplane
    with site_nodes(
        cp, world_tmp, site_key, "node-a", "node-b", "node-c", separate=True
    ) as daemons:
        a = daemons["node-a"]
        jobs = [a.run(*workload("counter.py"), label=f"drain-{i}")["job"] for i in range(2)]
        wait_for(
            lambda: sorted(j["job"] for j in cp.json("jobs")) == sorted(jobs),
            30,
            "the jobs' report",
        )
        before = {j: [int(x) for x in a.log_of(j).split()] for j in jobs}
        done = cp.json("drain", "node-a")
        assert done["empty"] and not done["failed"], done
        # One each: the node with the fewest jobs takes the next one.
        assert sorted(m["node"] for m in done["moved"]) == ["node-b", "node-c"]
        for m in done["moved"]:
            d = daemons[m["node"]]
            old = [int(x) for x in a.log_of(m["from_job"]).split()]
            assert len(old) >= len(before[m["from_job"]])
            wait_for(
                lambda: len(d.log_of(m["job"]).split()) >= len(old) + 3,
                30,
                f"job {m['job']} to count on {m['node']}",
            )
            after = [int(x) for x in d.log_of(m["job"]).split()]
            assert after[len(old)] == old[-1] + 1
        assert {j["node"] for j in cp.json("jobs")} == {"node-b", "node-c"}
        r = cp.cli("drain", "node-z")
        assert (r.returncode, r.stderr.strip()) == (2, "stasis: error: no node node-z")


def test_a_migrate_policy_moves_the_jobs_it_picks_to_the_least_busy_node(
    site_controlplane: ControlPlane, world_tmp: Path, site_key: Path, test_user: pwd.struct_passwd
) -> None:
    cp = site_controlplane
    with site_nodes(cp, world_tmp, site_key, "node-a", "node-b", separate=True) as nodes:
        a, b = nodes["node-a"], nodes["node-b"]
        job = a.run(*workload("counter.py"), label="pol-move")["job"]
        wait_for(lambda: len(a.log_of(job).split()) >= 3, 30, "the counter to count")
        wait_for(lambda: [j["job"] for j in cp.json("jobs")] == [job], 30, "the job report")
        cp.json(
            "policies", "add", "off-a", "--on", "webhook", "--action", "migrate", "--node", "node-a"
        )
        assert cp.json("policies", "run", "off-a")["queued"] == 1
        moved = wait_for(
            lambda: [j for j in cp.json("jobs") if j["node"] == "node-b"], 60, "the job on node-b"
        )
        before = [int(x) for x in a.log_of(job).split()]
        new = moved[0]["job"]
        wait_for(lambda: len(b.log_of(new).split()) >= len(before) + 2, 30, "the count on B")
        after = [int(x) for x in b.log_of(new).split()]
        assert after[len(before)] == before[-1] + 1  # went on
        (first,) = [c for c in cp.json("actions") if c["kind"] == "checkpoint"]
        assert first["args"]["policy"] == "off-a" and first["args"]["then_restore_on"] == "node-b"
        # Nothing left on node-a for it to move.
        assert cp.json("policies", "run", "off-a")["queued"] == 0
