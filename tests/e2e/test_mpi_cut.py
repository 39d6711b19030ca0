"""A protected MPI job on two of three nodes, checkpointed as one cut and resumed on another pair
(issue 31): real Slurm, real Open MPI and MPICH, real CRIU, every node a host of its own.

The batch script is what a user writes: `mpirun -np 4 ./mpi_stencil` in an allocation of 2 nodes
x 2 tasks, opted in with STASIS_ENABLE and STASIS_CHECKPOINT. stasis points the job's MPI at
its launch agent (the launcher's environment), so that mpirun's daemon (Open MPI) or Hydra's
proxy (MPICH) on the other node is that node's daemon's part, and every rank lives in the job's
network. What stops the job (a preemption, a drain of its other node, the time limit) has the
batch node's daemon freeze every part on every node, dump each, stop them and requeue the job;
Slurm starts it on another pair (one of its nodes drained); taskinit there restores every part
(the other node's by that node's daemon) and the job finishes with every iteration's checksum
equal to an uninterrupted run's, each printed once.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from stasis.engine import privatepts
from tests.conftest import STASIS, TEST_USER
from tests.e2e.conftest import Cluster, close_cluster, early_checks, multinode_cluster
from tests.workloads.mpi_build import MPI, MPICH, MPIS, OPENMPI, build

ITERATIONS = 60
KEEP = 5  # the store's default `keep`: checkpoints (here cuts) kept per job label
LONG_ITERATIONS = 260  # 65 s at SLEEP_MS: past a time limit of 1 minute
SLEEP_MS = 250
CLUSTER_NUMBER = 3  # tests/e2e/test_mpi_jobnet.py has 1, test_mpi_rsh.py 2, attacks 11
ENDED = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL")
# The tests wait for their checks, which run early (below).
pytestmark = pytest.mark.timeout(1200)


def _iterations(text: str) -> list[str]:
    return re.findall(r"^iter \d+ checksum [0-9a-f]{16} max \S+$", text, re.M)


@dataclass
class Site:
    cluster: Cluster
    binaries: dict[str, Path]
    oracle: list[str]
    oracle_long: list[str]


def _oracle(binaries: dict[str, Path], iterations: int) -> list[str]:
    """4 ranks on this one machine, no job network: the lines every run must print."""
    out = subprocess.run(
        [MPICH.mpirun, "-np", "4", str(binaries[MPICH.name]), str(iterations), "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    lines = _iterations(out.stdout)
    assert len(lines) == iterations
    return lines


def _setup(environ: dict[str, str]) -> Site:
    c = multinode_cluster("mpicut", CLUSTER_NUMBER, nodes=3, environ=environ)
    try:
        binaries = {mpi.name: build(mpi, c.work) for mpi in MPIS}
        return Site(c, binaries, _oracle(binaries, ITERATIONS), _oracle(binaries, LONG_ITERATIONS))
    except BaseException:
        close_cluster(c)
        raise


def _nodes(c: Cluster, job: str) -> list[str]:
    node_list = c.job(job)["NodeList"]
    return c.run("scontrol", "show", "hostnames", node_list).stdout.split()


def _set_node(c: Cluster, node: str, state: str, check: bool = True) -> None:
    extra = ["reason=test"] if state == "drain" else []
    c.run("scontrol", "update", f"nodename={node}", f"state={state}", *extra, check=check)


def _submit(c: Cluster, mpi: MPI, binary: Path, label: str, iterations: int, *opts: str) -> str:
    """The reference program as a user writes it: `mpirun -np 4` in 2 nodes x 2 tasks."""
    script = c.script(
        label,
        mpi.exports()
        + f"{mpi.mpirun} {' '.join(mpi.mpirun_args)} -np 4 {binary} {iterations} {SLEEP_MS}\n"
        'echo "mpirun exit $?"\n',
        f"--output={c.work}/{label}-%j.out",
        f"--export=ALL,STASIS_ENABLE=1,STASIS_CHECKPOINT={label}",
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        *opts,
    )
    return c.sbatch(script, user=TEST_USER)


def _wait_iterations(c: Cluster, job: str, n: int) -> None:
    deadline = time.monotonic() + 150
    while len(_iterations(c.output(job))) < n:
        assert c.state(job) in ("PENDING", "CONFIGURING", "RUNNING"), c.output(job)
        assert time.monotonic() < deadline, c.output(job)
        time.sleep(0.5)


def _finished_from_the_cut(c: Cluster, job: str, label: str, oracle: list[str]) -> str:
    """The job completed after its resume, every iteration once with the uninterrupted run's
    checksum, and a genuine success retired every part's checkpoint."""
    state = c.wait_state(job, ENDED, timeout_s=240)
    out = c.output(job)
    assert state == "COMPLETED", out
    assert f"stasis: restored every part of the job from {label}.cut-" in out, out
    # Every iteration once, with the uninterrupted run's checksums: the ranks went on
    # talking to each other from where they were.
    assert _iterations(out) == oracle, out
    assert "\nmpirun exit 0\n" in out, out
    assert re.search(
        rf"stasis: job completed; retired \d+ checkpoint\(s\) of label {label}\n$", out
    )
    assert not [m for m in c.checkpoints(user=TEST_USER) if m["label"].startswith(label)]
    return out


