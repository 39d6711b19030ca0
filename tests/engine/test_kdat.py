"""CRIU's kernel-probe cache: a .tmp left by a killed CRIU is cleared; a /run that cannot hold
the cache is reported by `stasis check`."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from stasis.engine import kdat


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


def test_only_a_tmpfs_can_hold_the_cache(tmp_path: Path) -> None:
    mnt = tmp_path / "run"
    mnt.mkdir()
    assert kdat.cache_note(mnt) is not None  # the test's tmp dir is on the disk
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        assert kdat.cache_note(mnt) is None
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
