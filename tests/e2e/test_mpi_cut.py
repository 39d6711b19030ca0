"""A protected MPI job on two of three nodes, checkpointed as one cut and resumed on another pair
(issue 31): real Slurm, real Open MPI, real CRIU, every node a host of its own.

The batch script is what a user writes: `mpirun -np 4 ./mpi_stencil` in an allocation of 2 nodes
x 2 tasks, opted in with STASIS_ENABLE and STASIS_CHECKPOINT. stasis points Open MPI at its
launch agent (the launcher's environment), so that mpirun's daemon on the other node is that
node's daemon's part, and every rank lives in the job's network. `stasis dump --slurm-job`
(what preemption, the time limit and a drain ask of the batch node's daemon) freezes every
part on every node, dumps each, stops them and requeues the job; one of its nodes drained
meanwhile, Slurm starts it on another pair; taskinit there restores every part (the other
node's by that node's daemon) and the job finishes with every iteration's checksum equal to an
uninterrupted run's, each printed once, and no iteration printed twice."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import STASIS, TEST_USER
from tests.e2e.conftest import Cluster, close_cluster, multinode_cluster
from tests.workloads.mpi_build import MPICH, OPENMPI, build

ITERATIONS = 60
SLEEP_MS = 250
CLUSTER_NUMBER = 3  # tests/e2e/test_mpi_jobnet.py has 1, test_mpi_rsh.py 2, attacks 11
ENDED = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL")


def _iterations(text: str) -> list[str]:
    return re.findall(r"^iter \d+ checksum [0-9a-f]{16} max \S+$", text, re.M)


@pytest.fixture(scope="module")
def three() -> Iterator[Cluster]:
    c = multinode_cluster("mpicut", CLUSTER_NUMBER, nodes=3)
    try:
        yield c
    finally:
        close_cluster(c)


@pytest.fixture(scope="module")
def binary(three: Cluster) -> Path:
    return build(OPENMPI, three.work)


@pytest.fixture(scope="module")
def oracle(three: Cluster) -> list[str]:
    """4 ranks on this one machine, no job network: the lines every run must print."""
    mpich = build(MPICH, three.work)
    out = subprocess.run(
        [MPICH.mpirun, "-np", "4", str(mpich), str(ITERATIONS), "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    lines = _iterations(out.stdout)
    assert len(lines) == ITERATIONS
    return lines


def _nodes(c: Cluster, job: str) -> list[str]:
    node_list = c.job(job)["NodeList"]
    return c.run("scontrol", "show", "hostnames", node_list).stdout.split()


def _set_node(c: Cluster, node: str, state: str, check: bool = True) -> None:
    extra = ["reason=test"] if state == "drain" else []
    c.run("scontrol", "update", f"nodename={node}", f"state={state}", *extra, check=check)


def test_a_preempted_mpi_job_resumes_on_another_pair_of_nodes(
    three: Cluster, binary: Path, oracle: list[str]
) -> None:
    c = three
    _set_node(c, "n3", "drain")  # the job starts on n1 and n2
    try:
        script = c.script(
            "stencil",
            OPENMPI.exports() + f"mpirun -np 4 {binary} {ITERATIONS} {SLEEP_MS}\n"
            'echo "mpirun exit $?"\n',
            f"--output={c.work}/stencil-%j.out",
            "--export=ALL,STASIS_ENABLE=1,STASIS_CHECKPOINT=stencil",
            "--nodes=2",
            "--ntasks=4",
            "--ntasks-per-node=2",
            "--time=5",
        )
        job = c.sbatch(script, user=TEST_USER)
        deadline = time.monotonic() + 150
        while len(_iterations(c.output(job))) < 8:
            assert c.state(job) in ("PENDING", "CONFIGURING", "RUNNING"), c.output(job)
            assert time.monotonic() < deadline, c.output(job)
            time.sleep(0.5)
        first = _nodes(c, job)
        assert first == ["n1", "n2"], first
        # Slurm must choose another pair when it starts the job again: n2 drained, n3 back.
        _set_node(c, "n3", "resume")
        _set_node(c, "n2", "drain")
        dumped = c.on("n1", STASIS, "dump", "--slurm-job", job, check=False)
        at = len(_iterations(c.output(job)))
        assert dumped.returncode == 0, dumped.stderr + dumped.stdout + c.output(job)
        assert "requeued" in dumped.stdout, dumped.stdout
        # One cut: a checkpoint of every part (the batch tree, mpirun's daemon on n2) under
        # one label of the job's.
        cuts = [
            m for m in c.checkpoints(user=TEST_USER) if m["label"].startswith("stencil.cut-")
        ]
        assert len({m["label"] for m in cuts}) == 1 and len(cuts) == 2, cuts
        state = c.wait_state(job, ENDED, timeout_s=240)
        out = c.output(job)
        assert state == "COMPLETED", out
        assert sorted(_nodes(c, job)) == ["n1", "n3"], out
        assert 8 <= at < ITERATIONS, (at, out)  # the cut was taken while it ran
        assert "stasis: restored every part of the job from stencil.cut-" in out, out
        # Every iteration once, with the uninterrupted run's checksums: the ranks went on
        # talking to each other from where they were.
        assert _iterations(out) == oracle, out
        assert "\nmpirun exit 0\n" in out, out
        # A genuine success retires the label's checkpoints: every part's, of every cut.
        assert out.endswith("stasis: job completed; retired 2 checkpoint(s) of label stencil\n")
        assert not [m for m in c.checkpoints(user=TEST_USER) if m["label"].startswith("stencil")]
    finally:
        for node in ("n2", "n3"):
            _set_node(c, node, "resume", check=False)  # drained, or resumed already
