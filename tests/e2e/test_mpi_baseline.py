"""The reference MPI program across two nodes of the local cluster, WITHOUT stasis (issue 31):
under Open MPI and MPICH from Debian, launched by `srun` and by `mpirun` inside the allocation,
4 ranks on 2 nodes over TCP, every iteration's checksum equals a run of 4 ranks on one machine.
This uninterrupted run is the oracle that the checkpoint tests of multi-node jobs compare with;
if it fails, so will they, for reasons that are not stasis's."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TEST_USER
from tests.e2e.conftest import Cluster, close_cluster, new_cluster
from tests.workloads.mpi_build import MPI, MPICH, MPIS, OPENMPI, build

ITERATIONS = 30
_ITER = re.compile(r"^iter (\d+) checksum [0-9a-f]{16} max \S+$", re.M)


def _iterations(text: str) -> list[str]:
    return [m.group(0) for m in _ITER.finditer(text)]


@pytest.fixture(scope="module")
def two() -> Iterator[Cluster]:
    c = new_cluster("mpi", nodes=2)
    yield c
    close_cluster(c)


@pytest.fixture(scope="module")
def binaries(two: Cluster) -> dict[str, Path]:
    return {mpi.name: build(mpi, two.work) for mpi in MPIS}


@pytest.fixture(scope="module")
def oracle(binaries: dict[str, Path]) -> list[str]:
    """4 ranks on this one machine, shared memory only: the same lines under both MPIs."""
    runs = {
        OPENMPI.name: [
            OPENMPI.mpirun,
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "4",
            str(binaries[OPENMPI.name]),
        ],
        MPICH.name: [MPICH.mpirun, "-np", "4", str(binaries[MPICH.name])],
    }
    lines = {}
    for name, argv in runs.items():
        out = subprocess.run(
            [*argv, str(ITERATIONS), "0"], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, f"{name} on one machine: {out.stderr}{out.stdout}"
        assert out.stdout.startswith("ranks 4 hosts "), out.stdout
        lines[name] = _iterations(out.stdout)
    assert lines[OPENMPI.name] == lines[MPICH.name]
    assert len(lines[MPICH.name]) == ITERATIONS
    return lines[MPICH.name]


def _launch(mpi: MPI, how: str, binary: Path) -> str:
    if how == "srun":
        return f"srun --mpi={mpi.srun_mpi} {binary} {ITERATIONS} 0"
    return " ".join([mpi.mpirun, *mpi.mpirun_args, str(binary), str(ITERATIONS), "0"])


@pytest.mark.parametrize("how", ["srun", "mpirun"])
@pytest.mark.parametrize("mpi", MPIS, ids=[m.name for m in MPIS])
def test_two_nodes_match_one(
    two: Cluster, binaries: dict[str, Path], oracle: list[str], mpi: MPI, how: str
) -> None:
    name = f"{mpi.name}-{how}"
    script = two.script(
        name,
        mpi.exports() + _launch(mpi, how, binaries[mpi.name]),
        f"--output={two.work}/{name}-%j.out",
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--time=3",  # a launch that hangs (Hydra's proxies once did) ends
    )
    job = two.sbatch(script, user=TEST_USER)
    state = two.wait_state(job, ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"), timeout_s=200)
    out = two.output(job)
    assert state == "COMPLETED", out
    # One rank of every pair per node, in rank order: the job truly spans both nodes.
    assert out.startswith("ranks 4 hosts n1,n1,n2,n2\n"), out
    assert _iterations(out) == oracle, out
