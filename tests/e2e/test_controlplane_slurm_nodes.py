"""The control plane on a Slurm cluster of two real nodes (each its own host: network, UTS and
mount namespaces; its own stasis daemon joined to the control plane): `stasis controlplane drain
NODE` drains the node in Slurm, checkpoints and requeues its protected job, and the job resumes
on the other node from that checkpoint, its count unbroken."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import TEST_USER, wait_for
from tests.controlplane.conftest import ControlPlane
from tests.e2e.conftest import Cluster, until
from tests.e2e.cpsite import joined_site


@pytest.fixture(scope="module")
def site() -> Iterator[tuple[Cluster, ControlPlane]]:
    with joined_site("cpnodes", node_ready=True) as site:
        yield site


def test_a_drain_from_the_control_plane_moves_the_job_to_the_other_node(
    site: tuple[Cluster, ControlPlane],
) -> None:
    c, cp = site
    script = c.counter_script(
        "cpmove", "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=cpmove", stop=30, interval=0.5
    )
    job = c.sbatch(script, user=TEST_USER)
    c.wait_state(job, ("RUNNING",))
    first = c.job(job)["BatchHost"]
    c.wait_number(job, 4)
    wait_for(
        lambda: any(j["job"] == job and j["node"] == first for j in cp.json("jobs")),
        30,
        "the job in the control plane",
    )
    try:
        drained = cp.json("drain", first, "--reason", "kernel update")
        assert drained["empty"] and not drained["failed"], drained
        assert [r["job"] for r in drained["requeued"]] == [job], drained
        until(lambda: "stasis: restored checkpoint" in c.output(job), 90, f"{job} restored")
        assert c.job(job)["BatchHost"] != first
        # The control plane sees it running on the other node.
        wait_for(
            lambda: any(j["job"] == job and j["node"] != first for j in cp.json("jobs")),
            30,
            "the job on the other node in the control plane",
        )
        c.wait_state(job, ("COMPLETED",), 90)
    finally:
        c.run("scontrol", "update", f"NodeName={first}", "State=RESUME", check=False)
    assert c.numbers(job) == list(range(30))
    assert c.job(job)["Restarts"] == "1"
