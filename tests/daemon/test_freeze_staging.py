"""A leave-running dump's freeze does not wait for the disk: while the node's disk is behind, the
images are staged in a tmpfs the daemon owns (daemon/staging.py, stage_dir = "auto", the
default), within the memory headroom staging has; while it keeps up, they go to the store's page
cache as before."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pytest

from stasis.daemon import staging
from stasis.daemon.staging import DiskState, disk_behind
from tests.conftest import Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_restore_state import workload_pid

MIB, GIB = 1 << 20, 1 << 30
T = TypeVar("T")


def _digest(d: Daemon, job: str) -> list[str]:
    return re.findall(r"^digest (\w+)$", d.log_of(job), re.M)


def _mount_type(path: Path) -> str:
    best, fstype = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount_point = fields[4]
        if (
            str(path) == mount_point or str(path).startswith(mount_point.rstrip("/") + "/")
        ) and len(mount_point) >= len(best):
            best, fstype = mount_point, fields[fields.index("-") + 1]
    return fstype


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A scratch directory on a disk: /tmp may be a tmpfs (Debian 13's default, the fresh roots
    the README's commands are tried in), where a writer makes no writeback and a directory is a
    tmpfs already."""
    for base in (Path("/var/tmp"), Path(__file__).resolve().parent):
        if _mount_type(base) not in ("tmpfs", "ramfs", ""):
            path = Path(tempfile.mkdtemp(prefix="stasis-disk-", dir=base))
            yield path
            shutil.rmtree(path, ignore_errors=True)
            return
    raise AssertionError("no disk-backed directory here (/var/tmp and the tests are on tmpfs)")


@contextmanager
def disk_writer(where: Path) -> Iterator[None]:
    """Another process filling the page cache of the disk under `where` (as a job writing its
    results would), until the node's state says so; killed, and its file gone, afterwards (its
    dirty pages go with the file, never written back). It rewrites a file three times the
    kernel's background threshold, over and over: a single pass ended before the dump looked
    on a machine with more memory (CI, once), and an endless file would fill the disk."""
    target = where / "writer.bin"
    mib = 3 * staging.disk_state().background >> 20
    free = shutil.disk_usage(where).free >> 20
    assert free > mib + 1024, f"{where} has {free} MiB free, the disk writer needs {mib} MiB"
    proc = subprocess.Popen(
        [
            "sh",
            "-c",
            f'while :; do dd if=/dev/zero of="{target}" bs=1M count={mib} conv=notrunc '
            "status=none || exit 1; done",
        ],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: disk_behind(staging.disk_state(), 32 * MIB),
            timeout_s=10,
            what="the disk writer to put the node behind",
        )
        yield
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        target.unlink(missing_ok=True)


def while_behind(dump: Callable[[], T], behind: Callable[[T], bool], tries: int = 3) -> T:
    """`dump` until the daemon found the disk behind: it samples the kernel's counters for 50 ms,
    and the writer stalls at times (measured here: 5 samples in 300 saw nothing waiting). A
    leave-running dump that went to the store is a checkpoint like any other."""
    for _ in range(tries - 1):
        result = dump()
        if behind(result):
            return result
    return dump()


def test_the_disk_is_behind_by_its_write_rate_or_its_backlog() -> None:
    quiet = DiskState(
        backlog=8 * MIB, background=2 * GIB, dirtied_per_s=0.5 * MIB, written_per_s=MIB
    )
    assert disk_behind(quiet, GIB) is None  # the page cache takes it as fast as a tmpfs
    # Numbers seen on this machine with `dd` writing beside the dump (bench/freeze.py).
    writer = quiet._replace(backlog=1400 * MIB, dirtied_per_s=210 * MIB)
    assert disk_behind(writer, 32 * MIB) == "the node is writing 210 MiB/s to disk"
    flushing = quiet._replace(written_per_s=120 * MIB)
    assert disk_behind(flushing, 32 * MIB) == "the node is writing 120 MiB/s to disk"
    # Nobody writing, but what waits plus this dump would start writeback (and throttling).
    backlog = quiet._replace(backlog=1500 * MIB)
    assert disk_behind(backlog, 600 * MIB) == (
        "1500 MiB wait to be written to disk, and the dump's 600 MiB would take that past the "
        "kernel's writeback threshold (2048 MiB)"
    )
    assert disk_behind(quiet, 3 * GIB) is not None  # a dump larger than the threshold itself
    # The node's own state reads as numbers the kernel gave (its threshold is never 0).
    here = staging.disk_state()
    assert here.background > 0 and here.backlog >= 0 and here.dirtied_per_s >= 0


