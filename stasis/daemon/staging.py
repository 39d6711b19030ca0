"""Where a dump's images go first: node-local memory when there is room, else the store.

A leave-running dump freezes the job only while its pages go to memory; making them durable
(fsync, upload, checksums, compression) happens after the job has resumed. By default "memory" is
the page cache of the store's own staging directory (CRIU does not fsync), which on the machines
measured was faster than tmpfs. A tmpfs stage (STASIS_STAGE_DIR) is for nodes whose local write
path is slower than memory (a store on NFS with a small page cache, writeback throttling).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from stasis.store import is_checkpoint_id

# Leave the node this much memory beyond the staged images, so staging never pushes jobs to OOM.
HEADROOM_BYTES = 512 << 20


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
        return None, (f"the stage directory {root} has {_mib(free)} free, the dump needs about "
                      f"{_mib(need)}")
    available = mem_available()
    if available < need + HEADROOM_BYTES:
        return None, (f"the node has {_mib(available)} of memory available, the dump needs "
                      f"about {_mib(need)} plus {_mib(HEADROOM_BYTES)} to spare")
    path = base / checkpoint_id
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700)
    return path, None


def _mib(n: int) -> str:
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
