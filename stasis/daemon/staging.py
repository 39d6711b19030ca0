"""Where a dump's images go first: node-local memory when there is room, else the store.

A leave-running dump freezes the job only while its pages go to memory; making them durable
(fsync, upload, checksums, compression) happens after the job has resumed. "Memory" is the page
cache of the store's own staging directory (CRIU does not fsync) while the node's disk keeps up:
there CRIU writes as fast as to a tmpfs, and the images need no second copy. When the disk is
behind (a writer filling the page cache, writeback under way, or this dump's images would push
the page cache past the kernel's background threshold) page-cache writes wait on the disk
(writeback throttling, the filesystem's journal) with the job frozen: the images then go to a
tmpfs the daemon owns (`AUTO_ROOT`), within the memory headroom below. Measured (bench/freeze.py,
1 GiB, bench/results/20261206T084758Z-freeze.md): quiet, the job was frozen 0.51 s through the
page cache and 0.60 s through a tmpfs, and the whole dump took 1.3 s against 3.4 s (the copy out
of memory); beside a disk writer, 2.06 s through the page cache and 0.65 s staged in memory
(`criu dump` to a tmpfs: 0.58 and 0.91 s). STASIS_STAGE_DIR names a tmpfs to stage every
leave-running dump in instead, or "" for never.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import time
from pathlib import Path
from typing import NamedTuple

from stasis.engine import tmpfs
from stasis.store import is_checkpoint_id

# Leave the node this much memory beyond the staged images, so staging never pushes jobs to OOM.
HEADROOM_BYTES = 512 << 20


# stage_dir's default: stage in AUTO_ROOT, and only when the disk is behind (`disk_behind`).
AUTO = "auto"
# A tmpfs the daemon mounts (root-only), like CRIU's probe cache beside it (engine/kdat.py); each
# daemon stages under a directory of its own there (`stage_root`).
AUTO_ROOT = Path("/run/stasis-stage")
# How long the node's write rate is sampled before a dump (before CRIU freezes anything).
SAMPLE_S = 0.05
# A node dirtying or writing back pages faster than this has a writer beside the job: writeback
# runs, or soon will, while CRIU writes (a node's logs and results write far less).
BUSY_BYTES_PER_S = 32 << 20
# How long CRIU writes `expected` bytes, generously (~1 GB/s measured, plus its start): what
# others dirty meanwhile counts towards the threshold too.
_WRITE_BYTES_PER_S = 1 << 30
_WRITE_START_S = 0.5


def stage_root(setting: str, state_dir: Path) -> str:
    """The directory leave-running dumps are staged under for the stage_dir `setting` ("" for
    none). AUTO: a directory of this daemon's own (by its state directory) in AUTO_ROOT, so
    that a daemon clearing its leftovers at start never takes another daemon's."""
    if setting != AUTO:
        return setting
    return str(AUTO_ROOT / hashlib.sha256(str(state_dir).encode()).hexdigest()[:16])


def ensure_auto_root(root: Path = AUTO_ROOT) -> str | None:
    """Make `root` a root-only tmpfs for staging; say why not, or None. It outlives the daemon
    (empty, it holds no memory), like CRIU's probe cache."""
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(root)
    except OSError as e:
        return f"cannot create {root} to stage dumps in memory: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
        return (
            f"{root} is not a directory owned by root: dumps are not staged in memory "
            f"(remove it and restart the daemon)"
        )
    why = tmpfs.mount_once(root, "stasis-stage", "100%")
    if why:
        return f"cannot mount a tmpfs on {root} to stage dumps in memory: {why}"
    return None


class DiskState(NamedTuple):
    """The node's page cache against the kernel's writeback thresholds (/proc/vmstat), bytes."""

    backlog: int  # dirty + under writeback
    background: int  # nr_dirty_background_threshold: writeback starts beyond it
    dirtied_per_s: float
    written_per_s: float


def _vmstat() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key in (
            "nr_dirty",
            "nr_writeback",
            "nr_dirty_background_threshold",
            "nr_dirtied",
            "nr_written",
        ):
            out[key] = int(value)
    return out


