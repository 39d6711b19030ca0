"""A job's node-local files travel with its checkpoint (issue 29), on one node, through a real
daemon and real CRIU: what the job keeps under /tmp or /dev/shm (a tempfile, a SQLite database,
a FIFO, the directory of its unix socket, a JVM's hsperfdata file) is removed after its dump, as
on a node that never ran it, and its restore brings it back: the job's count goes on, read back
from the file. A job over node_local_limit is refused at once, still running; a symbolic link
its user plants where the restore recreates a directory or a file refuses the restore, and root
writes nothing where it points."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stasis.engine import nodelocal, proctree
from tests.conftest import TEST_USER, WORKLOADS, Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error
from tests.daemon.test_encryption import _key
from tests.s3server import S3Server


def _counts(d: Daemon, job: str) -> list[int]:
    return [int(n) for n in re.findall(r"^count (\d+)$", d.log_of(job), re.M)]


def _last(d: Daemon, job: str) -> int:
    found = _counts(d, job)
    return found[-1] if found else 0


def _goes_on(d: Daemon, job: str, at_dump: int) -> None:
    """The restored job counts on from where it was dumped: its state came back, files too."""
    try:
        wait_for(lambda: _last(d, job) >= at_dump + 5, what="counting on after the restore")
    except AssertionError as e:
        raise AssertionError(f"{e}: {d.log_of(job)[-1500:]}") from None
    text = d.log_of(job)
    assert "MISMATCH" not in text and "Traceback" not in text, text[-2000:]
    values = _counts(d, job)
    assert values == list(range(1, len(values) + 1)), values[-20:]


@pytest.fixture
def user_dir() -> Iterator[Path]:
    """A fresh directory of the test user's under /tmp (as a job makes its own)."""
    pw = pwd.getpwnam(TEST_USER)
    path = Path(tempfile.mkdtemp(prefix="nl-", dir="/tmp"))
    os.chown(path, pw.pw_uid, pw.pw_gid)
    os.chmod(path, 0o750)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _as_user(*command: str) -> None:
    subprocess.run(["runuser", "-u", TEST_USER, "--", *command], check=True)


def _job(d: Daemon, kind: str, directory: Path, *more: object) -> Any:
    job = d.run(*workload("keeplocal.py", kind, directory, *more), user=TEST_USER)
    wait_for(lambda: _last(d, job["job"]) >= 3, what="counting")
    return job


def _stop_dump(d: Daemon, job: Any) -> tuple[str, int]:
    checkpoint = d.json("dump", job["job"])["checkpoint"]
    return checkpoint, _last(d, job["job"])


@pytest.mark.parametrize("kind", ["tmp", "fifo"])
def test_a_file_in_tmp_comes_back_with_the_job(daemon: Daemon, user_dir: Path, kind: str) -> None:
    job = _job(daemon, kind, user_dir)
    kept = next(user_dir.iterdir())
    checkpoint, at_dump = _stop_dump(daemon, job)
    before = kept.lstat()  # the job stopped as dumped
    # As on a node that never ran it: its directory is gone too.
    shutil.rmtree(user_dir)
    restored = daemon.json("restore", checkpoint)
    now = kept.lstat()
    assert (now.st_uid, now.st_gid, stat.S_IMODE(now.st_mode), stat.S_IFMT(now.st_mode)) == (
        before.st_uid,
        before.st_gid,
        stat.S_IMODE(before.st_mode),
        stat.S_IFMT(before.st_mode),
    )
    assert stat.S_IMODE(user_dir.stat().st_mode) == 0o750
    assert user_dir.stat().st_uid == pwd.getpwnam(TEST_USER).pw_uid
    # One file of the images, hashed in the signed manifest like them; its paths listed there.
    manifest = json.loads((Path(daemon.store) / checkpoint / "manifest.json").read_text())
    assert [
        f["blake3"] is not None for f in manifest["files"] if f["name"] == nodelocal.ARCHIVE_NAME
    ] == [True]
    assert manifest["extra"][nodelocal.MANIFEST_KEY]["paths"] == [str(kept)]
    if kind == "tmp":  # its time as dumped (the restored job has written it since)
        carried = nodelocal.read_index(Path(daemon.store) / checkpoint / nodelocal.ARCHIVE_NAME)
        assert [e.mtime_ns for e in carried if e.path == str(kept)] == [before.st_mtime_ns]
    assert any("recreated" in n for n in restored["notes"]), restored["notes"]
    _goes_on(daemon, restored["job"], at_dump)
    daemon.cli("kill", restored["job"])


