"""Programs of the classes that real applications fall into (issue 15): shared memory between a
job's processes, and servers that daemonize. Real server software from Debian (PostgreSQL) where
it is the natural test, small programs of our own for the rest.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.engine import proctree
from tests.conftest import Daemon, wait_for, workload
from tests.daemon.test_restore_state import numbers


def _ns(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def _shm_segments(pid: int) -> list[str]:
    """The SysV shared memory segments of the IPC namespace `pid` lives in."""
    out = subprocess.run(
        ["nsenter", "-t", str(pid), "-i", "cat", "/proc/sysvipc/shm"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.splitlines()[1:]


def test_sysv_shared_memory_survives_a_restore(
    daemon: Daemon, test_user: pwd.struct_passwd
) -> None:
    job = daemon.json("run", "--", *workload("sysvshm.py"), user=test_user.pw_name)
    wait_for(lambda: len(numbers(daemon.log_of(job["job"]), "shm ")) >= 5, what="shm counting")
    # The job's segment lives in an IPC namespace of its own, not the host's.
    assert _ns(job["pid"], "ipc") != _ns(os.getpid(), "ipc")
    assert len(_shm_segments(job["pid"])) == 1
    cp = daemon.json("dump", job["job"], user=test_user.pw_name)
    at_dump = numbers(daemon.log_of(job["job"]), "shm ")[-1]
    restored = daemon.json("restore", cp["checkpoint"], user=test_user.pw_name)
    wait_for(
        lambda: numbers(daemon.log_of(restored["job"]), "shm ")[-1] >= at_dump + 5,
        what="shm counting on",
    )
    values = numbers(daemon.log_of(restored["job"]), "shm ")
    # One log for both runs: the count went on through the segment, never back to 0.
    assert values == sorted(values) and values.count(0) <= 1
    assert len(_shm_segments(restored["pid"])) == 1
    assert _ns(restored["pid"], "ipc") != _ns(os.getpid(), "ipc")
    daemon.cli("kill", restored["job"], user=test_user.pw_name)


def test_job_lives_while_any_of_its_processes_does(
    daemon: Daemon, test_user: pwd.struct_passwd
) -> None:
    # The command exits at once, leaving a process in a session of its own (as a daemon does):
    # that process is still the job.
    job = daemon.json(
        "run",
        "--",
        "sh",
        "-c",
        "setsid sh -c 'sleep 2; echo background-done' & echo started",
        user=test_user.pw_name,
    )
    wait_for(lambda: "started" in daemon.log_of(job["job"]), what="the command")

    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            return b""  # exited between the listing and this read

    def command_gone() -> bool:
        # Below the init (whose own argv holds the command too).
        return not any(b"echo started" in cmdline(p) for p in proctree.tree(job["pid"])[1:])

    wait_for(command_gone, what="the command's own process to exit")
    assert daemon.job(job["job"])["state"] == "running"
    assert "background-done" not in daemon.log_of(job["job"])
    wait_for(lambda: daemon.job(job["job"])["state"] == "exited", 20, what="the job's end")
    assert "background-done" in daemon.log_of(job["job"])
    assert daemon.job(job["job"])["exit_code"] == 0


# -- PostgreSQL: daemonizes (pg_ctl start), several processes, SysV shared memory -------------


def _pg_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    assert found, "PostgreSQL is not installed (make install runs scripts/install-test-apps.sh)"
    return Path(found[-1]).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Postgres:
    def __init__(self, root: Path, user: pwd.struct_passwd) -> None:
        self.bin = _pg_bin()
        self.root = root
        self.user = user
        self.data = root / "data"
        self.port = _free_port()

    def as_user(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["runuser", "-u", self.user.pw_name, "--", *cmd],
            cwd=self.root,
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    def start_command(self) -> list[str]:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c shared_memory_type=sysv -c dynamic_shared_memory_type=sysv "
            "-c shared_buffers=8MB -c max_connections=10 -c fsync=off"
        )
        return [
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.root / "pg.log"),
            "-w",
            "-o",
            options,
            "start",
        ]

    def sql(self, query: str) -> str:
        r = self.as_user(
            str(self.bin / "psql"),
            "-X",
            "-A",
            "-t",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            query,
        )
        return r.stdout.strip()


@pytest.fixture
def postgres(world_tmp: Path, test_user: pwd.struct_passwd) -> Iterator[Postgres]:
    root = Path(tempfile.mkdtemp(prefix="pg-", dir=world_tmp))
    shutil.chown(root, test_user.pw_uid, test_user.pw_gid)
    pg = Postgres(root, test_user)
    pg.as_user(
        str(pg.bin / "initdb"), "-D", str(pg.data), "-A", "trust", "-U", "postgres", "--no-sync"
    )
    yield pg
    shutil.rmtree(root, ignore_errors=True)


def _postmaster(pg: Postgres, job_pid: int) -> int:
    """The server's pid as we see it (postmaster.pid has it as the job's namespace sees it)."""
    inner = (pg.data / "postmaster.pid").read_text().split()[0]
    for pid in proctree.tree(job_pid):
        status = Path(f"/proc/{pid}/status").read_text()
        nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
        if nspid[-1] == inner:
            return pid
    raise AssertionError(f"no process of job {job_pid} has namespace pid {inner}")


def test_postgres_daemonized_with_sysv_shm_restores_with_its_data(
    daemon: Daemon, postgres: Postgres
) -> None:
    pg = postgres
    job = daemon.json("run", "--", *pg.start_command(), user=pg.user.pw_name)
    wait_for(lambda: "server started" in daemon.log_of(job["job"]), 60, what="pg_ctl start")
    # pg_ctl exited 0 once the server ran in the background: the job is the server now.
    postmaster = _postmaster(pg, job["pid"])
    assert daemon.job(job["job"])["state"] == "running"
    assert _shm_segments(postmaster), "the server uses SysV shared memory"
    pg.sql("CREATE TABLE t (n int, word text)")
    pg.sql("INSERT INTO t SELECT g, md5(g::text) FROM generate_series(1, 1000) g")
    before = pg.sql("SELECT count(*), sum(n), md5(string_agg(word, ',' ORDER BY n)) FROM t")

    cp = daemon.json("dump", job["job"], user=pg.user.pw_name)
    assert not Path(f"/proc/{postmaster}").exists()
    with pytest.raises(subprocess.CalledProcessError):
        pg.sql("SELECT 1")  # the server is gone with its job
    restored = daemon.json("restore", cp["checkpoint"], user=pg.user.pw_name)
    assert _shm_segments(_postmaster(pg, restored["pid"]))
    # Its data, and new work: a write, then a read that sees it.
    assert pg.sql("SELECT count(*), sum(n), md5(string_agg(word, ',' ORDER BY n)) FROM t") == before
    pg.sql("INSERT INTO t SELECT g, md5(g::text) FROM generate_series(1001, 1500) g")
    assert pg.sql("SELECT count(*) FROM t") == "1500"
    assert re.fullmatch(r"\d+", pg.sql("SELECT pg_backend_pid()"))
    # A clean stop of the restored server (SIGINT: fast shutdown; pg_ctl from outside the job
    # would signal the pid it reads in postmaster.pid, which is the namespace's): the job ends
    # with its last process, with the status of its command (pg_ctl start, 0).
    os.kill(_postmaster(pg, restored["pid"]), signal.SIGINT)
    wait_for(lambda: daemon.job(restored["job"])["state"] == "exited", 30, what="job end")
    assert daemon.job(restored["job"])["exit_code"] == 0
    assert "database system is shut down" in (pg.root / "pg.log").read_text()
