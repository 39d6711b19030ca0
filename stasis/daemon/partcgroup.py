"""The freezer cgroup of a job part (issue 31): each job the daemon runs or restores in a job
network (stasis/daemon/jobnet.py) has one of its own, `stasis-part-<job id>` at the root of the
freezer hierarchy (cgroup v1's freezer where the node has it, else cgroup v2's), holding its
tree alone, so that a coordinator can freeze every part of a job on every node before any is
dumped (stasis/daemon/partfreeze.py), and CRIU dumps the frozen cgroup as it is
(DumpOptions.freeze_cgroup).

Stdlib only: the job's supervisor imports it before its job arrives.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_V1 = Path("/sys/fs/cgroup/freezer")
PREFIX = "stasis-part-"


def root() -> Path:
    """The freezer hierarchy's root on this node."""
    return _V1 if _V1.is_dir() else Path("/sys/fs/cgroup")


def _v1() -> bool:
    return root() == _V1


def path_for(job_id: str) -> Path:
    return root() / f"{PREFIX}{job_id}"


def make(job_id: str) -> Path:
    """The job's cgroup, made (empty) if it is not there."""
    path = path_for(job_id)
    path.mkdir(mode=0o755, exist_ok=True)
    return path


def remove(path: Path, wait_s: float = 2.0) -> None:
    """Remove the cgroup once its tasks are gone (a dead tree leaves it a moment later);
    left in place if they are not within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)


def join(path: Path) -> None:
    """Move the calling process into the cgroup `path` (its threads with it)."""
    (path / "cgroup.procs").write_text("0")


def of(pid: int) -> Path | None:
    """The freezer cgroup `pid` is in, when it is a job part's; None otherwise (or gone)."""
    path = current(pid)
    if path is None or not path.name.startswith(PREFIX) or path.parent != root():
        return None
    return path


def current(pid: int) -> Path | None:
    """The freezer cgroup `pid` is in, as a directory of this node (None: gone, or not
    visible here)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = _v1()
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if (v1 and "freezer" in controllers.split(",")) or (not v1 and controllers == ""):
            if where.startswith("/.."):
                return None
            return root() / where.lstrip("/") if where != "/" else root()
    return None


def set_frozen(path: Path, frozen: bool) -> None:
    if _v1():
        (path / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
    else:
        (path / "cgroup.freeze").write_text("1" if frozen else "0")


def is_frozen(path: Path) -> bool:
    try:
        if _v1():
            return (path / "freezer.state").read_text().strip() == "FROZEN"
        return "frozen 1" in (path / "cgroup.events").read_text()
    except FileNotFoundError:
        return False


def freeze(path: Path, timeout_s: float = 10.0) -> bool:
    """Freeze the cgroup; whether it is wholly frozen within `timeout_s` (a task in an
    uninterruptible sleep keeps it FREEZING)."""
    set_frozen(path, True)
    deadline = time.monotonic() + timeout_s
    while not is_frozen(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def tasks(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def exists(path: Path) -> bool:
    return os.path.isdir(path)
