"""A restore resolves the job's paths with its owner's rights (issue 9, item 1).

CRIU runs as root and reopens a job's files, cwd, mappings and socket addresses by path. An
ordinary user who swaps one of them for a symlink between dump and restore must get a refused
restore, never root's file behind their job's fd. Each attack here is made by the real test user
against real root-only files the test creates; the plain round trip shows the same job restores
and goes on when nothing was swapped.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import Daemon, wait_for, workload

SECRET = b"ROOT-ONLY-SECRET".ljust(64, b".")
MINE = b"users-own-bytes!".ljust(64, b"-")


@dataclass
class Paths:
    user: pwd.struct_passwd
    file: Path  # held open O_RDWR
    mapped: Path  # mapped MAP_SHARED
    sock: Path  # a listening unix socket's address
    cwd: Path  # the job's working directory
    secret: Path  # root-only, same size and mode as `file`
    secret_map: Path
    root_sock: Path  # a root-only socket file, in a root-only directory
    root_cwd: Path  # a root-only directory

    def command(self) -> list[str]:
        return workload("holdpaths.py", self.file, self.mapped, self.sock, self.cwd)


def _as_user(user: pwd.struct_passwd, script: str) -> None:
    subprocess.run(["runuser", "-u", user.pw_name, "--", "sh", "-ec", script], check=True)


@pytest.fixture
def shared_fs() -> Iterator[Path]:
    """Where the paths CRIU reopens live: not under /tmp, /var/tmp or /dev/shm, whose files a
    checkpoint carries and a restore recreates itself (stasis/engine/nodelocal.py refuses a
    planted link there before CRIU runs), but on a file system every node sees, where only
    CRIU's reopening with the owner's rights stands between the user and root's files."""
    path = Path(tempfile.mkdtemp(prefix="stasis-owner-tests-", dir="/srv"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def paths(shared_fs: Path, test_user: pwd.struct_passwd) -> Iterator[Paths]:
    home = Path(tempfile.mkdtemp(prefix="owner-", dir=shared_fs))
    os.chmod(home, 0o755)
    os.chown(home, test_user.pw_uid, test_user.pw_gid)
    # Root's side: a directory nobody else may enter, as /root is.
    vault = Path(tempfile.mkdtemp(prefix="root-only-", dir=shared_fs))
    os.chmod(vault, 0o700)
    p = Paths(
        user=test_user,
        file=home / "data",
        mapped=home / "mapped",
        sock=home / "sockets" / "job.sock",
        cwd=home / "cwd",
        secret=vault / "secret",
        secret_map=vault / "secret-map",
        root_sock=vault / "sockets" / "job.sock",
        root_cwd=vault / "cwd",
    )
    for path, data in (
        (p.file, MINE),
        (p.mapped, MINE),
        (p.secret, SECRET),
        (p.secret_map, SECRET),
    ):
        path.write_bytes(data)
        os.chmod(path, 0o600)
    for d in (p.sock.parent, p.cwd, p.root_sock.parent, p.root_cwd):
        d.mkdir(mode=0o700)
    (p.cwd / "users-file").touch()
    (p.root_cwd / "root-file").touch()
    for path in (p.file, p.mapped, p.sock.parent, p.cwd, p.cwd / "users-file"):
        os.chown(path, test_user.pw_uid, test_user.pw_gid)
    # A root daemon's socket, where a root CRIU would unlink and re-bind it.
    root_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    root_listener.bind(str(p.root_sock))
    root_listener.listen()
    yield p
    root_listener.close()
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(vault, ignore_errors=True)


def _ticks(daemon: Daemon, job: str) -> list[int]:
    return [int(n) for n in re.findall(r"^(\d+) file=", daemon.log_of(job), re.M)]


def _dumped(daemon: Daemon, p: Paths) -> tuple[str, str]:
    """Run the job as the user, let it tick, checkpoint it (it stops). (checkpoint, job)."""
    job = daemon.json("run", "--", *p.command(), user=p.user.pw_name)
    wait_for(lambda: len(_ticks(daemon, job["job"])) >= 3, what="the job ticking")
    cp = daemon.json("dump", job["job"], user=p.user.pw_name)
    return cp["checkpoint"], job["job"]


def _refused(daemon: Daemon, p: Paths, checkpoint: str) -> str:
    before = {j["job"] for j in daemon.json("ps")}
    r = daemon.cli("restore", checkpoint, user=p.user.pw_name, check=False)
    restored = [j for j in daemon.json("ps") if j["job"] not in before]
    for j in restored:
        daemon.cli("kill", j["job"], check=False)
    assert r.returncode != 0, f"restore through a swapped path succeeded: {r.stdout}"
    assert not restored
    message = r.stderr.strip()
    assert "Permission denied" in message, message
    assert f"with the rights of its owner, {p.user.pw_name}" in message, message
    assert len(message.splitlines()) == 1, message
    return message


def _root_files_intact(p: Paths) -> None:
    assert p.secret.read_bytes() == SECRET
    assert p.secret_map.read_bytes() == SECRET
    assert p.root_sock.is_socket()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(p.root_sock))  # still root's listener, not one re-bound for the job


def test_plain_round_trip_reopens_everything(daemon: Daemon, paths: Paths) -> None:
    checkpoint, job = _dumped(daemon, paths)
    at_dump = _ticks(daemon, job)[-1]
    restored = daemon.json("restore", checkpoint, user=paths.user.pw_name)
    wait_for(
        lambda: _ticks(daemon, restored["job"])[-1] >= at_dump + 3, what="the restored job ticking"
    )
    # One log for both: the restored job went on from where it was, not from 0.
    ticks = _ticks(daemon, restored["job"])
    assert ticks == list(range(len(ticks)))
    last = daemon.log_of(restored["job"]).splitlines()[-1]
    assert "users-own-bytes!" in last and "['users-file']" in last
    data = paths.file.read_bytes()
    assert data[:16] == MINE[:16] and int(data[16:24]) > at_dump
    assert int(paths.mapped.read_bytes()[24:32]) > at_dump
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(paths.sock))  # the restored job listens at its address again
    assert paths.sock.stat().st_uid == paths.user.pw_uid
    daemon.cli("kill", restored["job"], user=paths.user.pw_name)
    _root_files_intact(paths)


