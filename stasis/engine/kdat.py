"""CRIU's cache of what it probed about the kernel (/run/criu.kdat), kept usable.

Without the cache every CRIU process probes the kernel again (network namespaces, vDSO, pagemap):
~50-60 ms of each dump and restore on these machines, twice for a lazy restore (the lazy-pages
daemon, then the restore). CRIU keeps the cache only on a tmpfs /run, and writes it through
/run/criu.kdat.tmp opened with O_EXCL: a CRIU killed between that open and its rename (we kill
restores whose images fail verification) leaves the .tmp behind, and no CRIU writes the cache
again until the next reboot.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CACHE = Path("/run/criu.kdat")
TMPFS_MAGIC = 0x01021994
# CRIU writes a few hundred bytes and renames at once: a .tmp older than this was left behind.
_STALE_S = 60.0


def cache_note(run_dir: Path = CACHE.parent) -> str | None:
    """Why CRIU cannot cache its kernel probes here, or None when it can."""
    if not _is_tmpfs(run_dir):
        return (f"{run_dir} is not a tmpfs: CRIU cannot cache its kernel probes "
                f"({CACHE.name}) and redoes them in every dump and restore (~50 ms each)")
    return None


def clear_stale_tmp(cache: Path = CACHE, now: float | None = None) -> bool:
    """Remove a .tmp that a killed CRIU left behind, so the next CRIU writes the cache."""
    tmp = cache.with_name(cache.name + ".tmp")
    try:
        age = (time.time() if now is None else now) - tmp.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < _STALE_S:
        return False  # a CRIU may be writing it right now
    try:
        tmp.unlink()
    except FileNotFoundError:
        return False
    return True


def _is_tmpfs(path: Path) -> bool:
    # os.statvfs has no f_type; /proc/self/mountinfo names the filesystem of each mount point.
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return True  # cannot tell: say nothing rather than something wrong
    best, fstype = "", ""
    target = os.path.realpath(path)
    for line in mounts:
        fields = line.split()
        try:
            sep = fields.index("-")
        except ValueError:
            continue
        mount_point = fields[4].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, fstype = mount_point, fields[sep + 1]
    return fstype == "tmpfs"
