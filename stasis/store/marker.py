"""A local store's marker, and the node's memory of the stores it has used (issue 28).

A local or shared directory store (an NFS or Lustre mount, most often) that is not mounted is an
empty directory, or none: listed as it is, it has no checkpoints, and a job that should resume
starts from the beginning instead, while retention later deletes what it should have resumed
from. "Cannot tell" must never read as "no checkpoint". So:

    <root>/.stasis-store        "stasis-store <32 hex digits>\\n": the store's id, written once,
                                atomically, when the store is initialised (its first publish,
                                or the first look at a store that holds checkpoints from before
                                markers)
    <state_dir>/stores/<hash>   {"path": ..., "store_id": ...}: a store this node has seen, by
                                the path it is configured under (root's, like the state dir)

A store this node has seen that now lacks its marker (its directory missing, or an empty mount
point) is unavailable: every read and write of it fails with a StoreError, which the Slurm and
Kubernetes start paths treat as "cannot tell" (held, container not started). Nothing creates the
directory again but a publish into a store this node never knew. To start a store anew on
purpose (emptied or moved by its administrator), remove the node's memory of it: the file the
error names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
from pathlib import Path

from stasis.atomicfile import create_once, write_atomically
from stasis.errors import StoreError

log = logging.getLogger("stasis.store")

MARKER_NAME = ".stasis-store"
_MARKER_RE = re.compile(rb"^stasis-store ([0-9a-f]{32})\n?$")
# A marker, or a memory entry, is a line: anything longer is not ours.
_MAX_BYTES = 4096


def new_store_id() -> str:
    return secrets.token_hex(16)


def read_marker(root: Path) -> str | None:
    """The id in `root`'s marker; None when there is none (or no `root`); StoreError when there
    is something else in its place."""
    try:
        fd = os.open(root / MARKER_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise StoreError(
            f"cannot read the marker {root / MARKER_NAME} of the checkpoint store: "
            f"{e.strerror or e}"
        ) from e
    try:
        data = os.read(fd, _MAX_BYTES)
    finally:
        os.close(fd)
    found = _MARKER_RE.match(data)
    if found is None:
        raise StoreError(
            f"the marker {root / MARKER_NAME} of the checkpoint store is not one "
            f"stasis wrote: check the store, and remove that file if it is not"
        )
    return found.group(1).decode()


def write_marker(root: Path) -> str:
    """Give `root` a marker (atomically: a reader sees none or a whole one), unless another
    process just did; return the id the store has now."""
    create_once(root / MARKER_NAME, f"stasis-store {new_store_id()}\n".encode(), mode=0o644)
    found = read_marker(root)
    if found is None:
        raise StoreError(f"the marker {root / MARKER_NAME} vanished as it was written")
    return found


class KnownStores:
    """The stores this node has seen, one small root-owned file each under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def entry(self, root: Path) -> Path:
        digest = hashlib.sha256(os.fsencode(str(root))).hexdigest()[:32]
        return self.directory / digest

    def get(self, root: Path) -> str | None:
        """The id this node last saw at `root`; None when it never saw a store there (or its
        memory of it is unreadable: then it is as on a node that never used it)."""
        path = self.entry(root)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("cannot read %s, what this node knows of the store %s: %s", path, root, e)
            return None
        try:
            data = json.loads(os.read(fd, _MAX_BYTES))
        except ValueError as e:
            log.warning("%s is garbage (%s): this node forgets the store %s", path, e, root)
            return None
        finally:
            os.close(fd)
        if (
            not isinstance(data, dict)
            or data.get("path") != str(root)
            or not isinstance(data.get("store_id"), str)
        ):
            return None
        store_id: str = data["store_id"]
        return store_id

    def remember(self, root: Path, store_id: str) -> None:
        """Record `store_id` at `root`; a failure is logged: the store still works, this node
        only cannot tell later that it went missing."""
        path = self.entry(root)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomically(path, json.dumps({"path": str(root), "store_id": store_id}).encode())
        except OSError as e:
            log.warning(
                "cannot record at %s that this node uses the store %s (%s): if it "
                "goes missing later, this node cannot tell it from an empty one",
                path,
                root,
                e,
            )