def test_a_sqlite_database_in_dev_shm_comes_back(daemon: Daemon) -> None:
    pw = pwd.getpwnam(TEST_USER)
    shm = Path(tempfile.mkdtemp(prefix="nl-", dir="/dev/shm"))
    os.chown(shm, pw.pw_uid, pw.pw_gid)
    try:
        job = _job(daemon, "shm", shm)
        checkpoint, at_dump = _stop_dump(daemon, job)
        db = next(shm.glob("*.db"))
        assert {p.name for p in shm.iterdir()} == {db.name, f"{db.name}-wal", f"{db.name}-shm"}
        for path in shm.iterdir():
            path.unlink()
        restored = daemon.json("restore", checkpoint)
        assert db.stat().st_uid == pw.pw_uid
        _goes_on(daemon, restored["job"], at_dump)
        daemon.cli("kill", restored["job"])
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _ask(path: Path) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.settimeout(10)
        c.connect(str(path))
        line = c.makefile().readline()
    return int(line.split()[1])


def test_a_unix_socket_in_a_removed_directory_listens_again(daemon: Daemon, user_dir: Path) -> None:
    job = _job(daemon, "sock", user_dir)
    sock = user_dir / "sock"
    asked = _ask(sock)
    assert asked >= 3
    checkpoint, at_dump = _stop_dump(daemon, job)
    shutil.rmtree(user_dir)
    restored = daemon.json("restore", checkpoint)
    assert user_dir.stat().st_uid == pwd.getpwnam(TEST_USER).pw_uid
    # The server's count in memory goes on: a client gets a number past the one before.
    again = wait_for(lambda: _ask(sock), what="the restored server answering")
    assert again >= at_dump >= asked, (asked, at_dump, again)
    _goes_on(daemon, restored["job"], at_dump)
    daemon.cli("kill", restored["job"])


def test_a_job_over_the_limit_is_refused_at_once_and_keeps_running(
    make_daemon: MakeDaemon, user_dir: Path
) -> None:
    d = make_daemon(env={"STASIS_NODE_LOCAL_LIMIT": str(64 << 10)})
    job = _job(d, "big", user_dir, 200 << 10)
    big = next(user_dir.glob("big-*"))
    line = one_line_error(
        d.cli("dump", job["job"], check=False),
        1,
        f"checkpoint of job {job['job']} refused, job still running",
        "node_local_limit",
        f"{big} (200.0 KiB)",
    )
    if "small-" in line:
        assert line.index(str(big)) < line.index("small-")  # the largest first
    # `dump --check` says the same, without dumping.
    check = d.cli("dump", "--check", job["job"], check=False)
    assert check.returncode == 1 and f"{big} (200.0 KiB)" in check.stdout, check.stdout
    was = _last(d, job["job"])
    wait_for(lambda: _last(d, job["job"]) >= was + 3, what="the job counting on")
    assert d.job(job["job"])["state"] == "running"
    assert d.json("checkpoints") == []
    d.cli("kill", job["job"])


@pytest.mark.parametrize("where", ["directory", "file"])
def test_a_planted_symlink_refuses_the_restore_and_root_writes_nothing_there(
    daemon: Daemon, user_dir: Path, world_tmp: Path, where: str
) -> None:
    job = _job(daemon, "tmp", user_dir)
    kept = next(user_dir.iterdir())
    checkpoint, _ = _stop_dump(daemon, job)
    # A directory only root may write, as /etc is: where the user wants root to write.
    victim = Path(tempfile.mkdtemp(prefix="victim-", dir=world_tmp))
    os.chmod(victim, 0o755)
    _as_user("rm", "-rf", str(user_dir if where == "directory" else kept))
    if where == "directory":
        # /tmp is sticky: the user removes their own directory, and links its name.
        _as_user("ln", "-s", str(victim), str(user_dir))
        planted = user_dir
    else:
        _as_user("ln", "-s", str(victim / kept.name), str(kept))
        planted = kept
    line = one_line_error(
        daemon.cli("restore", checkpoint, check=False),
        1,
        f"cannot restore checkpoint {checkpoint}",
        f"{planted} is a symbolic link",
    )
    assert list(victim.iterdir()) == [], line
    assert not any(
        j["state"] in ("running", "restored") and j.get("checkpoint") == checkpoint
        for j in daemon.json("ps")
    )
    # Taken away, the restore goes on as the checkpoint says.
    os.unlink(planted)
    restored = daemon.json("restore", checkpoint)
    assert list(victim.iterdir()) == []
    daemon.cli("kill", restored["job"])


