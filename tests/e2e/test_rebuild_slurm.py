"""A node daemon whose job database is found corrupt at its start still protects the Slurm jobs
registered before (issue 28): the database is moved aside and rebuilt, and the registrations
come back from the files the node keeps of them (stasis/daemon/records.py). A job registered,
the daemon stopped, its database overwritten with garbage, the daemon started again: at the
job's preemption it is checkpointed through the real /slurm path, requeued, and resumes from
that checkpoint, its counter going on. (Before: the rebuilt database knew no registration, the
preemption's checkpoint was refused "not under stasis on this node", and the job's work since
its start was lost.)"""

from __future__ import annotations

import os

from stasis.client import Client
from stasis.dev import slurmcluster
from tests.e2e.conftest import Cluster, until
from tests.e2e.test_slurm_faults import numbers, resumed_in_order


def test_a_registered_slurm_job_is_checkpointed_at_its_preemption_after_a_rebuild(
    cluster: Cluster,
) -> None:
    c = cluster
    label = "rebuilt-slurm"
    script = c.counter_script(
        label, f"--export=STASIS_ENABLE=1,STASIS_CHECKPOINT={label}", stop=40, interval=0.5
    )
    job = c.sbatch(script)
    c.wait_number(job, 3)
    with Client(c.lay.stasis_socket, 20.0) as client:
        assert client.request("GET", f"/slurm/jobs/{job}")["label"] == label
    state = c.lay.stasis / "state"
    slurmcluster.stop_daemon(c.root)
    try:
        (state / "jobs.db").write_bytes(os.urandom(64 << 10))
        for extra in ("jobs.db-wal", "jobs.db-shm"):
            (state / extra).unlink(missing_ok=True)
    finally:
        slurmcluster.start_daemon(c.root)
    assert list(state.glob("jobs.db.corrupt-*")), "the database was not rebuilt"
    reached = c.wait_number(job, 6)
    c.run("scancel", "-b", "-s", "URG", job)  # what Slurm sends at preemption
    until(lambda: c.checkpoints(label), 60, "the preemption's checkpoint")
    until(lambda: "stasis: restored checkpoint" in c.output(job), 120, "the requeued job to resume")
    c.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 120)
    out = c.output(job)
    assert c.job(job)["JobState"] == "COMPLETED", out
    resumed_in_order(out)
    assert sorted(set(numbers(out))) == list(range(40)) and "\ndone\n" in out, out
    # Resumed past what it had counted before the rebuild: nothing of it was lost.
    runs = out.split("stasis: restored checkpoint")
    assert max(numbers(runs[0])) >= reached, out
