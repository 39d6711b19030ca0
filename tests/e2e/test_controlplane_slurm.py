"""The control plane's web installer on a real Slurm cluster: the node (stasis uninstalled from
it first) runs `curl $URL/install/slurm -H "Authorization: Bearer $TOKEN" | bash -s --
--node-role ...`, which installs stasis from the control plane's wheel into a fresh virtual
environment, writes the control plane's settings into the node daemon's config and installs the
plugin set; the restarted daemon joins the control plane. A protected job, preempted, is
checkpointed and restored, and both show in the control plane (events, checkpoints, savings,
the job while it runs). Then the control plane acts on Slurm jobs: a checkpoint of a running
job from `stasis controlplane checkpoint`, a drain of the node (drained in Slurm, its job
checkpointed and requeued, the node reported empty; resumed, the job goes on from its
checkpoint), and a policy triggered by an admin's own `scontrol update State=DRAIN`."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stasis.dev import slurmcluster
from tests.conftest import wait_for
from tests.controlplane.conftest import ControlPlane
from tests.e2e.conftest import Cluster


@pytest.fixture(scope="module")
def controlplane_of(cluster: Cluster) -> Iterator[ControlPlane]:
    root = Path(tempfile.mkdtemp(prefix="cp-", dir=cluster.root))
    cp = ControlPlane(root, str(root / "controlplane.db"))
    cp.start()
    yield cp
    cp.stop()


def test_the_web_installer_joins_a_slurm_node_and_shows_its_preemption(
    cluster: Cluster, controlplane_of: ControlPlane
) -> None:
    cp = controlplane_of
    root = cp.root
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    lay = cluster.lay
    cluster.stasis("slurm", "uninstall", "--slurm-conf", str(lay.slurm_conf))
    assert "JobSubmitPlugins" not in lay.slurm_conf.read_text()
    # The wrong cluster kind or no token: refused, nothing to pipe into bash.
    kube = cp.json("clusters", "add", "kube", "--kind", "kubernetes")
    status, body = cp.call("GET", "/install/slurm", kube["token"])
    assert status == 400 and "is a kubernetes cluster" in body["error"]
    assert cp.call("GET", "/install/stasis.whl")[0] == 401

    prefix = root / "opt-stasis"
    install = subprocess.run(
        [
            "bash",
            "-c",
            'curl -fsSL "$URL/install/slurm" -H "Authorization: Bearer $TOKEN" '
            '| bash -s -- --node-role controller --node-role worker '
            '--node-role login --slurm-conf "$SLURM_CONF" --lib-dir "$LIB" '
            '--no-systemd',
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **cluster.env,
            "URL": cp.url,
            "TOKEN": hpc["token"],
            "LIB": str(lay.lib),
            "STASIS_PREFIX": str(prefix),
            "STASIS_CONFIG": str(lay.stasis_config),
            "STASIS_NODE_NAME": "slurm-node",
        },
    )
    said = install.stderr + install.stdout
    assert install.returncode == 0, said
    assert "installing stasis" in said and "controlplane_url" in said, said
    assert hpc["token"] not in said  # never printed
    assert (prefix / "bin" / "stasis").exists()
    config = lay.stasis_config.read_text()
    assert f'auth_token = "{hpc["token"]}"' in config and f'"{cp.url}"' in config
    assert os.stat(lay.stasis_config).st_mode & 0o777 == 0o600
    # The launcher the plugin starts is the one the installer put in place.
    assert str(prefix) in (lay.lib / "stasis-slurm-launch").read_text()
    cluster.run("scontrol", "reconfigure")
    slurmcluster.stop_daemon(cluster.root)
    slurmcluster.start_daemon(cluster.root)
    wait_for(
        lambda: [n["name"] for n in cp.json("nodes")] == ["slurm-node"],
        30,
        "the node in the control plane",
    )
    (node,) = cp.json("nodes")
    assert node["slurm_version"] and node["cluster"] == "hpc"

    victim = cluster.counter_script(
        "cpvictim", "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=cpvictim", stop=40, interval=0.5
    )
    preemptor = cluster.script(
        "cppreemptor",
        "sleep 1",
        "--partition=high",
        "--cpus-per-task=8",
        f"--output={cluster.work}/cppreemptor-%j.out",
    )
    v = cluster.sbatch(victim)
    cluster.wait_number(v, 4)
    wait_for(
        lambda: [(j["job"], j["kind"], j["label"]) for j in cp.json("jobs")]
        == [(v, "slurm", "cpvictim")],
        30,
        "the Slurm job in the control plane",
    )
    cluster.sbatch(preemptor)
    cluster.wait_state(v, ("COMPLETED", "FAILED", "CANCELLED"), 150)
    out = cluster.output(v)
    assert "SIGURG: taking a checkpoint" in out and "stasis: restored checkpoint" in out
    assert re.findall(r"^(\d+)$", out, re.M) == [str(i) for i in range(40)], out

    def reported() -> list[dict[str, Any]] | None:
        events = cp.json("events")
        kinds = [e["kind"] for e in events]
        return events if "checkpoint" in kinds and "restore" in kinds else None

    events = wait_for(
        reported,
        30,
        "the checkpoint and the restore in the control plane: "
        f"{cp.json('events')}; daemon log: "
        f"{(lay.stasis / 'daemon.log').read_text()[-3000:]}",
    )
    (ckpt,) = [e for e in events if e["kind"] == "checkpoint"]
    assert f"of job {v} (label cpvictim" in ckpt["message"]
    assert "preemption or time limit" in ckpt["message"], ckpt
    assert "job stopped" in ckpt["message"] and ckpt["node"] == "slurm-node"
    (restore,) = [e for e in events if e["kind"] == "restore"]
    assert f"job {v} (label cpvictim" in restore["message"]
    (c,) = cp.json("checkpoints", "--deleted")
    assert c["reason"] == "preemption or time limit" and c["work_s"] > 1.0
    saved = cp.json("savings")
    assert saved["restores"] == 1 and saved["node_hours"] == round(c["work_s"] / 3600, 4)


def _resume_node(cluster: Cluster) -> None:
    cluster.run("scontrol", "update", "NodeName=n1", "State=RESUME")


def test_the_control_plane_checkpoints_drains_and_triggers_on_slurm(
    cluster: Cluster, controlplane_of: ControlPlane
) -> None:
    cp = controlplane_of
    if not cp.json("nodes"):
        pytest.fail("the node did not join (the installer test failed first)")
    job = cluster.sbatch(
        cluster.counter_script(
            "cpdrain", "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=cpdrain", stop=120, interval=0.5
        )
    )
    cluster.wait_number(job, 3)
    wait_for(lambda: [j["job"] for j in cp.json("jobs")] == [job], 30, "the job reported")
    (reported,) = cp.json("jobs")
    assert reported["partition"] == "low" and reported["rss_bytes"] > 0
    done = cp.json("checkpoint", job)
    assert done["state"] == "done" and done["result"]["label"] == "cpdrain", done
    assert cluster.state(job) == "RUNNING"  # leave-running
    r = cp.cli("migrate", job, "--to", "elsewhere")
    assert r.returncode == 2 and "moves where its scheduler puts it" in r.stderr, r.stderr

    drained = cp.json("drain", "slurm-node", "--reason", "kernel update")
    assert drained["empty"] and not drained["failed"], drained
    (requeued,) = drained["requeued"]
    assert requeued["job"] == job
    node = cluster.run("scontrol", "show", "node", "n1").stdout
    assert "DRAIN" in node and "kernel update" in node, node
    at_dump = cluster.numbers(job)[-1]
    try:
        cluster.wait_state(job, ("PENDING",), 60)  # requeued, and the only node takes no job
    except AssertionError:
        raise AssertionError(cluster.run("scontrol", "show", "job", job).stdout + node)
    wait_for(
        lambda: "DRAIN" in (cp.json("nodes")[0]["scheduler_state"] or ""),
        30,
        "the node's Slurm state in the control plane",
    )
    _resume_node(cluster)
    cluster.wait_number(job, at_dump + 3, 90)
    nums = cluster.numbers(job)
    assert nums[: nums.index(at_dump) + 2] == list(range(at_dump + 2)), nums  # went on
    assert f"restored checkpoint {requeued['checkpoint']}" in cluster.output(job)

    # The admin drains the node in Slurm: a drain-triggered policy requeues its jobs.
    wait_for(
        lambda: "DRAIN" not in (cp.json("nodes")[0]["scheduler_state"] or "DRAIN"),
        30,
        "the node's Slurm state back to normal in the control plane",
    )
    cp.json("policies", "add", "maint", "--on", "drain", "--action", "checkpoint", "--stop")
    cluster.run("scontrol", "update", "NodeName=n1", "State=DRAIN", "Reason=maintenance")
    try:
        try:
            cluster.wait_state(job, ("PENDING",), 60)
        except AssertionError:
            raise AssertionError(
                f"{cp.json('nodes')} {cp.json('jobs')} {cp.json('actions')} "
                f"{cp.json('policies', 'list')}"
            ) from None
        wait_for(
            lambda: any(
                e["kind"] == "policy-run" and "node drained" in e["message"]
                for e in cp.json("events")
            ),
            20,
            "the policy's run",
        )
        (ckpt,) = wait_for(
            lambda: [
                c for c in cp.json("checkpoints", "--deleted") if c["reason"] == "policy maint"
            ],
            30,
            "the policy's checkpoint reported",
        )
        assert ckpt["job"] == job and ckpt["leave_running"] is False
        at_second = cluster.numbers(job)[-1]
    finally:
        cp.json("policies", "rm", "maint")
        _resume_node(cluster)
    cluster.wait_state(job, ("COMPLETED",), 150)
    assert cluster.numbers(job) == list(range(120)) and at_second > at_dump