def test_a_file_of_the_jobs_own_that_differs_is_replaced_unless_in_use(
    daemon: Daemon, user_dir: Path
) -> None:
    job = _job(daemon, "tmp", user_dir)
    kept = next(user_dir.iterdir())
    checkpoint, at_dump = _stop_dump(daemon, job)
    # Changed after the dump (a --leave-running job that went on, then ended): the job's own.
    _as_user("sh", "-c", f"printf 999999 > {kept}")
    # Someone has it open: it is not only the job's, the restore says so and waits.
    with open(kept) as held:
        holder = subprocess.Popen(["sleep", "60"], stdin=held, user=TEST_USER)
    try:
        one_line_error(
            daemon.cli("restore", checkpoint, check=False),
            1,
            f"{kept} differs from the checkpoint's copy and process",
        )
    finally:
        holder.kill()
        holder.wait()
    restored = daemon.json("restore", checkpoint)
    assert any("replaced by the checkpoint's copy" in n for n in restored["notes"]), restored[
        "notes"
    ]
    _goes_on(daemon, restored["job"], at_dump)
    daemon.cli("kill", restored["job"])


def test_a_java_job_restores_after_leave_running_and_kill(daemon: Daemon, world_tmp: Path) -> None:
    javac = shutil.which("javac")
    if javac is None:
        pytest.fail("javac is missing: run scripts/install-test-apps.sh (default-jdk-headless)")
    classes = Path(tempfile.mkdtemp(prefix="java-", dir=world_tmp))
    os.chmod(classes, 0o755)
    subprocess.run(
        [javac, "-d", str(classes), str(WORKLOADS / "Ticker.java")], check=True, timeout=120
    )
    job = daemon.run(
        "java",
        "-Xmx32m",
        "-XX:+UseSerialGC",
        "-Xshare:off",
        "-XX:TieredStopAtLevel=1",
        "-cp",
        str(classes),
        "Ticker",
    )
    wait_for(lambda: _last(daemon, job["job"]) >= 3, 30, what="the JVM counting")
    floor = _last(daemon, job["job"])
    checkpoint = daemon.json("dump", "--leave-running", job["job"])["checkpoint"]
    # The JVM's perf data file, which it keeps mapped (as its pid in the job's namespace).
    ours = sorted(
        {
            line.split()[-1]
            for p in proctree.tree(job["pid"])
            for line in Path(f"/proc/{p}/maps").read_text().splitlines()
            if "/tmp/hsperfdata_root/" in line
        }
    )
    assert ours
    # SIGTERM: the JVM removes its hsperfdata file on the way out.
    daemon.cli("kill", job["job"])
    wait_for(lambda: not os.path.exists(ours[0]), what="the JVM removing its perf data")
    before = len(daemon.log_of(job["job"]))  # the restored job appends to the same log
    restored = daemon.json("restore", checkpoint)
    assert os.path.exists(ours[0])
    carried = nodelocal.read_index(Path(daemon.store) / checkpoint / nodelocal.ARCHIVE_NAME)
    assert ours[0] in [e.path for e in carried if e.kind == "file"]

    def after() -> list[int]:
        return [
            int(n)
            for n in re.findall(r"^count (\d+)$", daemon.log_of(restored["job"])[before:], re.M)
        ]

    wait_for(lambda: len(after()) >= 5, 30, what="the JVM counting on")
    values = after()
    # On from the dump, not from 1.
    assert values[0] > floor and values == list(range(values[0], values[0] + len(values))), (
        floor,
        values,
    )
    daemon.cli("kill", restored["job"])


