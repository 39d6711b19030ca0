"""A real single-node Slurm cluster (munge, slurmctld, slurmd, stasis daemon) for each module.

`stasis slurm local-cluster up` starts it in a private directory with private ports; the tests
talk to it with the ordinary sbatch/squeue/scontrol/scancel and SLURM_CONF. Jobs write into a
world-writable work directory so that jobs of the non-root test user can too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from stasis.slurm.scontrol import parse_record
from stasis.slurm import cluster as local_cluster
from stasis.poll import poll
from tests.conftest import STASIS, TEST_USER, ensure_test_user
from tests.e2e import debian13


def pytest_collection_finish(session: pytest.Session) -> None:
    # The Debian 13 root takes minutes to build: it builds while the other tests run.
    if any(item.path.name == "test_slurm_debian13.py" for item in session.items):
        debian13.start_build()

# A counter printing once per `interval` seconds up to `stop`, then exiting with `code`.
COUNTER = """\
import sys, time
stop, interval, code = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
for i in range(stop):
    print(i, flush=True)
    time.sleep(interval)
print("done", flush=True)
sys.exit(code)
"""


class Cluster:
    def __init__(self, root: Path, nodes: int = 1, without_stasis: tuple[str, ...] = ()
                 ) -> None:
        self.root = root
        self.work = root / "work"
        self.lay = local_cluster.Layout(root)
        self.nodes = nodes
        self.without_stasis = without_stasis

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, **self.lay.env()}

    def up(self) -> None:
        result = subprocess.run(
            [STASIS, "slurm", "local-cluster", "up", "--dir", str(self.root), "--json",
             "--socket-group", TEST_USER, "--nodes", str(self.nodes),
             *(f"--without-stasis={n}" for n in self.without_stasis)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "STASIS_CONFIG": ""})
        assert result.returncode == 0, result.stderr + result.stdout
        answer = json.loads(result.stdout)
        assert answer["slurm_conf"] == str(self.lay.slurm_conf)
        assert answer["nodes"] == [f"n{i + 1}" for i in range(self.nodes)]
        self.work.mkdir(exist_ok=True)
        os.chmod(self.work, 0o777)
        (self.work / "counter.py").write_text(COUNTER)

    def down(self) -> None:
        subprocess.run([STASIS, "slurm", "local-cluster", "down", "--dir", str(self.root)],
                       capture_output=True, text=True, timeout=120)

    def run(self, *cmd: str, user: str | None = None, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        argv = list(cmd)
        if user:
            argv = ["runuser", "-u", user, "--", "env", *(f"{k}={v}" for k, v in
                                                         self.lay.env().items()), *argv]
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=120,
                                cwd=self.work)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}): "
                                 f"{result.stderr}{result.stdout}")
        return result

    def script(self, name: str, body: str, *sbatch: str) -> Path:
        """A batch script in the work directory: #SBATCH lines, then `body`."""
        path = self.work / f"{name}.sh"
        lines = ["#!/bin/bash", *(f"#SBATCH {opt}" for opt in sbatch), body, ""]
        path.write_text("\n".join(lines))
        os.chmod(path, 0o755)
        return path

    def counter_script(self, name: str, *sbatch: str, stop: int = 30, interval: float = 1.0,
                       code: int = 0) -> Path:
        return self.script(
            name, f"exec python3 -u {self.work}/counter.py {stop} {interval} {code}",
            f"--output={self.work}/{name}-%j.out", *sbatch)

    def sbatch(self, script: Path, *args: str, user: str | None = None) -> str:
        out = self.run("sbatch", "--parsable", *args, str(script), user=user).stdout
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        return parse_record(self.run("scontrol", "show", "job", "-o", job_id).stdout)

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout_s: float = 90) -> str:
        return str(until(lambda: (s := self.state(job_id)) in states and s,
                         timeout_s, f"job {job_id} in {states}"))

    def output(self, job_id: str) -> str:
        path = self.job(job_id)["StdOut"]
        try:
            return Path(path).read_text()
        except FileNotFoundError:
            return ""

    def numbers(self, job_id: str) -> list[int]:
        return [int(n) for n in re.findall(r"^(\d+)$", self.output(job_id), re.M)]

    def wait_number(self, job_id: str, at_least: int, timeout_s: float = 90) -> int:
        def reached() -> int | None:
            nums = self.numbers(job_id)
            return nums[-1] if nums and nums[-1] >= at_least else None
        return int(until(reached, timeout_s, f"job {job_id}'s counter at {at_least}"))

    def stasis(self, *args: str, user: str | None = None, check: bool = True
               ) -> subprocess.CompletedProcess[str]:
        return self.run(STASIS, *args, user=user, check=check)

    def on(self, node: str, *cmd: str, user: str | None = None, check: bool = True
           ) -> subprocess.CompletedProcess[str]:
        """`cmd` run on `node` (its namespaces, its stasis config), as `user` if given."""
        inner = ["runuser", "-u", user, "--", *cmd] if user else list(cmd)
        return self.run(STASIS, "slurm", "local-cluster", "exec", "--dir", str(self.root), node,
                        "--", *inner, check=check)

    def checkpoints(self, label: str | None = None, user: str | None = None
                    ) -> list[dict[str, Any]]:
        """Root's view; a label is looked up among root's own checkpoints unless `user`."""
        args = ["checkpoints", "--json", *(["--label", label] if label else []),
                *(["--user", user] if user else [])]
        found: list[dict[str, Any]] = json.loads(self.stasis(*args).stdout)
        return found

    def sacct(self, job_id: str) -> list[tuple[str, str]]:
        """(State, ExitCode) of the job's records in the job completion log (`sacct -c`)."""
        out = self.run("sacct", "-c", "-n", "-P", "-j", job_id, "-o", "state,exitcode").stdout
        return [tuple(line.split("|")[:2]) for line in out.splitlines() if "|" in line]  # type: ignore[misc]

    def pids(self, job_id: str) -> list[int]:
        result = self.run("scontrol", "listpids", job_id, check=False)
        return [int(line.split()[0]) for line in result.stdout.splitlines()[1:]
                if line.split() and line.split()[0].isdigit()]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def new_cluster(name: str, nodes: int = 1, without_stasis: tuple[str, ...] = ()) -> Cluster:
    ensure_test_user()
    root = Path(tempfile.mkdtemp(prefix=f"stasis-e2e-{name}-"))
    os.chmod(root, 0o755)
    c = Cluster(root, nodes, without_stasis)
    c.up()
    return c


