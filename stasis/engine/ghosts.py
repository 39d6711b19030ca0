"""The ghost files a failed restore leaves behind, and their removal.

A file the job had deleted but held open travels in its images as a ghost: CRIU's restore
recreates it beside its old path (`PATH.cr.ID.ghost`: engine/sandbox.ghost_files) for the
tasks to reopen, and removes it before the tree resumes, or when it fails by itself. Killed
instead (a restore refused at its gate, a daemon that died mid-restore: the supervisor kills its
whole tree), it removes nothing, and each ghost left on the node fails the job's next restore
("Can't create ghost regfile: File exists"; that CRIU removes it as it fails).

`Ghosts` is taken before CRIU runs, by the process CRIU runs under (the job's supervisor: the
same mount namespace); after a failed restore whose CRIU is dead, `remove_left` removes those
that were not there before it (those are not this restore's), in the directory that was
there then, as root but never through a link: the job's user may write their directories. Names are logged quoted (JSON): the user
chose them, and the supervisor's stderr is the daemon's log. Ghosts in a job's private /tmp and /var/tmp
(engine/privatetmp.py) went with its mount namespace, and the node's files of those names are
none of ours.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

from stasis.engine import privatetmp, sandbox
from stasis.fdio import descend

log = logging.getLogger("stasis.engine")


class Ghosts:
    def __init__(self, images: Path, private_tmp: bool, checkpoint: str) -> None:
        self._checkpoint = checkpoint
        try:
            names = sandbox.ghost_files(images)
        except (OSError, ValueError) as e:
            # Damaged (in place: the gate refuses them): a failed restore leaves what it made.
            log.warning("checkpoint %s: its ghost files cannot be listed: %s", checkpoint, e)
            names = {}
        # Each name not there now, with its directory as it is now (device, inode): a
        # directory swapped for another meanwhile (the job's user may rename theirs) is not
        # where this restore made it, and nothing is removed there.
        self._left: dict[str, tuple[int, int]] = {}
        for name in sorted(names):
            if "\0" in name or (
                private_tmp and any(name.startswith(d + "/") for d in privatetmp.MOUNTS)
            ):
                continue
            where = _directory(name)
            if where is not None:
                self._left[name] = where

    def remove_left(self) -> list[str]:
        """Once the failed restore's CRIU is dead (nothing makes a ghost after this): the
        ghosts it left, removed. Returns their names."""
        removed = [
            name for name, where in self._left.items() if _remove(name, where, self._checkpoint)
        ]
        if removed:
            log.warning(
                "the failed restore of checkpoint %s left ghost files (CRIU killed before it "
                "removed them), removed: %s",
                self._checkpoint,
                ", ".join(json.dumps(name) for name in removed),
            )
        return removed


def _open_dir(path: str) -> int:
    """An O_DIRECTORY descriptor of `path`, reached from / one component at a time, never
    through a symbolic link (ELOOP, or ENOTDIR, where one stands)."""

    def step(fd: int, part: str) -> int:
        return os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)

    parts = [part for part in path.split("/") if part]
    return descend(os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), parts, step)


def _directory(path: str) -> tuple[int, int] | None:
    """The (device, inode) of the directory `path` would be made in, where nothing stands at
    `path` yet; None where something does (not this restore's: never removed) or where its
    directory cannot be reached without a link."""
    parent, name = os.path.split(path)
    try:
        fd = _open_dir(parent)
    except OSError:
        return None
    try:
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
            return None
        except FileNotFoundError:
            st = os.fstat(fd)
            return st.st_dev, st.st_ino
        except OSError:
            return None  # there, whatever it is: left alone
    finally:
        os.close(fd)


def _remove(path: str, where: tuple[int, int], checkpoint: str) -> bool:
    """Unlinks the regular file at `path`, reached without a link, in the directory `where`
    (device, inode); True if it did."""
    parent, name = os.path.split(path)
    try:
        fd = _open_dir(parent)
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning(
            "left %s alone (a ghost file of the failed restore of checkpoint %s): its directory "
            "cannot be opened without following a link: %s",
            json.dumps(path),
            checkpoint,
            e.strerror,
        )
        return False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != where:
            log.warning(
                "left %s alone (a ghost file of the failed restore of checkpoint %s): its "
                "directory is not the one the restore began with",
                json.dumps(path),
                checkpoint,
            )
            return False
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            log.warning(
                "left %s alone (where the failed restore of checkpoint %s made a ghost file): "
                "it is not a regular file",
                json.dumps(path),
                checkpoint,
            )
            return False
        os.unlink(name, dir_fd=fd)  # the name only, whatever stands there now: never a target
        return True
    except FileNotFoundError:
        return False  # CRIU removed it: it failed by itself, or never made it
    except OSError as e:
        log.warning(
            "cannot remove %s, a ghost file the failed restore of checkpoint %s left: %s",
            json.dumps(path),
            checkpoint,
            e.strerror,
        )
        return False
    finally:
        os.close(fd)