@pytest.mark.parametrize("mode", ["lazy-in-place", "streamed", "fetched", "lazy-served"])
def test_every_restore_mode_recreates_the_files_first(
    make_daemon: MakeDaemon, world_tmp: Path, user_dir: Path, mode: str
) -> None:
    """In place (above), lazily in place, decoded while CRIU reads (a compressed checkpoint),
    fetched from a store CRIU may not read, lazily with its pages served from such a store:
    each has the archive before CRIU runs."""
    store = None
    if mode in ("fetched", "lazy-served"):
        path = world_tmp / f"nl-store-{os.urandom(3).hex()}"
        path.mkdir(mode=0o700)
        store = f"dir::file://{path}"
    d = make_daemon(store=store) if store else make_daemon()
    job = _job(d, "tmp", user_dir)
    compress = ["--compress", "zstd"] if mode == "streamed" else []
    checkpoint = d.json("dump", *compress, job["job"])["checkpoint"]
    at_dump = _last(d, job["job"])
    shutil.rmtree(user_dir)
    restored = d.json("restore", *(["--lazy"] if mode.startswith("lazy") else []), checkpoint)
    assert any("recreated" in n for n in restored["notes"]), restored["notes"]
    assert restored["lazy"] == mode.startswith("lazy"), restored
    _goes_on(d, restored["job"], at_dump)
    d.cli("kill", restored["job"])


def test_a_directory_someone_else_made_first_refuses_the_restore(
    daemon: Daemon, user_dir: Path
) -> None:
    job = _job(daemon, "tmp", user_dir)
    kept = next(user_dir.iterdir())
    checkpoint, at_dump = _stop_dump(daemon, job)
    shutil.rmtree(user_dir)
    # The name taken first, by another user (root here), open to all: what the restore made
    # inside would be theirs to swap.
    user_dir.mkdir()
    os.chmod(user_dir, 0o777)
    one_line_error(
        daemon.cli("restore", checkpoint, check=False),
        1,
        f"{user_dir} belongs to uid 0 now, the job's directory there belonged to "
        f"uid {pwd.getpwnam(TEST_USER).pw_uid}",
    )
    assert list(user_dir.iterdir()) == [] and not kept.exists()
    user_dir.rmdir()
    restored = daemon.json("restore", checkpoint)
    _goes_on(daemon, restored["job"], at_dump)
    daemon.cli("kill", restored["job"])


def test_an_encrypted_stop_dump_to_s3_carries_them(
    make_daemon: MakeDaemon, s3: S3Server, s3_bucket: str, world_tmp: Path, user_dir: Path
) -> None:
    """The stop-dump path the store follows while CRIU writes (its images uploaded and sealed
    as they are written): the archive, written after CRIU, is uploaded, hashed and sealed with
    them before the manifest; nothing else has it once the directory is gone."""
    keys = world_tmp / f"keys-{os.urandom(3).hex()}"
    keys.mkdir(mode=0o700)
    _key(keys / "k.key", os.urandom(32))
    d = make_daemon(
        store=f"s3://{s3_bucket}/nl",
        env={**s3.env(), "STASIS_ENCRYPTION_KEY_FILE": str(keys / "k.key")},
    )
    job = _job(d, "tmp", user_dir)
    checkpoint = d.json("dump", "--encrypt", job["job"])["checkpoint"]
    at_dump = _last(d, job["job"])
    shutil.rmtree(user_dir)
    restored = d.json("restore", checkpoint)
    assert any("recreated" in n for n in restored["notes"]), restored["notes"]
    _goes_on(d, restored["job"], at_dump)
    d.cli("kill", restored["job"])


def _archive(path: Path, index: bytes, blobs: bytes = b"") -> Path:
    path.write_bytes(blobs + index + len(index).to_bytes(8, "big") + b"STASIS-NODE-LOCAL-1\n")
    return path


