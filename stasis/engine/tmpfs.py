"""Root-only tmpfs directories the daemon keeps (CRIU's probe cache, the memory stage): what
file system a path is on, and mounting one."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path


def fs_type(path: Path) -> str | None:
    """The type of the file system `path` is on ("tmpfs", "ext4", ...); None when the mount
    table cannot be read. os.statvfs has no f_type; /proc/self/mountinfo names each mount
    point's."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
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
    return fstype


def mount(path: Path, name: str, size: str) -> str | None:
    """Mount a root-only tmpfs (`name`, at most `size`) on `path`; the mount's own last words
    when it fails, else None."""
    done = subprocess.run(
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size={size},mode=0700,nosuid,nodev,noexec",
            name,
            str(path),
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["mount failed"])[-1]
    return None


def mount_once(path: Path, name: str, size: str) -> str | None:
    """`path` (a directory root owns) a root-only tmpfs: mounted unless it is one already; the
    mount's last words when it fails, else None. Two daemons starting at once would stack two
    mounts, the second hiding what the first put there: one checks and mounts at a time (a lock
    on the directory, the one under the mount until it is mounted; a daemon that opens it after
    that finds the tmpfs)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return f"cannot open it ({e.strerror or e})"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if fs_type(path) == "tmpfs":
            os.chmod(path, 0o700)
            return None
        return mount(path, name, size)
    finally:
        os.close(fd)
