"""Files replaced whole: whoever reads one (a daemon started after a crash included) finds the
old content or the new, never part of either. The new content goes to a temporary name made
with O_EXCL and O_NOFOLLOW (a link planted there is never written through), then is renamed
over the old file; durable writes also reach the disk (the file and its directory fsynced)
before the call returns, for records a node's crash must not take back."""

from __future__ import annotations

import os
import secrets
from contextlib import suppress
from pathlib import Path


def write_atomically(path: Path, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """A rename or a new name in `path` survives a crash only once the directory is synced."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_once(path: Path, data: bytes, *, mode: int = 0o600) -> bool:
    """Give `path` the content `data` unless it already has a content of its own; durable.
    A link, not a rename, publishes it: of two processes creating it at once (two nodes
    starting one store, two daemons starting), the first one's stands for both. Whether this
    call made it."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
            made = True
        except FileExistsError:
            made = False
    finally:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(path.parent)
    return made