@pytest.mark.parametrize(
    "index, why",
    [
        (
            b'{"roots": ["/tmp"], "entries": [{"path": "/tmp/../etc/x", "kind": "file", "uid": 0,'
            b' "gid": 0, "mode": 420}]}',
            "bad path",
        ),
        (
            b'{"roots": ["/tmp"], "entries": [{"path": "/etc/x", "kind": "file", "uid": 0,'
            b' "gid": 0, "mode": 420}]}',
            "not under a node-local directory",
        ),
        (b'{"roots": ["/"], "entries": []}', "roots"),
        (b'{"roots": ["/usr/lib"], "entries": []}', "roots"),
        (
            b'{"roots": ["/tmp"], "entries": [{"path": "/tmp/stasis-nl-never-made", "kind": "file", "uid": 0,'
            b' "gid": 0, "mode": 420, "size_bytes": 10, "offset": 5}]}',
            "extent",
        ),
        (
            b'{"roots": ["/tmp"], "entries": [{"path": "/tmp/stasis-nl-never-made", "kind": "device", "uid": 0,'
            b' "gid": 0, "mode": 420}]}',
            "bad kind",
        ),
        (b"not json", "malformed"),
    ],
)
def test_a_malformed_archive_is_refused_before_anything_is_made(
    tmp_path: Path, index: bytes, why: str
) -> None:
    """Bytes from the store, parsed by root: whatever they say, nothing outside the node-local
    directories, nothing past the archive's end; one line why."""
    archive = _archive(tmp_path / nodelocal.ARCHIVE_NAME, index, b"0123456789")
    with pytest.raises(nodelocal.NodeLocalError, match=why):
        nodelocal.prepare(archive, 0)
    assert not Path("/etc/x").exists() and not Path("/tmp/stasis-nl-never-made").exists()


def test_a_truncated_or_foreign_archive_is_refused(tmp_path: Path) -> None:
    for data in (b"", b"short", b"x" * 40, (1 << 40).to_bytes(8, "big") + b"STASIS-NODE-LOCAL-1\n"):
        (tmp_path / "a").write_bytes(data)
        with pytest.raises(nodelocal.NodeLocalError):
            nodelocal.read_index(tmp_path / "a")


def test_a_file_under_the_jobs_tmpdir_travels_too(daemon: Daemon) -> None:
    """$TMPDIR (as a site's job prolog sets it to a per-job scratch directory) counts as
    node-local, read from the job's own environment."""
    pw = pwd.getpwnam(TEST_USER)
    scratch = Path(tempfile.mkdtemp(prefix="nl-scratch-", dir="/var/lib"))
    os.chmod(scratch, 0o755)
    mine = scratch / "job"
    mine.mkdir(mode=0o700)
    os.chown(mine, pw.pw_uid, pw.pw_gid)
    try:
        job = daemon.json(
            "run",
            "--user",
            TEST_USER,
            "--env",
            f"TMPDIR={mine}",
            "--",
            *workload("keeplocal.py", "tmp", mine),
        )
        wait_for(lambda: _last(daemon, job["job"]) >= 3, what="counting")
        checkpoint, at_dump = _stop_dump(daemon, job)
        shutil.rmtree(mine)
        restored = daemon.json("restore", checkpoint)
        assert mine.stat().st_uid == pw.pw_uid and stat.S_IMODE(mine.stat().st_mode) == 0o700
        _goes_on(daemon, restored["job"], at_dump)
        daemon.cli("kill", restored["job"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_working_directory_in_tmp_comes_back(daemon: Daemon, user_dir: Path) -> None:
    """CRIU restores a process in its working directory: one under /tmp is made again."""
    cwd = user_dir / "work"
    _as_user("mkdir", "-m", "0710", str(cwd))
    job = daemon.run(
        "sh",
        "-c",
        f'cd "{cwd}" && exec "$0" "$@"',
        *workload("keeplocal.py", "tmp", user_dir),
        user=TEST_USER,
    )
    wait_for(lambda: _last(daemon, job["job"]) >= 3, what="counting")
    checkpoint, at_dump = _stop_dump(daemon, job)
    shutil.rmtree(user_dir)
    restored = daemon.json("restore", checkpoint)
    assert stat.S_IMODE(cwd.stat().st_mode) == 0o710
    _goes_on(daemon, restored["job"], at_dump)
    daemon.cli("kill", restored["job"])
