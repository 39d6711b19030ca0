"""A real single-node Slurm cluster (munge, slurmctld, slurmd, stasis daemon) for each module.

`stasis-dev local-cluster up` starts it in a private directory with private ports; the tests
talk to it with the ordinary sbatch/squeue/scontrol/scancel and SLURM_CONF. Jobs write into a
world-writable work directory so that jobs of the non-root test user can too.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest

from stasis.daemon import detached
from stasis.dev import slurmcluster
from stasis.dev.slurmdirs import NODE, SlurmClusterDirs, read_state
from stasis.poll import poll
from stasis.slurm.scontrol import parse_record
from tests import parallel
from tests.conftest import STASIS, STASIS_DEV, TEST_USER, ensure_test_user
from tests.e2e import debian13


def pytest_collection_finish(session: pytest.Session) -> None:
    if not parallel.starts_early_work(session.config):
        return  # another worker runs the early modules (tests/parallel.py)
    # The Debian 13 root takes minutes to build: it builds while the other tests run.
    if any(item.path.name == "test_slurm_debian13.py" for item in session.items):
        debian13.start_build()
    # So does the modules' early work (mostly waiting on Slurm's clocks), of chosen modules only.
    chosen = [
        work
        for name, work in EARLY.items()
        if name in {item.path.name for item in session.items}
        and not session.config.option.collectonly
    ]
    if chosen:
        ensure_test_user()  # here, not in the worker and a test at once (two useradds)
    for work in chosen:
        work.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    Early.ending = True  # what has not started yet never will
    for work in EARLY.values():
        work.abandon()


R = TypeVar("R")


class Early(Generic[R]):
    """A module's work that is mostly waiting (jobs that run into their time limit, get
    preempted, requeued...), on a cluster of its own: started when the session's tests are
    known, so the other modules' tests run meanwhile; the module's fixture takes the result
    (`take`) and cleans up (`close`). `make` cleans up after itself when it fails.

    One worker runs the early work of every module, one after the other in the order the
    modules added it, so that at most one such cluster starts or checkpoints at a time beside
    the test running (grace periods are seconds). The worker is no daemon thread: a session
    that ends (or is interrupted) meanwhile waits for the work under way, which then cleans up
    after itself; work not begun is skipped."""

    _lock = threading.Lock()
    _queue: queue.Queue[Early[Any]] = queue.Queue()
    _worker: threading.Thread | None = None
    ending = False

    def __init__(self, make: Callable[[dict[str, str]], R], close: Callable[[R], None]) -> None:
        self._make = make
        self._close = close
        self._queued = False
        self._done = threading.Event()
        self._value: R | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._environ: dict[str, str] = {}

    def start(self) -> None:
        with Early._lock:
            if self._queued:
                return
            self._queued = True
            # The environment before any test runs: `make` runs everything it starts with it,
            # never with a variable a test running meanwhile has just set.
            self._environ = dict(os.environ)
            Early._queue.put(self)
            if Early._worker is None:
                Early._worker = threading.Thread(target=Early._work, name="stasis-early")
                Early._worker.start()

    @staticmethod
    def _work() -> None:
        while True:
            with Early._lock:
                try:
                    work = Early._queue.get_nowait()
                except queue.Empty:
                    Early._worker = None
                    return
            work._run()

    def _run(self) -> None:
        try:
            if Early.ending:
                raise AssertionError("the session ended before this module's early work began")
            self._value = self._make(self._environ)
        except BaseException as e:  # handed to the module's fixture, which raises it
            self._error = e
        finally:
            self._done.set()
        if Early.ending:
            self.close()  # the session ended meanwhile: no fixture will

    def take(self, timeout_s: float) -> R:
        """The result (waiting for it; queued now if the module was not chosen at
        collection): `make`'s own error when it failed."""
        self.start()
        if not self._done.wait(timeout_s):
            raise AssertionError(f"the module's early work did not end in {timeout_s} s")
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    def close(self) -> None:
        with Early._lock:
            if self._closed or self._value is None:
                return
            self._closed = True
        self._close(self._value)

    def abandon(self) -> None:
        """At the session's end: clean up after work no module took (its tests failed first);
        work under way cleans up after itself when it ends."""
        if self._done.is_set():
            self.close()


# Keyed by the module's file name; each module adds its own at import (collection), conftest's
# own first.
EARLY: dict[str, Early[Any]] = {}

S = TypeVar("S")


