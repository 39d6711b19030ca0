"""CRIU's cache of what it probed about the kernel (criu.kdat), kept usable.

Without the cache every CRIU process probes the kernel again (network namespaces, vDSO, pagemap):
~50-60 ms of each dump and restore on these machines, twice for a lazy restore (the lazy-pages
daemon, then the restore). CRIU keeps the cache only on a tmpfs (it must vanish with a reboot), in
the RUNDIR it was built with. Ours is built with RUNDIR=/run/stasis-criu (scripts/install-criu.sh)
rather than /run, which is not a tmpfs on some machines; the daemon makes that directory a
root-only tmpfs when it starts.

CRIU writes the cache through criu.kdat.tmp opened with O_EXCL: a CRIU killed between that open
and its rename (we kill restores whose images fail verification) leaves the .tmp behind, and no
CRIU writes the cache again until the next reboot, so the daemon clears a stale one.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from stasis.engine import tmpfs

CACHE_DIR = Path("/run/stasis-criu")  # the RUNDIR of scripts/install-criu.sh
CACHE = CACHE_DIR / "criu.kdat"
# CRIU writes a few hundred bytes and renames at once: a .tmp older than this was left behind.
_STALE_S = 60.0


def cache_note(cache_dir: Path = CACHE_DIR) -> str | None:
    """Why CRIU cannot cache its kernel probes here, or None when it can."""
    if not _is_tmpfs(cache_dir):
        return (
            f"{cache_dir} is not a tmpfs: CRIU cannot cache its kernel probes "
            f"({CACHE.name}) and redoes them in every dump and restore (~50 ms each); "
            f"the stasis daemon mounts one there when it starts"
        )
    return None


def ensure_cache_dir(cache_dir: Path = CACHE_DIR) -> str | None:
    """Make cache_dir a root-only tmpfs so that CRIU keeps its probes; say why not, or None.

    A tmpfs mounted here outlives the daemon on purpose: like CRIU's own cache in /run, it
    lasts until the next reboot, which is when the kernel can change.
    """
    try:
        cache_dir.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as e:
        return f"cannot create {cache_dir} for CRIU's probe cache: {e.strerror}"
    st = os.lstat(cache_dir)
    # CRIU (root) trusts what it reads there: anything not made by root is left alone.
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
        return (
            f"{cache_dir} is not a directory owned by root: CRIU's probe cache is off "
            f"(remove it and restart the daemon)"
        )
    if _is_tmpfs(cache_dir):  # /run itself, say
        os.chmod(cache_dir, 0o700)
        return None
    why = tmpfs.mount_once(cache_dir, "stasis-criu", "1m")
    if why:
        return f"cannot mount a tmpfs on {cache_dir} for CRIU's probe cache: {why}"
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
    # A mount table that cannot be read: say nothing rather than something wrong.
    return tmpfs.fs_type(path) in ("tmpfs", None)
