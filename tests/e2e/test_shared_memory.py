"""An opted-in Slurm job whose processes share SysV memory (as database servers and many HPC
codes do): it runs in an IPC namespace of its own (the SPANK plugin unshares one with its PID
namespace), so CRIU can take the segment with the job, and the restored job goes on reading the
count its segment held."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tests.conftest import TEST_USER, WORKLOADS
from tests.e2e.conftest import Cluster, until, wait_gone


@pytest.fixture(scope="module")
def cluster(shared_cluster: Cluster) -> Cluster:
    """The session's shared cluster (conftest): this module leaves it as it found it."""
    return shared_cluster


MARKER = "stasis: restored checkpoint"


def _shm_values(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^shm (\d+)$", text, re.M)]


def test_shared_memory_job_resumes_with_its_segment(cluster: Cluster) -> None:
    shutil.copy(WORKLOADS / "sysvshm.py", cluster.work / "sysvshm.py")
    script = cluster.script(
        "shm",
        f"exec python3 -u {cluster.work}/sysvshm.py 0.2",
        f"--output={cluster.work}/shm-%j.out",
        "--export=STASIS_ENABLE=1",
    )
    job = cluster.sbatch(script, user=TEST_USER)
    until(lambda: len(_shm_values(cluster.output(job))) >= 5, 90, "the job counting in shm")
    pids = cluster.pids(job)
    host_ipc = os.readlink("/proc/self/ns/ipc")
    assert any(os.readlink(f"/proc/{p}/ns/ipc") != host_ipc for p in pids)
    answer = json.loads(cluster.stasis("dump", "--slurm-job", job, "--json", user=TEST_USER).stdout)
    assert answer["requeued"] is True
    wait_gone(pids)
    until(lambda: MARKER in cluster.output(job), 90, "the restore")
    at_dump = _shm_values(cluster.output(job).split(MARKER)[0])[-1]
    until(
        lambda: _shm_values(cluster.output(job).split(MARKER)[1])[-1:] >= [at_dump + 5],
        60,
        "the restored job counting on",
    )
    after = _shm_values(cluster.output(job).split(MARKER)[1])
    # Read through the segment: the count went on from the checkpointed value, never from 0.
    assert after[0] >= at_dump and after == sorted(after), cluster.output(job)
    assert cluster.job(job)["Restarts"] == "1"
    restored = cluster.pids(job)
    cluster.run("scancel", job)
    wait_gone(restored)