def early_checks(
    module: str,
    setup: Callable[[dict[str, str]], S],
    close: Callable[[S], None],
    checks: list[Callable[[S], None]],
    timeout_s: float = 540,
) -> Callable[[Callable[[S], None]], None]:
    """A module whose checks are minutes of waiting on Slurm (requeues, restarts) on a cluster
    of its own: they run early (Early), one after the other as they would in the module, on
    what `setup` made (`close` undoes it). Each test of the module calls the returned function
    with its check, which raises the check's own error, if any (an assertion, pytest's skip)."""

    def run_all(environ: dict[str, str]) -> dict[str, BaseException | None]:
        made = setup(environ)
        try:
            outcomes: dict[str, BaseException | None] = {}
            for check in checks:
                try:
                    check(made)
                    outcomes[check.__name__] = None
                except BaseException as e:  # the test raises it
                    outcomes[check.__name__] = e
            return outcomes
        finally:
            close(made)

    work = Early(run_all, lambda _: None)
    EARLY[module] = work

    def outcome(check: Callable[[S], None]) -> None:
        error = work.take(timeout_s)[check.__name__]
        if error is not None:
            raise error

    return outcome


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
    def __init__(
        self,
        root: Path,
        nodes: int = 1,
        without_stasis: tuple[str, ...] = (),
        environ: dict[str, str] | None = None,
        job_container: bool = False,
    ) -> None:
        self.root = root
        self.job_container = job_container
        self.work = root / "work"
        self.lay = SlurmClusterDirs(root)
        self.nodes = nodes
        self.without_stasis = without_stasis
        # A cluster driven from a thread (Early) while other tests run takes the environment
        # as it was before any test ran, never a variable a test has just set.
        self.environ = environ

    @property
    def base_env(self) -> dict[str, str]:
        return dict(os.environ if self.environ is None else self.environ)

    @property
    def env(self) -> dict[str, str]:
        return {**self.base_env, **self.lay.env()}

    def start(self, *args: str, timeout_s: float = 120) -> str:
        """`local-cluster up --dir ROOT --json ARGS`, its answer. One that fails or does not
        finish in time is taken down at once: what it started (daemons, the nodes' network)
        does not outlive it (`up` stops it itself when it fails, but not when it is killed)."""
        try:
            result = subprocess.run(
                [STASIS_DEV, "local-cluster", "up", "--dir", str(self.root), "--json", *args],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={**self.base_env, "STASIS_CONFIG": ""},
            )
        except subprocess.TimeoutExpired as e:
            self.down()
            raise AssertionError(
                f"local-cluster up did not finish in {timeout_s:.0f} s: " f"{e.stderr!r}"
            ) from None
        if result.returncode != 0:
            self.down()
            raise AssertionError(f"local-cluster up failed: {result.stderr}{result.stdout}")
        return result.stdout

    def up(self) -> None:
        answer = json.loads(
            self.start(
                "--socket-group",
                TEST_USER,
                "--nodes",
                str(self.nodes),
                *(f"--without-stasis={n}" for n in self.without_stasis),
                *(["--job-container"] if self.job_container else []),
            )
        )
        assert answer["slurm_conf"] == str(self.lay.slurm_conf)
        assert answer["nodes"] == [f"n{i + 1}" for i in range(self.nodes)]
        # Slurm as sites run it (proctrack/cgroup, task/cgroup) unless job_container/tmpfs.
        assert (answer["cgroup"] is None) == self.job_container, answer
        self.work.mkdir(exist_ok=True)
        os.chmod(self.work, 0o777)
        (self.work / "counter.py").write_text(COUNTER)

    def down(self) -> None:
        subprocess.run(
            [STASIS_DEV, "local-cluster", "down", "--dir", str(self.root)],
            capture_output=True,
            text=True,
            timeout=120,
            env=self.base_env,
        )

    def run(
        self, *cmd: str, user: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = list(cmd)
        if user:
            argv = [
                "runuser",
                "-u",
                user,
                "--",
                "env",
                *(f"{k}={v}" for k, v in self.lay.env().items()),
                *argv,
            ]
        result = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=120, cwd=self.work
        )
        if check and result.returncode != 0:
            seen = self.daemon_view() if "is its filesystem mounted?" in result.stderr else ""
            raise AssertionError(
                f"{' '.join(cmd)} failed ({result.returncode}): "
                f"{result.stderr}{result.stdout}{seen}"
            )
        return result

    def daemon_view(self) -> str:
        """What n1's daemon sees of the cluster's directories, and from where: for a store
        the daemon finds missing while this process sees it (seen once, unexplained)."""
        lines = [f"; this process sees the store: {self.lay.store.exists()}"]
        try:
            pid = detached.read_pid(self.lay.config_of(NODE).parent / "daemon.pid")
            lines.append(
                f"daemon {pid}: sees it {Path(f'/proc/{pid}/root{self.lay.store}').exists()}"
            )
            theirs, ours = os.readlink(f"/proc/{pid}/ns/mnt"), os.readlink("/proc/self/ns/mnt")
            lines.append(f"its mount ns {theirs}, ours {ours}")
            holders = read_state(self.lay).get("holders", {})
            for node, holder in holders.items():
                cmd = Path(f"/proc/{holder}/cmdline").read_bytes()
                lines.append(
                    f"holder of {node}: {holder} {cmd!r} {os.readlink(f'/proc/{holder}/ns/mnt')}"
                )
            mounts = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
            lines += [m for m in mounts if " /tmp" in m or str(self.root) in m][:20]
        except (OSError, TypeError, ValueError) as e:
            lines.append(f"(cannot tell: {e})")
        return "\n".join(lines)

    def script(self, name: str, body: str, *sbatch: str) -> Path:
        """A batch script in the work directory: #SBATCH lines, then `body`."""
        path = self.work / f"{name}.sh"
        lines = ["#!/bin/bash", *(f"#SBATCH {opt}" for opt in sbatch), body, ""]
        path.write_text("\n".join(lines))
        os.chmod(path, 0o755)
        return path

    def counter_script(
        self, name: str, *sbatch: str, stop: int = 30, interval: float = 1.0, code: int = 0
    ) -> Path:
        return self.script(
            name,
            f"exec python3 -u {self.work}/counter.py {stop} {interval} {code}",
            f"--output={self.work}/{name}-%j.out",
            *sbatch,
        )

    def sbatch(self, script: Path, *args: str, user: str | None = None) -> str:
        out = self.run("sbatch", "--parsable", *args, str(script), user=user).stdout
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        return parse_record(self.run("scontrol", "show", "job", "-o", job_id).stdout)

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout_s: float = 90) -> str:
        try:
            return str(
                until(
                    lambda: (s := self.state(job_id)) in states and s,
                    timeout_s,
                    f"job {job_id} in {states}",
                )
            )
        except AssertionError as e:
            raise AssertionError(f"{e}; {self.why(job_id)}") from None

    def why(self, job_id: str) -> str:
        """What Slurm says of a job that is not where a test waits for it, and of the nodes."""
        try:
            record = self.job(job_id)
            nodes = self.run("sinfo", "-N", "-h", "-o", "%N %T %E", check=False).stdout
        except Exception as e:  # the failure being reported matters more than this
            return f"(cannot tell why: {e})"
        comment = f", its Comment {record['Comment']!r}" if record.get("Comment") else ""
        return (
            f"it is {record.get('JobState')} ({record.get('Reason')}){comment}, the nodes: "
            + "; ".join(nodes.strip().splitlines())
        )

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

    def stasis(
        self, *args: str, user: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.run(STASIS, *args, user=user, check=check)

    def on(
        self, node: str, *cmd: str, user: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """`cmd` run on `node` (its namespaces, its stasis config), as `user` if given."""
        inner = ["runuser", "-u", user, "--", *cmd] if user else list(cmd)
        return self.run(
            STASIS_DEV,
            "local-cluster",
            "exec",
            "--dir",
            str(self.root),
            node,
            "--",
            *inner,
            check=check,
        )

    def checkpoints(
        self, label: str | None = None, user: str | None = None
    ) -> list[dict[str, Any]]:
        """Root's view; a label is looked up among root's own checkpoints unless `user`."""
        args = [
            "checkpoints",
            "--json",
            *(["--label", label] if label else []),
            *(["--user", user] if user else []),
        ]
        found: list[dict[str, Any]] = json.loads(self.stasis(*args).stdout)
        return found

    def sacct(self, job_id: str) -> list[tuple[str, str]]:
        """(State, ExitCode) of the job's records in the job completion log (`sacct -c`)."""
        out = self.run("sacct", "-c", "-n", "-P", "-j", job_id, "-o", "state,exitcode").stdout
        return [tuple(line.split("|")[:2]) for line in out.splitlines() if "|" in line]  # type: ignore[misc]

    def pids(self, job_id: str) -> list[int]:
        result = self.run("scontrol", "listpids", job_id, check=False)
        return [
            int(line.split()[0])
            for line in result.stdout.splitlines()[1:]
            if line.split() and line.split()[0].isdigit()
        ]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def new_cluster(
    name: str,
    nodes: int = 1,
    without_stasis: tuple[str, ...] = (),
    environ: dict[str, str] | None = None,
    job_container: bool = False,
) -> Cluster:
    """`job_container`: Slurm's job_container/tmpfs (the cluster then lives under /var/lib:
    each job has a /tmp of its own)."""
    ensure_test_user()
    root = Path(
        tempfile.mkdtemp(prefix=f"stasis-e2e-{name}-", dir="/var/lib" if job_container else None)
    )
    os.chmod(root, 0o755)
    c = Cluster(root, nodes, without_stasis, environ, job_container)
    c.up()
    return c


def multinode_cluster(
    name: str, number: int, nodes: int = 2, environ: dict[str, str] | None = None
) -> Cluster:
    """A cluster of `nodes` nodes with `slurm_multinode = number` on every one, installed again
    with it (job_submit.lua, PrologFlags=Alloc, the plugin's multinode=1) and reconfigured."""
    from stasis.slurm import install

    c = new_cluster(name, nodes=nodes, environ=environ)
    try:
        for node in (f"n{i}" for i in range(1, nodes + 1)):
            conf = c.lay.config_of(node)
            conf.write_text(conf.read_text() + f"slurm_multinode = {number}\n")
        install.install(
            install.InstallOptions(
                roles=frozenset(install.ROLES),
                slurm_conf=c.lay.slurm_conf,
                lib_dir=c.lay.lib,
                stasis_config=c.lay.config_of("%n"),
                systemd_dir=None,
                multinode=number,
            ),
            out=None,
        )
        c.run("scontrol", "reconfigure")
    except BaseException:
        close_cluster(c)
        raise
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


# Starting and stopping a cluster takes seconds each, more on a loaded machine: the modules whose
# tests leave it as they found it (their jobs ended, the node up, the daemon running) share one,
# made clean at each module's start. A module that restarts Slurm, reinstalls stasis or needs the first job
# ids keeps `cluster`, a cluster of its own.
@pytest.fixture(scope="session")
def _shared_clusters() -> Iterator[list[Cluster]]:
    made: list[Cluster] = []
    yield made
    for c in made:
        close_cluster(c)


@pytest.fixture(scope="module")
def shared_cluster(_shared_clusters: list[Cluster]) -> Cluster:
    """The session's single-node cluster, with no job left, its node idle and its daemon up;
    one that cannot be made so (a module before broke it) is replaced by a new one."""
    if _shared_clusters and not made_clean(_shared_clusters[-1]):
        close_cluster(_shared_clusters.pop())
    if not _shared_clusters:
        _shared_clusters.append(new_cluster("shared"))
    return _shared_clusters[-1]


def made_clean(c: Cluster) -> bool:
    """Cancel every job, resume a drained node, start a stopped daemon: True when the cluster
    is then as new (no job, n1 idle, the daemon answering)."""

    def jobs() -> list[str] | None:
        r = c.run("squeue", "-h", "-t", "all", "-o", "%i %T", check=False)
        if r.returncode != 0:
            return None
        return [
            line.split()[0]
            for line in r.stdout.splitlines()
            if line.split()[1:] and line.split()[1] not in ENDED
        ]

    left = jobs()
    if left is None:
        return False
    if left:
        c.run("scancel", *left, check=False)
    if poll(lambda: jobs() == [], 60, interval_s=0.5) is None:
        return False
    node = c.run("scontrol", "show", "node", NODE, check=False).stdout
    if re.search(r"State=\S*(DRAIN|DOWN)", node):
        c.run("scontrol", "update", f"NodeName={NODE}", "State=RESUME", check=False)
    if (
        poll(
            lambda: c.run("sinfo", "-h", "-n", NODE, "-o", "%T", check=False).stdout.strip()
            == "idle",
            60,
            interval_s=0.5,
        )
        is None
    ):
        return False
    slurmcluster.start_daemon(c.root)  # nothing to do when it runs
    return poll(lambda: c.stasis("ps", check=False).returncode == 0, 30, interval_s=0.5) is not None


ENDED = (
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "PREEMPTED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
)


# The time-limit job needs minutes of wall time: it runs on a cluster of its own, submitted as
# soon as the session's tests are known (Early), and checked by test_time_limit.py at the end.
TIME_LIMIT_WORK_S = 170


class LongJob:
    def __init__(self, cluster: Cluster, job_id: str, started: float) -> None:
        self.cluster = cluster
        self.job_id = job_id
        self.started = started


def _submit_long_job(environ: dict[str, str]) -> LongJob:
    c = new_cluster("timelimit", environ=environ)
    try:
        script = c.counter_script(
            "long",
            "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=long",
            "--time=1",
            stop=TIME_LIMIT_WORK_S,
            interval=1.0,
        )
        return LongJob(c, c.sbatch(script), time.monotonic())
    except BaseException:
        close_cluster(c)
        raise


LONG_JOB = Early(_submit_long_job, lambda job: close_cluster(job.cluster))
EARLY["test_time_limit.py"] = LONG_JOB


@pytest.fixture(scope="session")
def time_limit_job() -> Iterator[LongJob]:
    try:
        yield LONG_JOB.take(300)
    finally:
        LONG_JOB.close()


def wait_gone(pids: list[int], timeout_s: float = 30) -> None:
    until(lambda: not any(alive(p) for p in pids), timeout_s, f"processes {pids} to end")


T = TypeVar("T")


def until(pred: Callable[[], T | None], timeout_s: float, what: str) -> T:
    value = poll(pred, timeout_s, interval_s=0.5)
    if not value:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
    return value