def close_cluster(c: Cluster) -> None:
    c.down()
    if not os.environ.get("STASIS_KEEP_E2E"):
        shutil.rmtree(c.root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = new_cluster("cluster")
    yield c
    close_cluster(c)


# The time-limit job needs minutes of wall time: it runs on a cluster of its own, submitted as
# soon as the first module that wants it starts, and checked by test_time_limit.py at the end.
TIME_LIMIT_WORK_S = 170


class LongJob:
    def __init__(self, cluster: Cluster, job_id: str, started: float) -> None:
        self.cluster = cluster
        self.job_id = job_id
        self.started = started


@pytest.fixture(scope="session")
def time_limit_job() -> Iterator[LongJob]:
    c = new_cluster("timelimit")
    script = c.counter_script("long", "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=long",
                              "--time=1", stop=TIME_LIMIT_WORK_S, interval=1.0)
    job = LongJob(c, c.sbatch(script), time.monotonic())
    yield job
    close_cluster(c)


def wait_gone(pids: list[int], timeout_s: float = 30) -> None:
    until(lambda: not any(alive(p) for p in pids), timeout_s, f"processes {pids} to end")


T = TypeVar("T")


def until(pred: Callable[[], T | None], timeout_s: float, what: str) -> T:
    value = poll(pred, timeout_s, interval_s=0.5)
    if not value:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
    return value
