"""Whether only root can change a local checkpoint's files: then CRIU may read them in place.

A restore must hand CRIU only bytes that were checked against the signed manifest. Where someone
other than root can write a checkpoint (a shared directory, a network filesystem other nodes
write), checking a file and then letting CRIU open it by path is not enough: it can change in
between. The store then streams or copies it (reader.py). But on a local filesystem where the
checkpoint's directory, every directory above it and its files belong to root and nobody else
may write them, nothing but root changes them between the check and CRIU's read, and root needs
no forgery. There CRIU reads the images in place while the daemon checks them (the restored tree
resumes only once they passed), as fast as before the images were hashed cryptographically.

Judged from what the kernel says, never from configuration: owners and modes along the whole
path (lstat: a link anywhere is refused), and the filesystem type of its mount
(/proc/self/mountinfo): network and FUSE filesystems are written by others whatever their modes
say here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

# Local filesystems whose owners and modes this kernel enforces itself.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "f2fs", "zfs"})


def only_root_writes(directory: Path, names: Iterable[str]) -> bool:
    """True when nobody but root (or this process's user) can change `directory` or the files
    `names` in it, nor swap the directory or any above it for another."""
    owners = {0, os.geteuid()}
    try:
        path = Path(os.path.abspath(directory))
        if _filesystem_type(path) not in LOCAL_FILESYSTEMS:
            return False
        for part in (path, *path.parents):
            st = os.lstat(part)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid not in owners:
                return False
            # A sticky directory (/tmp) lets nobody else rename or remove root's entries.
            if st.st_mode & 0o022 and not (part != path and st.st_mode & stat.S_ISVTX):
                return False
        for name in names:
            st = os.lstat(path / name)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in owners or st.st_mode & 0o022:
                return False
    except OSError:
        return False
    return True


def _filesystem_type(path: Path) -> str | None:
    """The type of the filesystem mounted where `path` is (the longest mount point above it)."""
    best, kind = -1, None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                point = _unescape(fields[4])
                after = line.split(" - ", 1)[1].split()
                if not after:
                    continue
                if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(
                    point
                ) >= best:
                    best, kind = len(point), after[0]
    except OSError:
        return None
    return kind


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)
