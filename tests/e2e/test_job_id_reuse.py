"""Job ids restart at 1 when slurmctld starts clean: a new job that merely reuses an id never
picks up the checkpoints of the old job with that id (default label = job id)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import Cluster, close_cluster, early_checks, new_cluster

ENABLE = "--export=STASIS_ENABLE=1"
# The test waits for its check, which runs early (below).
pytestmark = pytest.mark.timeout(600)


def _reused_job_id_starts_fresh(cluster: Cluster) -> None:
    script = cluster.counter_script("reuse", ENABLE, stop=400, interval=0.5)
    old = cluster.sbatch(script)
    cluster.wait_number(old, 3)
    cp = json.loads(cluster.stasis("dump", "--slurm-job", old, "--leave-running", "--json").stdout)
    assert cp["label"] == old
    cluster.run("scancel", old)
    cluster.wait_state(old, ("CANCELLED",))
    cluster.down()
    cluster.up()  # slurmctld -c: job ids start again at 1; the store is the same

    new = cluster.sbatch(script)
    assert new == old
    cluster.wait_number(new, 3)
    out = cluster.output(new)
    assert "restored" not in out
    assert cluster.numbers(new)[:3] == [0, 1, 2]
    assert [c["id"] for c in cluster.checkpoints(old)] == [cp["checkpoint"]]  # untouched
    cluster.run("scancel", new)
    cluster.wait_state(new, ("CANCELLED",))


# A cluster of its own (it restarts Slurm), and a minute of waiting on it: the check runs early
# (conftest.early_checks); the test raises its error, if any.
_outcome = early_checks(
    "test_job_id_reuse.py",
    lambda env: new_cluster("reuse", environ=env),
    close_cluster,
    [_reused_job_id_starts_fresh],
)


def test_reused_job_id_starts_fresh() -> None:
    _outcome(_reused_job_id_starts_fresh)
