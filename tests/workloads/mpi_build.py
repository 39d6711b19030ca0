"""The MPIs of the multi-node job tests (issue 31) and the reference program built for each.

Debian's alternatives system picks one `mpicc`/`mpirun`; the tests name each MPI's own
(mpicc.openmpi, mpirun.mpich...). How each is launched across the nodes of the local cluster,
and with which settings, is what was seen to work there (/work/shared/notes/mpi.md, 2026-12-06):

- Open MPI (Debian 12: 4.1.4, PMIx only): `srun --mpi=pmix` or `mpirun` inside the allocation
  (`srun --mpi=pmi2` fails: "OPAL ERROR: Unreachable"); TCP pinned to the nodes' eth0 with the
  openib/UCX paths left out.
- MPICH (Debian 12: 4.0.2, device ch4:ucx, no PMIx): `srun --mpi=pmi2` (with --mpi=pmix every
  rank is a singleton of its own) or `mpirun -iface eth0` (Hydra; without -iface its proxies
  look up the launching node's name, which these nodes cannot resolve); UCX over TCP.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("mpi_stencil.c")


@dataclass(frozen=True)
class MPI:
    name: str  # "openmpi" or "mpich": the suffix Debian gives its commands
    srun_mpi: str  # the `srun --mpi=` plugin that works with it
    mpirun_args: tuple[str, ...]  # what `mpirun` needs inside an allocation of these nodes
    env: tuple[tuple[str, str], ...]  # TCP between nodes on eth0, shared memory within one

    @property
    def mpicc(self) -> str:
        return f"mpicc.{self.name}"

    @property
    def mpirun(self) -> str:
        return f"mpirun.{self.name}"

    def exports(self) -> str:
        """The settings as shell `export` lines, for a batch script."""
        return "".join(f"export {k}={v}\n" for k, v in self.env)


OPENMPI = MPI(
    "openmpi",
    "pmix",
    (),
    (
        ("OMPI_MCA_pml", "ob1"),
        ("OMPI_MCA_btl", "self,vader,tcp"),
        ("OMPI_MCA_btl_tcp_if_include", "eth0"),
        ("OMPI_MCA_oob_tcp_if_include", "eth0"),
    ),
)
MPICH = MPI(
    "mpich",
    "pmi2",
    ("-iface", "eth0"),
    (("UCX_TLS", "tcp,self,sm"), ("UCX_NET_DEVICES", "eth0")),
)
MPIS = (OPENMPI, MPICH)


def build(mpi: MPI, dest: Path) -> Path:
    """The reference program built with `mpi`'s compiler into `dest` (readable by all: the
    jobs run as the test user); a missing MPI fails with what to install."""
    if shutil.which(mpi.mpicc) is None:
        raise AssertionError(
            f"{mpi.mpicc} is missing: run scripts/install-test-apps.sh (Debian's {mpi.name})"
        )
    binary = dest / f"mpi_stencil.{mpi.name}"
    subprocess.run(
        [mpi.mpicc, "-O2", "-Wall", "-Werror", "-o", str(binary), str(SOURCE)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    os.chmod(binary, 0o755)
    return binary