def disk_state(sample_s: float = SAMPLE_S) -> DiskState:
    page = os.sysconf("SC_PAGE_SIZE")
    first, t0 = _vmstat(), time.monotonic()
    time.sleep(sample_s)
    last, dt = _vmstat(), max(time.monotonic() - t0, 1e-3)
    return DiskState(
        backlog=(last.get("nr_dirty", 0) + last.get("nr_writeback", 0)) * page,
        background=last.get("nr_dirty_background_threshold", 0) * page,
        dirtied_per_s=(last.get("nr_dirtied", 0) - first.get("nr_dirtied", 0)) * page / dt,
        written_per_s=(last.get("nr_written", 0) - first.get("nr_written", 0)) * page / dt,
    )


def disk_behind(state: DiskState, expected_bytes: int) -> str | None:
    """Why writing `expected_bytes` through the page cache now would wait on the disk, or None
    when it would not (the page cache stays under the background threshold, nobody writes)."""
    if state.dirtied_per_s > BUSY_BYTES_PER_S or state.written_per_s > BUSY_BYTES_PER_S:
        return (
            f"the node is writing {_mib(max(state.dirtied_per_s, state.written_per_s))}/s "
            f"to disk"
        )
    writing_s = _WRITE_START_S + expected_bytes / _WRITE_BYTES_PER_S
    after = state.backlog + expected_bytes + state.dirtied_per_s * writing_s
    if state.background and after > state.background:
        return (
            f"{_mib(state.backlog)} wait to be written to disk, and the dump's "
            f"{_mib(expected_bytes)} would take that past the kernel's writeback threshold "
            f"({_mib(state.background)})"
        )
    return None


def choose(
    setting: str, state_dir: Path, checkpoint_id: str, expected_bytes: int
) -> tuple[Path | None, str | None, str | None]:
    """Where a leave-running dump's images go: (the memory stage or None for the store, why
    the disk was passed by, why memory was refused). `setting` is stage_dir: AUTO stages only
    when `disk_behind` says so; a directory stages always; "" never."""
    behind = None
    if setting == AUTO:
        behind = disk_behind(disk_state(), expected_bytes)
        if behind is None:
            return None, None, None
        # Checked each time: staged anywhere but in that tmpfs, the images would go to disk.
        unusable = ensure_auto_root()
        if unusable:
            return None, behind, unusable
    fast, refused = stage(stage_root(setting, state_dir), checkpoint_id, expected_bytes)
    return fast, behind, refused


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def fast_dir(root: str, checkpoint_id: str, expected_bytes: int) -> Path | None:
    """A fresh root-only directory under `root` for about `expected_bytes` of images, or None
    when staging is off or the node lacks the memory or tmpfs space for it (dump directly)."""
    return stage(root, checkpoint_id, expected_bytes)[0]


def stage(root: str, checkpoint_id: str, expected_bytes: int) -> tuple[Path | None, str | None]:
    """`fast_dir`, and why there is none when staging is on (None when it is off or there is
    one): the caller tells the user that the dump went to the store directly."""
    if not root:
        return None, None
    base = Path(root)
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(base, 0o700)
        fs = os.statvfs(base)
    except OSError as e:
        return None, f"cannot use the stage directory {root}: {e.strerror or e}"
    need = int(expected_bytes * 1.1) + (16 << 20)
    free = fs.f_bavail * fs.f_frsize
    if free < need:
        return None, (
            f"the stage directory {root} has {_mib(free)} free, the dump needs about "
            f"{_mib(need)}"
        )
    available = mem_available()
    if available < need + HEADROOM_BYTES:
        return None, (
            f"the node has {_mib(available)} of memory available, the dump needs "
            f"about {_mib(need)} plus {_mib(HEADROOM_BYTES)} to spare"
        )
    path = base / checkpoint_id
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700)
    return path, None


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def remove_leftovers(root: str) -> list[str]:
    """Remove what dumps staged under `root` and never published (the daemon died meanwhile):
    node memory that nothing frees otherwise. The stage is this node's own, and no dump runs
    before the daemon does, so everything there is a leftover."""
    if not root:
        return []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    # Only what fast_dir makes: a stage dir set to a shared place (/tmp, say) loses nothing else.
    ours = [e for e in entries if is_checkpoint_id(e.name) and e.is_dir(follow_symlinks=False)]
    for entry in ours:
        shutil.rmtree(entry.path, ignore_errors=True)
    return [e.name for e in ours]
