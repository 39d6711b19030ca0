"""The store on a local (or mounted shared) directory, with plain os calls.

Layout, all owned by root because images restore credentials as root:

    <root>/                     0755; refused when writable by anyone but its owner
    <root>/.staging/            0700; CRIU dumps into <id>/, compressed output goes to <id>.publish/
    <root>/<id>/                0700; image files 0600 and manifest.json

<root>/.stasis-store       the store's id (marker.py): a store this node used that lacks it is
                            unavailable (an unmounted mount point), never empty

Staging inside the root keeps publishing a rename on one filesystem: an uncompressed dump is never
copied. An uncompressed encrypted one is sealed in place (each chunk overwritten by its
ciphertext, as long: tailhash.InPlaceOutput) and its files renamed to their stored names; a
compressed one is written into <id>.publish/, and its plain staged files are removed once the
checkpoint is published or has failed. A checkpoint appears at <root>/<id> in a single rename of a directory that already holds
its manifest, so readers never see a checkpoint without one.

A checkpoint is listed only once it is durable: every image file is fsynced (in parallel) before
the manifest is written, then the manifest, the directory and the root. CRIU itself never fsyncs,
so its dump lands in the page cache fast; for a leave-running dump the flush happens after the job
has resumed, and costs it nothing.
"""

from __future__ import annotations

import io
import logging
import os
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from pathlib import Path
from typing import BinaryIO

from stasis.atomicfile import fsync_dir, write_atomically
from stasis.errors import StoreError
from stasis.store._tree import (
    MAX_MANIFEST_BYTES,
    Following,
    Publication,
    in_parallel,
    manifest_bytes,
    staged_names,
)
from stasis.store.compression import Reader, Writer, cpu_workers, stored_name
from stasis.store.index import FORMAT, FORMAT_FILE, INDEX_DIR, Entry, parse_entry, parse_uid
from stasis.store.manifest import MANIFEST_NAME, Manifest, is_checkpoint_id
from stasis.store.marker import MARKER_NAME, KnownStores, read_marker, write_marker
from stasis.store.tailhash import InPlaceOutput, TailHasher, local_opener

STAGING_NAME = ".staging"
_PUBLISH_SUFFIX = ".publish"

log = logging.getLogger("stasis.store")