def test_leave_running_dump_is_staged_in_memory_while_the_disk_is_behind(
    make_daemon: MakeDaemon, disk_dir: Path
) -> None:
    d: Daemon = make_daemon()  # default settings: stage_dir = "auto"
    stage = Path(staging.stage_root(staging.AUTO, d.state_dir))
    job = d.run(*workload("memhold.py", 32))
    wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
    with disk_writer(disk_dir):
        cp = while_behind(
            lambda: d.json("dump", "--leave-running", job["job"]), lambda cp: bool(cp["staged"])
        )
        assert cp["staged"] is True, cp
        assert cp["notes"] == []
        # In memory: the daemon's own tmpfs, root's only; nothing left there once published.
        assert _mount_type(stage) == "tmpfs"
        assert os.stat(staging.AUTO_ROOT).st_mode & 0o777 == 0o700
        assert list(stage.iterdir()) == []
        assert d.job(job["job"])["state"] == "running"
        d.cli("kill", job["job"])
        restored = d.json("restore", cp["checkpoint"])
        # A dump that stops the job still goes straight to the store, disk behind or not.
        stopped = d.json("dump", restored["job"])
    assert stopped["staged"] is False
    again = d.json("restore", stopped["checkpoint"])
    os.kill(workload_pid(again["pid"]), signal.SIGUSR1)
    wait_for(lambda: len(_digest(d, again["job"])) == 2, what="digest")
    assert len(set(_digest(d, again["job"]))) == 1  # the memory came back whole, twice over
    d.cli("kill", again["job"])


def test_staging_while_the_disk_is_behind_falls_back_when_memory_is_short(
    make_daemon: MakeDaemon, disk_dir: Path
) -> None:
    d: Daemon = make_daemon()
    stage = Path(staging.stage_root(staging.AUTO, d.state_dir))
    stage.mkdir(mode=0o700, parents=True, exist_ok=True)
    # This daemon's part of the stage holds 4 MiB: too little for the job's 32.
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=700", "tmpfs", str(stage)], check=True
    )
    try:
        job = d.run(*workload("memhold.py", 32))
        wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
        with disk_writer(disk_dir):
            result = while_behind(
                lambda: d.cli("dump", "--leave-running", job["job"]),
                lambda r: "not staged in memory" in r.stderr,
            )
        # Said, not silent: why the job stayed frozen longer, and what it waited on.
        assert re.search(
            r"^note: not staged in memory \(the stage directory .* has \d+ MiB "
            r"free, the dump needs about \d+ MiB\): the job stayed frozen while "
            r"its images went to the store, which waited on the disk \(.+\)$",
            result.stderr,
            re.M,
        ), result.stderr
        assert list(stage.iterdir()) == []  # nothing of it was staged
        checkpoint = re.search(r"^checkpoint (\S+) \(", result.stdout, re.M)
        assert checkpoint is not None
        d.cli("kill", job["job"])
        restored = d.json("restore", checkpoint[1])
        os.kill(workload_pid(restored["pid"]), signal.SIGUSR1)
        wait_for(lambda: len(_digest(d, restored["job"])) == 2, what="digest")
        assert len(set(_digest(d, restored["job"]))) == 1
        d.cli("kill", restored["job"])
    finally:
        subprocess.run(["umount", str(stage)], check=True)


def test_the_stage_is_mounted_once_and_only_on_roots_directory(
    disk_dir: Path, test_user: pwd.struct_passwd
) -> None:
    tmp_path = disk_dir
    root = tmp_path / "stage"
    answers: list[str | None] = []
    starts = [
        threading.Thread(target=lambda: answers.append(staging.ensure_auto_root(root)))
        for _ in range(4)
    ]
    try:
        for t in starts:
            t.start()
        for t in starts:
            t.join()
        assert answers == [None] * 4
        # Daemons starting at once: one tmpfs, not one hiding another's staged images.
        mounts = [
            line
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4] == str(root)
        ]
        assert len(mounts) == 1 and _mount_type(root) == "tmpfs"
        assert os.stat(root).st_mode & 0o777 == 0o700
    finally:
        subprocess.run(["umount", str(root)], check=False)
    # A directory someone else made there is not staged in (root would write into it).
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, test_user.pw_uid, test_user.pw_gid)
    assert staging.ensure_auto_root(theirs) == (
        f"{theirs} is not a directory owned by root: dumps are not staged in memory "
        "(remove it and restart the daemon)"
    )
    assert _mount_type(theirs) != "tmpfs"
