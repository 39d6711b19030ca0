"""Shared fixtures: a real stasis daemon (root) in a private directory, and the `stasis` CLI."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from stasis.dev.nodehost import NodeHost
from stasis.poll import poll
from tests import leftovers, nodes, parallel
from tests.s3server import S3Server

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "tests" / "workloads"
STASIS = str(Path(sys.executable).parent / "stasis")
STASIS_DEV = str(Path(sys.executable).parent / "stasis-dev")  # the bench: stasis.dev
TEST_USER = "stasis-test"

T = TypeVar("T")


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    leftovers.start(None if workerinput is None else workerinput.get(leftovers.WORKER_TOKEN))
    if parallel.is_controller(config):
        # Made once, here, before the workers exist (two useradds at once fail).
        ensure_test_user()
        config.stash[_LOCKS] = parallel.lock_directory()


def pytest_unconfigure(config: pytest.Config) -> None:
    locks = config.stash.get(_LOCKS, None)
    if locks is not None:
        shutil.rmtree(locks, ignore_errors=True)


_LOCKS = pytest.StashKey[Path]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    parallel.configure_node(node, node.config.stash[_LOCKS])
    leftovers.give_token(node.workerinput)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    leftovers.heard_from(node.workeroutput if hasattr(node, "workeroutput") else {})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") == "loadgroup":
        return parallel.make_scheduler(config, log)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if parallel.worker_id(config) is not None:
        parallel.mark_groups(items)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    yield from parallel.around_test(item)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    leftovers.check(session)


def workload(name: str, *args: object) -> list[str]:
    """A command line running one of tests/workloads/ with the system's python3."""
    return ["python3", "-u", str(WORKLOADS / name), *map(str, args)]


def wait_for(
    predicate: Callable[[], T | None], timeout_s: float = 15.0, what: str = "condition"
) -> T:
    value = poll(predicate, timeout_s)
    if not value:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
    return value


def ensure_test_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(TEST_USER)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--create-home", "--shell", "/bin/sh", TEST_USER],
            capture_output=True,
            text=True,
        )
        try:
            return pwd.getpwnam(TEST_USER)  # made here, or by another session meanwhile
        except KeyError:
            raise AssertionError(f"useradd {TEST_USER} failed: {made.stderr.strip()}") from None


