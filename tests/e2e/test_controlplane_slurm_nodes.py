"""The control plane on a Slurm cluster of two real nodes (each its own host: network, UTS and
mount namespaces; its own stasis daemon joined to the control plane): `stasis controlplane drain
NODE` drains the node in Slurm, checkpoints and requeues its protected job, and the job resumes
on the other node from that checkpoint, its count unbroken."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.slurm import cluster as local_cluster
from tests.conftest import TEST_USER, wait_for
from tests.controlplane.conftest import ControlPlane
from tests.e2e.conftest import Cluster, close_cluster, new_cluster, until


@pytest.fixture(scope="module")
def site() -> Iterator[tuple[Cluster, ControlPlane]]:
    c = new_cluster("cpnodes", nodes=2)
    cp = ControlPlane(Path(tempfile.mkdtemp(prefix="cp-", dir=c.root)), "")
    cp.db = str(cp.root / "controlplane.db")
    try:
        # The nodes reach this machine at the bridge's address, not at its loopback.
        cp.start("--listen", f"0.0.0.0:{cp.port}", "--allow-plain-http")
        hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
        url = f"http://{c.lay.host_address()}:{cp.port}"
        for node in ("n1", "n2"):
            config = c.lay.config_of(node)
            config.write_text(config.read_text() + f'controlplane_url = "{url}"\n'
                              f'cluster_id = "{hpc["cluster_id"]}"\n'
                              f'auth_token = "{hpc["token"]}"\n'
                              "controlplane_heartbeat_s = 0.5\n"
                              # the bridge is this test's own: plain HTTP, said so
                              "controlplane_allow_plain_http = true\n")
            os.chmod(config, 0o600)  # it holds the cluster's token now
            local_cluster.stop_daemon(c.root, node)
            local_cluster.start_daemon(c.root, node)
        wait_for(lambda: sorted(n["name"] for n in cp.json("nodes")
                                if n["state"] == "ready" and n.get("scheduler_state"))
                 == ["n1", "n2"], 60, "both nodes ready in the control plane")
        yield c, cp
    finally:
        cp.stop()
        close_cluster(c)


def test_a_drain_from_the_control_plane_moves_the_job_to_the_other_node(
        site: tuple[Cluster, ControlPlane]) -> None:
    c, cp = site
    script = c.counter_script("cpmove", "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=cpmove",
                              stop=30, interval=0.5)
    job = c.sbatch(script, user=TEST_USER)
    c.wait_state(job, ("RUNNING",))
    first = c.job(job)["BatchHost"]
    c.wait_number(job, 4)
    wait_for(lambda: any(j["job"] == job and j["node"] == first for j in cp.json("jobs")), 30,
             "the job in the control plane")
    try:
        drained = cp.json("drain", first, "--reason", "kernel update")
        assert drained["empty"] and not drained["failed"], drained
        assert [r["job"] for r in drained["requeued"]] == [job], drained
        until(lambda: "stasis: restored checkpoint" in c.output(job), 90, f"{job} restored")
        assert c.job(job)["BatchHost"] != first
        # The control plane sees it running on the other node.
        wait_for(lambda: any(j["job"] == job and j["node"] != first for j in cp.json("jobs")),
                 30, "the job on the other node in the control plane")
        c.wait_state(job, ("COMPLETED",), 90)
    finally:
        c.run("scontrol", "update", f"NodeName={first}", "State=RESUME", check=False)
    assert c.numbers(job) == list(range(30))
    assert c.job(job)["Restarts"] == "1"
