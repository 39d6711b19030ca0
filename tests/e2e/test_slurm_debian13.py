"""The Slurm path on Slurm 24.11, in a Debian 13 root (tests/e2e/debian_root.sh: built with
debootstrap, entered with a mount namespace of its own and pivot_root), where stasis is installed
from this checkout and `stasis-dev local-cluster up` starts that release's munge, slurmctld,
slurmd and a stasis daemon. The rest of tests/e2e runs on this machine's Slurm (22.05).

Two opted-in jobs are preempted at once by a job of the high partition: one runs its counter
directly, one in `srun` steps after a step that ends at once (its counter step listed by squeue
as a step of the job). Both are checkpointed, requeued
and restored: each counter goes on where it was, the finished step does not run again, and each
job runs once more only (Restarts=1; on 24.11 the demo once ran its job a second time from 0).
The root is built in the background as soon as the session starts (tests/e2e/conftest.py).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.slurm.scontrol import parse_record
from tests.e2e import debian13
from tests.e2e.conftest import COUNTER, until

pytestmark = pytest.mark.timeout(900)

CLUSTER = "/srv/cluster"
WORK = "/srv/work"
MARKER = "stasis: restored checkpoint"


class RootCluster:
    """The local cluster inside the Debian 13 root; paths are the root's own."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = f"SLURM_CONF={CLUSTER}/etc/slurm.conf STASIS_CONFIG={CLUSTER}/stasis/config.toml"

    def host(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def sh(
        self, cmd: str, check: bool = True, timeout_s: float = 180
    ) -> subprocess.CompletedProcess[str]:
        result = debian13.enter(self.root, f"cd {WORK} && env {self.env} {cmd}", timeout_s)
        if check and result.returncode != 0:
            raise AssertionError(
                f"{cmd} failed in the Debian 13 root ({result.returncode}): "
                f"{result.stderr}{result.stdout}"
            )
        return result

    def job(self, job_id: str) -> dict[str, str]:
        return parse_record(self.sh(f"scontrol show job -o {job_id}").stdout)

    def output(self, name: str) -> str:
        try:
            return self.host(f"{WORK}/{name}.out").read_text()
        except FileNotFoundError:
            return ""

    def numbers(self, name: str) -> list[int]:
        return [int(n) for n in re.findall(r"^(\d+)$", self.output(name), re.M)]

    def sbatch(self, name: str, body: str, *opts: str) -> str:
        lines = [
            "#!/bin/bash",
            *(f"#SBATCH {o}" for o in opts),
            f"#SBATCH --output={WORK}/{name}.out",
            body,
            "",
        ]
        self.host(f"{WORK}/{name}.sh").write_text("\n".join(lines))
        return self.sh(f"sbatch --parsable {WORK}/{name}.sh").stdout.strip().split(";")[0]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RootCluster]:
    root = debian13.root()
    c = RootCluster(root)
    for d in (WORK, CLUSTER):
        subprocess.run(["rm", "-rf", str(c.host(d))], check=True)
        c.host(d).mkdir(parents=True)
    c.host(f"{WORK}/counter.py").write_text(COUNTER)
    up = debian13.enter(
        root,
        f"stasis-dev local-cluster up --dir {CLUSTER} --json " "--socket-group root --cpus 8",
        240,
    )
    assert up.returncode == 0, up.stderr + up.stdout
    try:
        yield c
    finally:
        debian13.enter(root, f"stasis-dev local-cluster down --dir {CLUSTER}", 120)


def test_preempted_jobs_resume_once_on_slurm_24_11(cluster: RootCluster) -> None:
    version = cluster.sh("sinfo --version").stdout.split()
    assert version[1].startswith("24.11."), version
    opt_in = "--export=ALL,STASIS_ENABLE=1,STASIS_CHECKPOINT={}"
    counter = f"python3 -u {WORK}/counter.py 24 0.5 0"
    plain = cluster.sbatch(
        "plain", f"exec {counter}", opt_in.format("plain"), "-p", "low", "-c", "4"
    )
    steps = cluster.sbatch(
        "steps",
        "\n".join(
            [
                "srun bash -c 'echo first step'",
                f"srun {counter}",
                "echo script went on",
            ]
        ),
        opt_in.format("steps"),
        "-p",
        "low",
        "-c",
        "4",
    )
    until(
        lambda: len(cluster.numbers("plain")) >= 5 and len(cluster.numbers("steps")) >= 5,
        120,
        "both counters at 5",
    )
    # The counter step runs inside the tree, on stasis's srun, and is a Slurm step all the same
    # (the node daemon's record of it: what sacct lists).
    until(
        lambda: re.search(
            rf"^{steps}\.\d+ python3$",
            cluster.sh(f"squeue -h -s -j {steps} -o '%i %j'").stdout,
            re.M,
        ),
        30,
        "the counter step in squeue",
    )
    high = cluster.sbatch("high", "sleep 3", "-p", "high", "-c", "8")
    until(
        lambda: MARKER in cluster.output("plain") and MARKER in cluster.output("steps"),
        180,
        "both jobs restored",
    )

    def ended() -> bool:
        return all(
            cluster.job(j)["JobState"] in ("COMPLETED", "FAILED", "CANCELLED")
            for j in (plain, steps)
        )

    until(ended, 120, "both jobs to end")
    assert cluster.job(high)["JobState"] == "COMPLETED"
    for name, job in (("plain", plain), ("steps", steps)):
        out, info = cluster.output(name), cluster.job(job)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
        assert info["Restarts"] == "1", out
        assert out.count(MARKER) == 1, out
        at_dump = [int(n) for n in re.findall(r"^(\d+)$", out[: out.index(MARKER)], re.M)][-1]
        resumed = [int(n) for n in re.findall(r"^(\d+)$", out[out.index(MARKER) :], re.M)]
        assert at_dump >= 5 and resumed[0] == at_dump + 1, out  # went on, did not start over
        # Every value once, in order: no second run from 0.
        assert cluster.numbers(name) == list(range(24)), out
        assert out.count("done\n") == 1, out
    steps_out = cluster.output("steps")
    assert steps_out.count("first step\n") == 1, steps_out  # the finished step did not rerun
    assert steps_out.count("script went on\n") == 1, steps_out


def test_the_root_is_debian_13(cluster: RootCluster) -> None:
    """What the test above ran on: Debian 13's own Slurm, this machine's CRIU, and the stasis
    of this checkout."""
    assert cluster.host("/etc/debian_version").read_text().startswith("13")
    check = cluster.sh("stasis check", check=False)
    assert "criu" in (check.stdout + check.stderr).lower(), check.stdout + check.stderr
    assert shlex.split(cluster.sh("dpkg-query -W -f '${Version}' slurmd").stdout)[0].startswith(
        "24.11"
    )
