"""The control plane's web installer on a real Slurm cluster: the node (stasis uninstalled from
it first) runs `curl $URL/install/slurm -H "Authorization: Bearer $TOKEN" | bash -s --
--node-role ...`, which installs stasis from the control plane's wheel into a fresh virtual
environment, writes the control plane's settings into the node daemon's config and installs the
plugin set; the restarted daemon joins the control plane. A protected job, preempted, is
checkpointed and restored, and both show in the control plane (events, checkpoints, savings,
the job while it runs)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from stasis.slurm import cluster as local_cluster
from tests.conftest import wait_for
from tests.controlplane.conftest import ControlPlane
from tests.e2e.conftest import Cluster


def test_the_web_installer_joins_a_slurm_node_and_shows_its_preemption(
        cluster: Cluster) -> None:
    root = Path(tempfile.mkdtemp(prefix="cp-", dir=cluster.root))
    cp = ControlPlane(root, str(root / "controlplane.db"))
    cp.start()
    try:
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
            ["bash", "-c", 'curl -fsSL "$URL/install/slurm" -H "Authorization: Bearer $TOKEN" '
                           '| bash -s -- --node-role controller --node-role worker '
                           '--node-role login --slurm-conf "$SLURM_CONF" --lib-dir "$LIB" '
                           '--no-systemd'],
            capture_output=True, text=True, timeout=600,
            env={**cluster.env, "URL": cp.url, "TOKEN": hpc["token"], "LIB": str(lay.lib),
                 "STASIS_PREFIX": str(prefix), "STASIS_CONFIG": str(lay.stasis_config),
                 "STASIS_NODE_NAME": "slurm-node"})
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
        local_cluster.stop_daemon(cluster.root)
        local_cluster.start_daemon(cluster.root)
        wait_for(lambda: [n["name"] for n in cp.json("nodes")] == ["slurm-node"], 30,
                 "the node in the control plane")
        (node,) = cp.json("nodes")
        assert node["slurm_version"] and node["cluster"] == "hpc"

        victim = cluster.counter_script(
            "cpvictim", "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=cpvictim", stop=40,
            interval=0.5)
        preemptor = cluster.script("cppreemptor", "sleep 1", "--partition=high",
                                   "--cpus-per-task=8",
                                   f"--output={cluster.work}/cppreemptor-%j.out")
        v = cluster.sbatch(victim)
        cluster.wait_number(v, 4)
        wait_for(lambda: [(j["job"], j["kind"], j["label"]) for j in cp.json("jobs")] ==
                 [(v, "slurm", "cpvictim")], 30, "the Slurm job in the control plane")
        cluster.sbatch(preemptor)
        cluster.wait_state(v, ("COMPLETED", "FAILED", "CANCELLED"), 150)
        out = cluster.output(v)
        assert "SIGUSR1: taking a checkpoint" in out and "stasis: restored checkpoint" in out
        assert re.findall(r"^(\d+)$", out, re.M) == [str(i) for i in range(40)], out

        def reported() -> list[dict[str, Any]] | None:
            events = cp.json("events")
            kinds = [e["kind"] for e in events]
            return events if "checkpoint" in kinds and "restore" in kinds else None

        events = wait_for(reported, 30, "the checkpoint and the restore in the control plane: "
                          f"{cp.json('events')}; daemon log: "
                          f"{(lay.stasis / 'daemon.log').read_text()[-3000:]}")
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
    finally:
        cp.stop()