def test_open_file_swapped_for_symlink_to_root_file(daemon: Daemon, paths: Paths) -> None:
    checkpoint, _ = _dumped(daemon, paths)
    _as_user(paths.user, f"rm {paths.file}; ln -s {paths.secret} {paths.file}")
    _refused(daemon, paths, checkpoint)
    _root_files_intact(paths)


def test_mapped_file_swapped_for_symlink_to_root_file(daemon: Daemon, paths: Paths) -> None:
    checkpoint, _ = _dumped(daemon, paths)
    _as_user(paths.user, f"rm {paths.mapped}; ln -s {paths.secret_map} {paths.mapped}")
    _refused(daemon, paths, checkpoint)
    _root_files_intact(paths)


def test_cwd_swapped_for_symlink_to_root_dir(daemon: Daemon, paths: Paths) -> None:
    checkpoint, _ = _dumped(daemon, paths)
    _as_user(paths.user, f"rm -r {paths.cwd}; ln -s {paths.root_cwd} {paths.cwd}")
    _refused(daemon, paths, checkpoint)
    _root_files_intact(paths)


def test_socket_dir_swapped_for_symlink_to_root_dir(daemon: Daemon, paths: Paths) -> None:
    # A root CRIU unlinks the stale socket file at the job's address, then binds there: through
    # the symlink, that was root's own socket in a directory the user cannot even enter.
    checkpoint, _ = _dumped(daemon, paths)
    inode = paths.root_sock.stat().st_ino
    _as_user(
        paths.user,
        f"rm -r {paths.sock.parent}; ln -s {paths.root_sock.parent} " f"{paths.sock.parent}",
    )
    _refused(daemon, paths, checkpoint)
    _root_files_intact(paths)
    assert paths.root_sock.stat().st_ino == inode


PROJECT_GROUP = "stasis-test-proj"


def test_log_reopened_with_the_owners_groups(daemon: Daemon, paths: Paths, world_tmp: Path) -> None:
    # The supervisor (root) reopens the job's log with the owner's uid and all of the owner's
    # groups: a log in a project directory the owner reaches only through a supplementary group
    # must come back, and root's own groups must never count.
    if subprocess.run(["getent", "group", PROJECT_GROUP], capture_output=True).returncode:
        subprocess.run(["groupadd", PROJECT_GROUP], check=True)
    subprocess.run(["usermod", "-aG", PROJECT_GROUP, paths.user.pw_name], check=True)
    project = Path(tempfile.mkdtemp(prefix="project-", dir=world_tmp))
    shutil.chown(project, "root", PROJECT_GROUP)
    os.chmod(project, 0o2770)
    log = project / "job.log"
    job = daemon.json("run", "--log", str(log), "--", *paths.command(), user=paths.user.pw_name)
    wait_for(lambda: log.exists() and log.read_text().count(" file=") >= 3, what="ticking")
    cp = daemon.json("dump", job["job"], user=paths.user.pw_name)
    at_dump = _ticks(daemon, job["job"])[-1]
    restored = daemon.json("restore", cp["checkpoint"], user=paths.user.pw_name)
    wait_for(lambda: _ticks(daemon, restored["job"])[-1] >= at_dump + 2, what="ticking on")
    daemon.cli("kill", restored["job"], user=paths.user.pw_name)
    shutil.rmtree(project)