class LocalTree:
    """`known`: where this node remembers the stores it has used (marker.py); None (a store
    opened on its own, in tests and tools) remembers nothing, so cannot tell a store gone
    missing from one never there. `expected`: the id the store must have (the site's config
    says it, for nodes that never used the store); "" for any."""

    def __init__(self, root: Path, known: KnownStores | None = None, expected: str = "") -> None:
        self.root = root
        self.where = str(root)
        self.read_workers = 1  # a local read is cheaper than a thread
        self._known = known
        self._expected = expected

    # -- the root ---------------------------------------------------------------------------

    def _check_root(self) -> bool:
        """True when the root exists and is safe to trust; StoreError when it exists and is not.
        Asked every time: what is mounted there may change under a running daemon."""
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            return False
        # Whoever can write the root can plant a checkpoint that root then restores.
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            raise StoreError(
                f"store directory {self.root} is writable by other users (mode "
                f"{st.st_mode & 0o7777:o}, owner uid {st.st_uid}): checkpoints restore as root, "
                f"so `chown root {self.root}` and `chmod 755 {self.root}`"
            )
        return True

    def _present(self) -> bool:
        """Whether a store is here: True when its marker is (given now to a store that holds
        checkpoints from before markers), False when nothing of a store is here and this node
        never used one here (an empty store, nothing to read). StoreError when this node used
        a store here and its marker is gone: an unmounted filesystem or a missing directory
        is "cannot tell", never "no checkpoints"."""
        exists = self._check_root()
        found = read_marker(self.root) if exists else None
        if self._expected and found != self._expected:
            # "Mounted?" early: callers cut this line short (a Slurm job's Comment).
            raise StoreError(
                f"checkpoint store {self.root} "
                + (
                    "is missing"
                    if not exists
                    else f"has no marker {MARKER_NAME}"
                    if found is None
                    else f"is store {found}"
                )
                + f": is its filesystem mounted? The config's store_id says it is store "
                f"{self._expected}"
            )
        if found is not None:
            self._remember(found)
            return True
        known = self._known.get(self.root) if self._known is not None else None
        if known is not None:
            assert self._known is not None
            raise StoreError(
                f"checkpoint store {self.root} "
                + ("is missing" if not exists else f"has no marker {MARKER_NAME}")
                + f": is its filesystem mounted? This node used it (store {known}) and does "
                f"not take its checkpoints for gone; if it was emptied or moved on purpose, "
                f"`rm {self._known.entry(self.root)}` lets stasis start it anew"
            )
        if not exists or not self._holds_checkpoints():
            return False
        # Written by a stasis from before markers: it is a store, mark it as one.
        try:
            found = write_marker(self.root)
        except OSError as e:
            log.warning(
                "cannot mark the checkpoint store %s as one (%s): if it goes missing "
                "later, it reads as empty",
                self.root,
                e,
            )
            return True
        log.info("marked the checkpoint store %s (store %s)", self.root, found)
        self._remember(found)
        return True

    def _holds_checkpoints(self) -> bool:
        with os.scandir(self.root) as entries:
            return any(
                entry.name == INDEX_DIR or is_checkpoint_id(entry.name)
                for entry in entries
                if entry.is_dir(follow_symlinks=False)
            )

    def _remember(self, store_id: str) -> None:
        # Read each time, not cached: root may have removed it (to start a store anew).
        if self._known is None:
            return
        before = self._known.get(self.root)
        if before != store_id:
            if before is not None:
                log.warning(
                    "checkpoint store %s is store %s now, no longer store %s that this "
                    "node used there before",
                    self.root,
                    store_id,
                    before,
                )
            self._known.remember(self.root, store_id)

    def _ensure_root(self) -> None:
        """Make the root ready for writing: a store this node used must be there (else
        StoreError: never a new store on the disk under an unmounted mount point); nothing
        there, and this node never used one there: this write starts a new store."""
        if not self._present():
            if not self._check_root():
                self.root.mkdir(parents=True, exist_ok=True)
                self.root.chmod(0o755)
                self._check_root()
            found = write_marker(self.root)
            log.info("started the checkpoint store %s (store %s)", self.root, found)
            self._remember(found)
            # It holds no checkpoint: its label index is complete as it is.
            _private_dir(self._index())
            write_atomically(self._index() / FORMAT_FILE, FORMAT)
        _private_dir(self.root / STAGING_NAME)

    # -- reading ----------------------------------------------------------------------------

    def ids(self) -> list[str]:
        if not self._present():
            return []
        found = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) and is_checkpoint_id(entry.name):
                    found.append(entry.name)
        return found

    def read_manifest(self, checkpoint_id: str) -> bytes:
        try:
            with _open_read(self.root / checkpoint_id / MANIFEST_NAME) as f:
                return f.read(MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            self._present()  # no such checkpoint, or no store here that this node used
            raise

    def manifest_mtime(self, checkpoint_id: str) -> float:
        return os.lstat(self.root / checkpoint_id / MANIFEST_NAME).st_mtime

    def exists(self, checkpoint_id: str) -> bool:
        return self._present() and (self.root / checkpoint_id).is_dir()

    def stored_size(self, checkpoint_id: str, stored_name: str) -> int:
        return _regular_size(self.root / checkpoint_id / stored_name)

    def open_stored(self, checkpoint_id: str, stored_name: str) -> AbstractContextManager[Reader]:
        return _open_read(self.root / checkpoint_id / stored_name)

    def local_dir(self, checkpoint_id: str) -> Path | None:
        return self.root / checkpoint_id

    # -- writing ----------------------------------------------------------------------------

    def _staging_path(self, checkpoint_id: str) -> Path:
        return self.root / STAGING_NAME / checkpoint_id

    def _fresh(self, path: Path) -> Path:
        self._ensure_root()
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=0o700)
        return path

    def staging_dir(self, checkpoint_id: str) -> Path:
        return self._fresh(self._staging_path(checkpoint_id))

    def staged_path(self, checkpoint_id: str) -> Path:
        return self._staging_path(checkpoint_id)

    def _packing_path(self, checkpoint_id: str) -> Path:
        return self._staging_path(checkpoint_id + _PUBLISH_SUFFIX)

    def staging_area(self) -> Path:
        return self.root / STAGING_NAME

    def discard(self, checkpoint_id: str) -> None:
        staging = self._staging_path(checkpoint_id)
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(self._packing_path(checkpoint_id), ignore_errors=True)

    def publish(self, job: Publication) -> Manifest:
        staging = job.staged(self._staging_path(job.id))
        in_place = job.source is None and job.compression == "none"
        final = self.root / job.id
        out = staging if in_place else self._packing_path(job.id)
        moved = False
        try:
            self._ensure_root()
            names = staged_names(staging)
            if os.path.lexists(final):
                raise FileExistsError(f"checkpoint {job.id} already exists in {self.where}")
            packed = any(p.output is not None for p in (job.hashed or {}).values())
            if in_place and job.data_key is not None:
                # Sealed where they are: the plain bytes never stay beside the ciphertext.
                plain_of = {stored_name(n, "none", True): n for n in names}
                entries = job.pack(
                    staging, names, lambda stored: _sealing(staging / plain_of[stored]), job.hashed
                )
                for entry in entries:
                    os.rename(staging / entry.name, staging / entry.stored_name)
                    os.chmod(staging / entry.stored_name, 0o600)
            elif in_place:
                # The staged files are the stored ones: hash them in place, never copy.
                entries = job.pack(staging, names, None, job.hashed)
                for name in names:
                    os.chmod(staging / name, 0o600)
            else:
                if not packed:  # else it holds what a follower compressed while CRIU wrote
                    shutil.rmtree(out, ignore_errors=True)
                out.parent.mkdir(mode=0o700, exist_ok=True)
                out.mkdir(mode=0o700, exist_ok=True)
                entries = job.pack(staging, names, lambda n: _create(out / n), job.hashed)
            if in_place:
                os.chmod(staging, 0o700)
                # What a follower of `auto` compressed before it gave up, if anything.
                shutil.rmtree(self._packing_path(job.id), ignore_errors=True)
            in_parallel(
                _fsync_file, [out / e.stored_name for e in entries], cpu_workers(len(entries))
            )
            manifest = job.manifest(entries)
            write_atomically(out / MANIFEST_NAME, manifest_bytes(manifest))  # out synced too
            os.rename(out, final)
            moved = True
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(final if moved else out, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return manifest

    def follow(self, checkpoint_id: str, how: Following) -> TailHasher | None:
        # Written back to disk as CRIU writes them, or compressed into the files the store
        # keeps. sync_file_range on tmpfs is a no-op: no need to tell disks from memory here.
        staged = self._staging_path(checkpoint_id)
        compression, cipher = how.compression, how.cipher
        if compression == "none" and cipher is None:
            return TailHasher(staged, writeback=True)
        if compression == "none":
            # Sealed in place (tailhash.InPlaceOutput): no second copy to write, none to remove.
            return TailHasher(staged, writeback=True, cipher=cipher, seal_in_place=True)
        try:
            pack_into = self._fresh(self._packing_path(checkpoint_id))
        except OSError as e:
            # Following is a shortcut: publish does all of it and reports a real disk problem.
            log.debug("not compressing %s while CRIU writes: %s", checkpoint_id, e)
            return None
        return TailHasher(
            staged,
            writeback=True,
            compression=compression,
            open_out=local_opener(pack_into, writeback=True),
            cipher=cipher,
            seal_in_place=True,
        )

    def describe(self, e: BaseException) -> str | None:
        return None  # the OS's words say it

    def abort_abandoned_uploads(self, idle_s: float, now: datetime, alive: set[str]) -> list[str]:
        return []  # a local file is written whole or removed with its staging directory

    def write_manifest(self, checkpoint_id: str, data: bytes) -> None:
        path = self.root / checkpoint_id
        if not self._present() or not (path / MANIFEST_NAME).is_file():
            raise FileNotFoundError(path / MANIFEST_NAME)
        write_atomically(path / MANIFEST_NAME, data)

    def read_stored_range(
        self, checkpoint_id: str, stored_name: str, start: int, end: int
    ) -> bytes:
        fd = os.open(
            self.root / checkpoint_id / stored_name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
        )
        try:
            parts = []
            while start < end:
                data = os.pread(fd, end - start, start)
                if not data:
                    break
                parts.append(data)
                start += len(data)
            return b"".join(parts)
        finally:
            os.close(fd)

    def remove(self, checkpoint_id: str) -> None:
        path = self.root / checkpoint_id
        if not self._present() or not path.is_dir():
            raise FileNotFoundError(path)
        try:
            os.unlink(path / MANIFEST_NAME)
            fsync_dir(path)
        except FileNotFoundError:
            pass  # half-deleted before: finish the job
        shutil.rmtree(path)

    def put_note(self, checkpoint_id: str, name: str, data: bytes) -> None:
        path = self.root / checkpoint_id
        if not self._present() or not path.is_dir():
            raise FileNotFoundError(path)
        write_atomically(path / name, data)

    def has_note(self, checkpoint_id: str, name: str) -> bool:
        return self._present() and (self.root / checkpoint_id / name).is_file()

    def note_times(self, checkpoint_id: str, prefix: str) -> dict[str, float]:
        path = self.root / checkpoint_id
        if not self._present():
            raise FileNotFoundError(path)
        with os.scandir(path) as entries:
            return {
                e.name: e.stat(follow_symlinks=False).st_mtime
                for e in entries
                if e.name.startswith(prefix) and e.is_file(follow_symlinks=False)
            }

    def remove_note(self, checkpoint_id: str, name: str) -> None:
        try:
            os.unlink(self.root / checkpoint_id / name)
        except FileNotFoundError:
            pass

    def clock(self) -> float:
        # The filesystem's clock (an NFS server's, or this kernel's): what stamps every file
        # whose age is measured here. Nothing here yet: nothing to age, and no store to start.
        if not self._present():
            return time.time()
        self._ensure_root()
        fd, name = tempfile.mkstemp(
            prefix=f".clock-{secrets.token_hex(4)}-", dir=self.root / STAGING_NAME
        )
        try:
            os.write(fd, b"\0")
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            os.unlink(name)

    def heartbeat(self, checkpoint_id: str) -> None:
        # The staging directories are where gc (`remove_idle`) looks for a dump's last write.
        for path in (self._staging_path(checkpoint_id), self._packing_path(checkpoint_id)):
            try:
                os.utime(path)
            except FileNotFoundError:
                pass

    def end_heartbeat(self, checkpoint_id: str) -> None:
        pass

    def newest_write(self, checkpoint_id: str) -> float | None:
        path = self.root / checkpoint_id
        try:
            times = [os.lstat(path).st_mtime]
            times += [e.stat(follow_symlinks=False).st_mtime for e in os.scandir(path)]
        except FileNotFoundError:
            return None
        return max(times)

    # -- the label index --------------------------------------------------------------------

    def _index(self) -> Path:
        return self.root / INDEX_DIR

    def index_put(self, label: str, uid: int, name: str) -> None:
        self._ensure_root()
        index = self._index()
        _private_dir(index)
        by_label = index / label
        by_label.mkdir(mode=0o700, exist_ok=True)
        owner = by_label / str(uid)
        owner.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(owner / name, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        # The entry must outlive a crash that the manifest written after it survives.
        fsync_dir(owner)

    def index_remove(self, label: str, uid: int, name: str) -> None:
        owner = self._index() / label / str(uid)
        try:
            os.unlink(owner / name)
        except FileNotFoundError:
            return
        for empty in (owner, owner.parent):
            try:
                os.rmdir(empty)
            except OSError:
                break  # not empty (or another node filled it meanwhile)

    def index_list(self, label: str, uid: int | None, limit: int | None = None) -> list[Entry]:
        if not self._present():
            return []
        by_label = self._index() / label
        if uid is not None:
            owners = [(uid, by_label / str(uid))]
        else:
            try:
                owners = [
                    (u, by_label / e)
                    for e in os.listdir(by_label)
                    if (u := parse_uid(e)) is not None
                ]
            except FileNotFoundError:
                return []
        found = []
        for owner_uid, owner in owners:
            try:
                names = os.listdir(owner)
            except FileNotFoundError:
                continue
            found += [e for n in names if (e := parse_entry(n, owner_uid)) is not None]
        return sorted(found)

    def index_labels(self) -> list[str]:
        if not self._present():
            return []
        try:
            return sorted(e for e in os.listdir(self._index()) if e != FORMAT_FILE)
        except FileNotFoundError:
            return []

    def index_ready(self) -> bool:
        return self._present() and (self._index() / FORMAT_FILE).is_file()

    def mark_index_ready(self) -> None:
        if not self._present():
            return  # no store here yet: its first publish starts one, and a later sweep marks
        self._ensure_root()
        _private_dir(self._index())
        write_atomically(self._index() / FORMAT_FILE, FORMAT)


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, exist_ok=True)
    path.chmod(0o700)


@contextmanager
def _sealing(path: Path) -> Iterator[Writer]:
    output = InPlaceOutput(path, writeback=False)
    try:
        yield output
    finally:
        output.close()


def _create(path: Path) -> BinaryIO:
    # O_EXCL: never follow a link planted where an image is going.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "wb")


@contextmanager
def _open_read(path: Path) -> Iterator[io.FileIO]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    with io.FileIO(fd, "rb") as f:
        yield f


def _regular_size(path: Path) -> int:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise FileNotFoundError(f"{path} is not a regular file")
    return st.st_size


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