def _one_cut(c: Cluster, label: str) -> None:
    """One cut listed: a checkpoint of every part (the batch tree, mpirun's daemon on the
    other node) under one label of the job's."""
    cuts = [m for m in c.checkpoints(user=TEST_USER) if m["label"].startswith(f"{label}.cut-")]
    assert len({m["label"] for m in cuts}) == 1 and len(cuts) >= 2, cuts


@contextmanager
def _on_n1_n2(c: Cluster) -> Iterator[Cluster]:
    """n3 drained while the job starts (on n1 and n2); every node back at the end."""
    _set_node(c, "n3", "drain")
    try:
        yield c
    finally:
        for node in ("n1", "n2", "n3"):
            _set_node(c, node, "resume", check=False)  # drained, or resumed already


def _a_preempted_mpi_job_resumes_on_another_pair_of_nodes(site: Site) -> None:
    """Open MPI, preempted by a job of a higher partition on its batch node while its other
    node is drained: requeued, it starts on n1 and n3 once the preemptor is done."""
    with _on_n1_n2(site.cluster) as c:
        _preempted(c, site.binaries, site.oracle)


def _ranks_on_terminals_of_their_own(binary: Path, ranks: int) -> None:
    """Open MPI gives each rank a pty for its output: one of the devpts its batch tree or part
    has of its own (engine/privatepts.py), numbered for it alone, not the node's /dev/pts
    (which the local cluster's nodes, and the other worker's tests, share)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "exe") == str(binary):
                found.append((os.readlink(entry / "fd" / "1"), (entry / "mountinfo").read_text()))
        except OSError:
            continue  # gone meanwhile
    assert len(found) == ranks, found
    for output, mounts in found:
        assert output.startswith("/dev/pts/"), output
        assert re.search(rf" /dev/pts .* - devpts {privatepts.SOURCE} ", mounts), mounts


def _preempted(c: Cluster, binaries: dict[str, Path], oracle: list[str]) -> None:
    job = _submit(c, OPENMPI, binaries[OPENMPI.name], "ompi", ITERATIONS, "--time=5")
    _wait_iterations(c, job, 8)
    assert _nodes(c, job) == ["n1", "n2"]
    _ranks_on_terminals_of_their_own(binaries[OPENMPI.name], 4)
    # Leave-running cuts beyond the store's `keep` (5): the job's oldest cuts are deleted (each
    # cut has a label of its own: the store's retention per label would keep them all).
    for _ in range(KEEP + 1):
        c.on("n1", STASIS, "dump", "--slurm-job", job, "--leave-running")
    kept = {m["label"] for m in c.checkpoints(user=TEST_USER) if m["label"].startswith("ompi.")}
    assert len(kept) == KEEP, kept
    _set_node(c, "n3", "resume")
    _set_node(c, "n2", "drain")
    preemptor = c.script("preemptor", "sleep 3", "--partition=high", "-w", "n1", "-c", "8")
    c.sbatch(preemptor)
    c.wait_state(job, ("PENDING", "REQUEUED") + ENDED, timeout_s=60)
    at = len(_iterations(c.output(job)))
    kept = {m["label"] for m in c.checkpoints(user=TEST_USER) if m["label"].startswith("ompi.")}
    assert len(kept) == KEEP, kept  # the stop's cut, the 4 newest before it
    out = _finished_from_the_cut(c, job, "ompi", oracle)
    # The newest, the stop's, restored.
    assert f"stasis: restored every part of the job from {max(kept)} " in out, out
    assert sorted(_nodes(c, job)) == ["n1", "n3"], out
    assert 8 <= at < ITERATIONS, (at, out)  # the cut was taken while it ran
    assert "SIGURG: taking a checkpoint" in out, out


def _a_drain_of_its_other_node_moves_an_mpich_job(site: Site) -> None:
    """MPICH (Hydra), its other node drained with `stasis slurm drain`: that node's daemon has
    the batch node's daemon cut the whole job, which resumes on n1 and n3."""
    with _on_n1_n2(site.cluster) as c:
        _drained(c, site.binaries, site.oracle)


