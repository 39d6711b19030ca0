"""CRIU's kernel-probe cache: the daemon gives our CRIU's RUNDIR a root-only tmpfs, CRIU writes
its cache there and the next CRIU loads it; a .tmp left by a killed CRIU is cleared."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from stasis.engine import kdat
from tests.conftest import Daemon, workload


def test_a_stale_tmp_is_removed_and_a_fresh_one_kept(tmp_path: Path) -> None:
    cache = tmp_path / "criu.kdat"
    tmp = tmp_path / "criu.kdat.tmp"
    assert kdat.clear_stale_tmp(cache) is False  # nothing there
    tmp.write_bytes(b"")
    assert kdat.clear_stale_tmp(cache) is False  # a CRIU may be writing it now
    assert tmp.exists()
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    assert kdat.clear_stale_tmp(cache) is True
    assert not tmp.exists()


def _mounts_on(path: Path) -> int:
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return sum(1 for line in lines if line.split()[4] == str(path))


def test_the_cache_dir_becomes_a_root_only_tmpfs_once(tmp_path: Path) -> None:
    run = tmp_path / "stasis-criu"
    # Where the test's tmp dir is already a tmpfs (as /run is under systemd), nothing is mounted.
    mounts = 0 if kdat.cache_note(tmp_path) is None else 1
    try:
        assert kdat.ensure_cache_dir(run) is None
        assert kdat.cache_note(run) is None
        assert _mounts_on(run) == mounts
        assert os.stat(run).st_mode & 0o777 == 0o700
        assert kdat.ensure_cache_dir(run) is None  # a restarted daemon mounts nothing more
        assert _mounts_on(run) == mounts
    finally:
        while _mounts_on(run):
            subprocess.run(["umount", str(run)], check=True)


def test_a_cache_dir_made_by_someone_else_is_left_alone(tmp_path: Path) -> None:
    run = tmp_path / "stasis-criu"
    run.mkdir()
    os.chown(run, 65534, 65534)
    problem = kdat.ensure_cache_dir(run)
    assert problem is not None and "not a directory owned by root" in problem
    assert _mounts_on(run) == 0


def test_criu_keeps_its_probes_where_the_daemon_made_room(daemon: Daemon) -> None:
    # The daemon fixture ran ensure_cache_dir on the real path our CRIU was built with.
    assert kdat.cache_note() is None
    kdat.CACHE.unlink(missing_ok=True)
    job = daemon.run(*workload("counter.py"))
    daemon.json("dump", "--leave-running", job["job"])
    assert kdat.CACHE.exists(), "CRIU did not write its cache: is it built with this RUNDIR?"
    daemon.json("dump", "--leave-running", job["job"])
    logs = sorted((daemon.state_dir / "criu-logs").glob("*.log"), key=lambda p: p.stat().st_mtime)
    assert f"Loaded kdat cache from {kdat.CACHE}" in logs[-1].read_text()
    daemon.cli("kill", job["job"])