class Daemon:
    """One `stasis daemon` with its own socket, state and store, plus a CLI wired to it.

    `separate`: the daemon, its jobs and the CRIU it runs are in a node of their own
    (tests/nodes.py), named `name`, made at the first start and kept across restarts."""

    def __init__(
        self,
        root: Path,
        store: str | None = None,
        keep: int = 5,
        env: dict[str, str] | None = None,
        nofile: int | None = None,
        separate: bool = False,
        name: str = "node",
    ) -> None:
        self.root = root
        self.separate = separate
        self.name = name
        self.node: NodeHost | None = None
        # RLIMIT_NOFILE (soft and hard) to start the daemon under: a service manager's low one.
        self.nofile = nofile
        self.socket = root / "stasis.sock"
        self.state_dir = root / "state"
        self.store = store or str(root / "store")
        self.env = {
            **os.environ,
            "STASIS_SOCKET": str(self.socket),
            "STASIS_STATE_DIR": str(self.state_dir),
            "STASIS_STORE": self.store,
            "STASIS_KEEP": str(keep),
            # Within stop()'s wait, should a test stop a daemon mid lazy restore.
            "STASIS_LAZY_DRAIN_TIMEOUT_S": "10",
            "STASIS_CONFIG": "",
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log = open(self.root / "daemon.log", "ab")
        limit = ["prlimit", f"--nofile={self.nofile}:{self.nofile}", "--"] if self.nofile else []
        inside: list[str] = []
        if self.separate:
            if self.node is None:
                local = [Path(self.store)] if self.store.startswith("/") else []
                self.node = nodes.make_node(self.name, self.root, self.root.parent, *local)
            inside = self.node.prefix()
        self.proc = subprocess.Popen(
            [*inside, *limit, STASIS, "daemon"],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        wait_for(self._answers, 20, "the daemon's socket")

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"daemon exited: {(self.root / 'daemon.log').read_text()}")
        return self.socket.exists() and self.cli("ps", check=False).returncode == 0

    def stop(self) -> None:
        try:
            if self.proc and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    # Said by the test; the next ones get a machine without it.
                    self.proc.kill()
                    self.proc.wait()
                    raise
        finally:
            self.proc = None
            self.log.close()

    def cli(
        self,
        *args: str,
        user: str | None = None,
        check: bool = True,
        input_env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        cmd = [STASIS, *args]
        if user:
            cmd = [
                "runuser",
                "-u",
                user,
                "--",
                "env",
                *(f"{k}={v}" for k, v in self.env.items() if k.startswith("STASIS_")),
                *cmd,
            ]
        result = subprocess.run(
            cmd, env={**self.env, **(input_env or {})}, capture_output=True, text=True, timeout=300
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"stasis {' '.join(args)} failed ({result.returncode}): "
                f"{result.stderr}{result.stdout}"
            )
        return result

    def json(self, *args: str, user: str | None = None) -> Any:
        return json.loads(self.cli(args[0], "--json", *args[1:], user=user).stdout)

    def run(self, *command: str, label: str | None = None, user: str | None = None) -> Any:
        opts = ["--label", label] if label else []
        if user:
            opts += ["--user", user]
        return self.json("run", *opts, "--", *command)

    def job(self, job_id: str) -> Any:
        return next(j for j in self.json("ps") if j["job"] == job_id)

    def log_of(self, job_id: str) -> str:
        return self.cli("logs", job_id).stdout

    def kill_all(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for job in self.json("ps"):
            if job["state"] in ("running", "restored"):
                self.cli("kill", job["job"], check=False)


@pytest.fixture(scope="session")
def test_user() -> pwd.struct_passwd:
    return ensure_test_user()


@pytest.fixture
def site_key(world_tmp: Path) -> Iterator[Path]:
    """A site key file (32 random bytes, root-only) for test daemons standing in for the nodes
    of one site (STASIS_SITE_KEY)."""
    path = world_tmp / f"site-{os.urandom(4).hex()}.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def s3(world_tmp: Path) -> Iterator[S3Server]:
    """One real S3 server (SeaweedFS) for the whole session; tests make their own buckets."""
    server = S3Server(Path(tempfile.mkdtemp(prefix="s3-", dir=world_tmp)))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def site_s3(world_tmp: Path) -> Iterator[S3Server]:
    """An S3 server on the network of the nodes of their own (tests/nodes.py), for stores
    they share."""
    server = S3Server(
        Path(tempfile.mkdtemp(prefix="s3-site-", dir=world_tmp)), host=nodes.site_address()
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3: S3Server) -> str:
    """A fresh bucket on the session's S3 server."""
    return s3.make_bucket(f"t-{os.urandom(6).hex()}")


@pytest.fixture(scope="session")
def world_tmp() -> Iterator[Path]:
    """A scratch directory other users can traverse (pytest's tmp_path is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="stasis-tests-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def holdfd(world_tmp: Path) -> Path:
    """tests/workloads/holdfd.c built: a program holding what CRIU cannot checkpoint."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc is missing: install build-essential")
    where = Path(tempfile.mkdtemp(prefix="holdfd-", dir=world_tmp))
    os.chmod(where, 0o755)
    binary = where / "holdfd"
    subprocess.run(
        [gcc, "-O2", "-Wall", "-Werror", "-o", str(binary), str(WORKLOADS / "holdfd.c")],
        check=True,
        timeout=120,
    )
    return binary


def new_daemon(world_tmp: Path, name: str, **kwargs: Any) -> Daemon:
    """A daemon in a directory of its own under `world_tmp`; `separate=True`: in a node of its
    own named `name` (its own /tmp, /var/tmp, /dev/shm, /run, host name and address)."""
    root = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=world_tmp))
    os.chmod(root, 0o755)
    return Daemon(root, name=name, **kwargs)


@pytest.fixture(scope="session", autouse=True)
def _separate_nodes() -> Iterator[None]:
    """Ends the session's separate nodes and their network (tests/nodes.py), if any was made."""
    yield
    nodes.close_all()


@pytest.fixture(scope="module")
def daemon(world_tmp: Path, test_user: pwd.struct_passwd) -> Iterator[Daemon]:
    d = new_daemon(world_tmp, "daemon", keep=3)
    d.start()
    yield d
    d.kill_all()
    d.stop()


class MakeDaemon(Protocol):
    """The `make_daemon` fixture: starts one more daemon, with `Daemon`'s keyword arguments."""

    def __call__(
        self,
        *,
        store: str | None = ...,
        keep: int = ...,
        env: dict[str, str] | None = ...,
        nofile: int | None = ...,
        separate: bool = ...,
    ) -> Daemon: ...


@pytest.fixture
def make_daemon(world_tmp: Path, test_user: pwd.struct_passwd) -> Iterator[MakeDaemon]:
    made: list[Daemon] = []

    def make(**kwargs: Any) -> Daemon:
        d = new_daemon(world_tmp, "daemon", **kwargs)
        d.start()
        made.append(d)
        return d

    yield make
    for d in made:
        d.kill_all()
        d.stop()


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts (stdout piped or not), killed and reaped at its end."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()