def _drained(c: Cluster, binaries: dict[str, Path], oracle: list[str]) -> None:
    job = _submit(c, MPICH, binaries[MPICH.name], "mpich", ITERATIONS, "--time=5")
    _wait_iterations(c, job, 8)
    assert _nodes(c, job) == ["n1", "n2"]
    _set_node(c, "n3", "resume")
    drained = c.on("n2", STASIS, "slurm", "drain", "n2", "--reason", "kernel update", check=False)
    assert drained.returncode == 0, drained.stderr + drained.stdout + c.output(job)
    at = len(_iterations(c.output(job)))
    out = _finished_from_the_cut(c, job, "mpich", oracle)
    assert sorted(_nodes(c, job)) == ["n1", "n3"], out
    assert 8 <= at < ITERATIONS, (at, out)


def _an_mpi_job_past_its_time_limit_finishes(site: Site) -> None:
    """Open MPI with --time=1 and about 65 s of work (more than one run: the warning comes 10
    to 40 s before the limit): checkpointed ahead of the limit, requeued, restored, finished
    with every iteration once."""
    c, oracle_long = site.cluster, site.oracle_long
    job = _submit(
        c, OPENMPI, site.binaries[OPENMPI.name], "ompi-limit", LONG_ITERATIONS, "--time=1"
    )
    state = c.wait_state(job, ENDED, timeout_s=540)
    out = c.output(job)
    assert state == "COMPLETED", out
    assert int(c.job(job)["Restarts"]) >= 1, out
    assert out.count("stasis: restored every part of the job from ompi-limit.cut-") >= 1, out
    assert _iterations(out) == oracle_long, out


CHECKS: list[Callable[[Site], None]] = [
    _a_preempted_mpi_job_resumes_on_another_pair_of_nodes,
    _a_drain_of_its_other_node_moves_an_mpich_job,
    _an_mpi_job_past_its_time_limit_finishes,
]
# Minutes of waiting on Slurm (requeues, a time limit) on a cluster of its own: the checks run
# early (conftest.early_checks); each test raises its check's own error, if any.
_outcome = early_checks(
    "test_mpi_cut.py", _setup, lambda s: close_cluster(s.cluster), CHECKS, timeout_s=1100
)


def test_a_preempted_mpi_job_resumes_on_another_pair_of_nodes() -> None:
    _outcome(_a_preempted_mpi_job_resumes_on_another_pair_of_nodes)


def test_a_drain_of_its_other_node_moves_an_mpich_job() -> None:
    _outcome(_a_drain_of_its_other_node_moves_an_mpich_job)


def test_an_mpi_job_past_its_time_limit_finishes() -> None:
    _outcome(_an_mpi_job_past_its_time_limit_finishes)
