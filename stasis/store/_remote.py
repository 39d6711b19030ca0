"""The store on any fsspec filesystem (object stores, memory://, dir::file://...).

Same layout as the local store, `<root>/<id>/{images..., manifest.json}`, but images are dumped
into a local staging directory first and uploaded from there, compressed on the way. There is no
directory rename to lean on, so manifest.json is written last, under a temporary name and then
moved into place (on S3, where one PUT is atomic and there is no rename, written in place:
see _s3.py): a checkpoint without it is never listed, and a failed publish removes what it
uploaded. Permissions are the remote's business: grant writes to root alone.

A dump whose total time counts streams instead (`follow`, used by `Publisher.follow`): the
page images are uploaded while CRIU still writes them, each stored file on a thread of its own
(`ThreadedOutput`; on S3 a multipart upload of several parts at once), and publish only sends
the tails, then the manifest. Streams a dump started and never published are stopped and
removed by `discard`.
"""

from __future__ import annotations

import logging
import os
import posixpath
import queue
import secrets
import shutil
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from stasis.store._tree import (
    MAX_MANIFEST_BYTES,
    Following,
    Publication,
    manifest_bytes,
    staged_names,
)
from stasis.store.compression import Reader, Writer
from stasis.store.index import FORMAT, FORMAT_FILE, INDEX_DIR, Entry, parse_entry, parse_uid
from stasis.store.manifest import MANIFEST_NAME, Manifest, is_checkpoint_id
from stasis.store.tailhash import Opener, Output, TailHasher

log = logging.getLogger(__name__)

_QUEUE_DEPTH = 8  # writes a ThreadedOutput holds before its writer waits (a few MiB)


class ThreadedOutput:
    """One remote file written by a thread of its own from a bounded queue, so that the
    follower that produces its bytes never waits on the network (until the queue is full).

    `write` never raises: a failed upload is reported by `close`, which waits for everything
    queued to be written (a follower must not stop half-way with its writer ahead of its
    output). `discard` stops, and removes what was written.
    """

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path
        self._queue: queue.Queue[bytes | None] = queue.Queue(_QUEUE_DEPTH)
        self._error: BaseException | None = None
        self._stop = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="stasis-upload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ended = False  # the end (None) was taken from the queue
        try:
            with self.fs.open(self.path, "wb") as f:
                while (data := self._queue.get()) is not None:
                    if self._stop:
                        raise _Stopped
                    f.write(data)
                ended = True
                if self._stop:
                    raise _Stopped
        except BaseException as e:  # the close of the file included (a full disk says so there)
            self._error = e
            while not ended and self._queue.get() is not None:
                pass  # let `write` go on; close or discard is what reports

    def write(self, data: bytes | memoryview, /) -> int:
        if not self._closed:
            self._queue.put(bytes(data))  # a copy: the follower reuses its buffer
        return len(data)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            self._remove()
            raise self._error

    def discard(self) -> None:
        self._stop = True
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        self._thread.join()
        self._remove()

    def _remove(self) -> None:
        try:
            self.fs.rm_file(self.path)
        except Exception:
            pass  # never written, or the server is gone: gc removes it


class _Stopped(Exception):
    """A discarded ThreadedOutput: its file is not to be committed."""


class RemoteTree:
    def __init__(self, fs: Any, root: str, where: str, staging_root: Path) -> None:
        self.fs = fs  # an fsspec AbstractFileSystem; fsspec ships no type information
        self.root = root.rstrip("/")
        self.where = where
        self.read_workers = 16  # each read waits a round trip: several at once
        self.staging_root = staging_root
        # The outputs each dump's follower opened: `discard` stops those never published.
        self._streams: dict[str, list[Output]] = {}
        self._streams_lock = threading.Lock()

    def _path(self, *parts: str) -> str:
        return "/".join(p for p in (self.root, *parts) if p)

    # -- reading ----------------------------------------------------------------------------

    def ids(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return self._ids_in(entries)

    @staticmethod
    def _ids_in(entries: list[dict[str, Any]]) -> list[str]:
        found = []
        for entry in entries:
            name = posixpath.basename(str(entry["name"]).rstrip("/"))
            if entry.get("type") == "directory" and is_checkpoint_id(name):
                found.append(name)
        return found

    def read_manifest(self, checkpoint_id: str) -> bytes:
        # One ranged GET: opening a file first would cost a HEAD request more on object stores.
        return cast(
            bytes,
            self.fs.cat_file(
                self._path(checkpoint_id, MANIFEST_NAME), start=0, end=MAX_MANIFEST_BYTES
            ),
        )

    def manifest_mtime(self, checkpoint_id: str) -> float:
        # fsspec's own: a datetime, or NotImplementedError where the backend keeps no time.
        modified = self.fs.modified(self._path(checkpoint_id, MANIFEST_NAME))
        return float(modified.timestamp())

    def exists(self, checkpoint_id: str) -> bool:
        return bool(self.fs.exists(self._path(checkpoint_id)))

    def stored_size(self, checkpoint_id: str, stored_name: str) -> int:
        return int(self.fs.size(self._path(checkpoint_id, stored_name)))

    def open_stored(self, checkpoint_id: str, stored_name: str) -> AbstractContextManager[Reader]:
        return cast(
            AbstractContextManager[Reader],
            self.fs.open(self._path(checkpoint_id, stored_name), "rb"),
        )

    def local_dir(self, checkpoint_id: str) -> Path | None:
        return None

    # -- writing ----------------------------------------------------------------------------

    def _staging_path(self, checkpoint_id: str) -> Path:
        return self.staging_root / checkpoint_id

    def staging_dir(self, checkpoint_id: str) -> Path:
        self.staging_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self._staging_path(checkpoint_id)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=0o700)
        return path

    def staged_path(self, checkpoint_id: str) -> Path:
        return self._staging_path(checkpoint_id)

    def staging_area(self) -> Path:
        return self.staging_root

    def discard(self, checkpoint_id: str) -> None:
        for output in self._take_streams(checkpoint_id):
            output.discard()
        # The directory `stream_opener` made: left there, a dump tried again under the same id
        # (dumping.py, after CRIU caught a short call) would not stream.
        self._remove_empty_dir(self._path(checkpoint_id))
        shutil.rmtree(self._staging_path(checkpoint_id), ignore_errors=True)

    def _open_write(self, path: str) -> AbstractContextManager[Writer]:
        return cast(AbstractContextManager[Writer], self.fs.open(path, "wb"))

    def _open_output(self, path: str) -> Output:
        return ThreadedOutput(self.fs, path)

    def stream_opener(self, checkpoint_id: str) -> Opener:
        """Outputs for the stored files of `checkpoint_id`, uploading while a follower writes
        them (`TailHasher(open_out=...)`); publish finishes them, `discard` stops them."""
        if self.fs.exists(self._path(checkpoint_id)):
            raise FileExistsError(f"checkpoint {checkpoint_id} already exists in {self.where}")
        self._make_dir(self._path(checkpoint_id))  # filesystems with directories need it

        def open_out(stored_name: str) -> Output:
            output = self._open_output(self._path(checkpoint_id, stored_name))
            with self._streams_lock:
                self._streams.setdefault(checkpoint_id, []).append(output)
            return output

        return open_out

    def _take_streams(self, checkpoint_id: str) -> list[Output]:
        with self._streams_lock:
            return self._streams.pop(checkpoint_id, [])

    def publish(self, job: Publication) -> Manifest:
        # `hashed` counts where a follower streamed the images (`stream_opener`): their tails
        # are sent here. Partials that only hashed are of no use: every file is read anyway.
        staging = job.staged(self._staging_path(job.id))
        target = self._path(job.id)
        streamed = {n: p for n, p in (job.hashed or {}).items() if p.output is not None}
        for partial in (job.hashed or {}).values():
            if partial.output is None:
                partial.discard()
        started = bool(streamed)
        try:
            names = staged_names(staging)
            # What was streamed (or began to be) is there already: only a manifest says the
            # checkpoint exists.
            if self.fs.exists(self._path(job.id, MANIFEST_NAME)):
                raise FileExistsError(f"checkpoint {job.id} already exists in {self.where}")
            started = True
            self._make_dir(target)
            entries = job.pack(
                staging, names, lambda n: self._open_write(self._path(job.id, n)), streamed
            )
            manifest = job.manifest(entries)
            self._put_manifest(job.id, manifest_bytes(manifest))
        except BaseException:
            # Uploads still open (a file that failed, or others cut short) are aborted first.
            for partial in streamed.values():
                partial.discard()
            for output in self._take_streams(job.id):
                output.discard()
            if started:
                self._remove_quietly(target)
            raise
        finally:
            self._take_streams(job.id)
            shutil.rmtree(staging, ignore_errors=True)
        return manifest

    def follow(self, checkpoint_id: str, how: Following) -> TailHasher | None:
        # Every image (compressed or not, sealed or not) is uploaded while CRIU writes it;
        # publish sends the tails and the manifest.
        try:
            opener = self.stream_opener(checkpoint_id)
        except Exception as e:
            # A shortcut only: publish uploads everything itself and reports what is wrong.
            log.debug("not uploading %s while CRIU writes: %s", checkpoint_id, e)
            return None
        how.uploading()
        return TailHasher(
            self._staging_path(checkpoint_id),
            compression=how.compression,
            open_out=opener,
            copy_plain=True,
            cipher=how.cipher,
        )

    def describe(self, e: BaseException) -> str | None:
        return None  # fsspec's own words

    def abort_abandoned_uploads(self, idle_s: float, now: datetime, alive: set[str]) -> list[str]:
        return []  # only S3 keeps unfinished uploads

    def _make_dir(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def _remove_empty_dir(self, path: str) -> None:
        try:
            self.fs.rmdir(path)  # refused where anything is in it: a published checkpoint stays
        except Exception:
            pass  # never made, or the server is gone: gc removes what is left

    def _put_manifest(self, checkpoint_id: str, data: bytes) -> None:
        # Not every fsspec backend writes a file in one step: write beside it, then move.
        tmp = self._path(checkpoint_id, f".{MANIFEST_NAME}.tmp")
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, self._path(checkpoint_id, MANIFEST_NAME))

    def write_manifest(self, checkpoint_id: str, data: bytes) -> None:
        final = self._path(checkpoint_id, MANIFEST_NAME)
        if not self.fs.exists(final):
            raise FileNotFoundError(final)
        self._put_manifest(checkpoint_id, data)

    def read_stored_range(
        self, checkpoint_id: str, stored_name: str, start: int, end: int
    ) -> bytes:
        return cast(
            bytes, self.fs.cat_file(self._path(checkpoint_id, stored_name), start=start, end=end)
        )

    def _remove_quietly(self, target: str) -> None:
        try:
            self.fs.rm(target, recursive=True)
        except Exception:
            pass  # best effort while another error is on its way up; it is not listed anyway

    def remove(self, checkpoint_id: str) -> None:
        target = self._path(checkpoint_id)
        if not self.fs.exists(target):
            raise FileNotFoundError(target)
        try:
            self.fs.rm(self._path(checkpoint_id, MANIFEST_NAME))
        except FileNotFoundError:
            pass  # half-deleted before: finish the job
        self.fs.rm(target, recursive=True)

    def put_note(self, checkpoint_id: str, name: str, data: bytes) -> None:
        if not self.fs.exists(self._path(checkpoint_id, MANIFEST_NAME)):
            raise FileNotFoundError(self._path(checkpoint_id))
        self.fs.pipe_file(self._path(checkpoint_id, name), data)

    def has_note(self, checkpoint_id: str, name: str) -> bool:
        return bool(self.fs.exists(self._path(checkpoint_id, name)))

    def note_times(self, checkpoint_id: str, prefix: str) -> dict[str, float]:
        entries = self.fs.ls(self._path(checkpoint_id), detail=True)
        found = {}
        for entry in entries:
            name = posixpath.basename(str(entry.get("name", "")).rstrip("/"))
            stamp = _stamp(entry)
            if name.startswith(prefix) and entry.get("type") != "directory" and stamp is not None:
                found[name] = stamp
        return found

    def remove_note(self, checkpoint_id: str, name: str) -> None:
        try:
            self.fs.rm_file(self._path(checkpoint_id, name))
        except FileNotFoundError:
            pass

    def clock(self) -> float:
        # The server's clock: what stamps every object whose age is measured here.
        path = self._path(CLOCK_DIR, f"{secrets.token_hex(8)}")
        try:
            self.fs.pipe_file(path, b"\0")
        except FileNotFoundError:
            # A filesystem backend (dir::file://) makes no parent directory of its own: without
            # this, `_pinned` took the error for "checkpoint gone" and retention ignored pins.
            self.fs.makedirs(self._path(CLOCK_DIR), exist_ok=True)
            self.fs.pipe_file(path, b"\0")
        try:
            stamp = _stamp(self.fs.info(path))
        finally:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
        if stamp is None:
            raise OSError(f"{self.where} does not say when an object was written")
        return stamp

    def heartbeat(self, checkpoint_id: str) -> None:
        # An object in the checkpoint's directory: gc (`newest_write`) sees it from any node,
        # while the files of a multipart upload stay invisible until it completes.
        try:
            os.utime(self._staging_path(checkpoint_id))
        except FileNotFoundError:
            pass
        self.fs.pipe_file(self._path(checkpoint_id, PUBLISHING_NOTE), b"{}")

    def end_heartbeat(self, checkpoint_id: str) -> None:
        try:
            self.fs.rm_file(self._path(checkpoint_id, PUBLISHING_NOTE))
        except FileNotFoundError:
            pass

    def newest_write(self, checkpoint_id: str) -> float | None:
        try:
            entries = self.fs.ls(self._path(checkpoint_id), detail=True)
        except FileNotFoundError:
            return None
        times = [t for entry in entries if (t := _stamp(entry)) is not None]
        return max(times) if times else None

    # -- the label index --------------------------------------------------------------------

    def index_put(self, label: str, uid: int, name: str) -> None:
        self._make_dir(self._path(INDEX_DIR, label, str(uid)))
        self.fs.pipe_file(self._path(INDEX_DIR, label, str(uid), name), b"")

    def index_remove(self, label: str, uid: int, name: str) -> None:
        try:
            self.fs.rm_file(self._path(INDEX_DIR, label, str(uid), name))
        except FileNotFoundError:
            pass

    def _names(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return [posixpath.basename(str(e).rstrip("/")) for e in entries]

    def index_list(self, label: str, uid: int | None, limit: int | None = None) -> list[Entry]:
        if uid is not None:
            owners = [uid]
        else:
            owners = [
                u
                for n in self._names(self._path(INDEX_DIR, label))
                if (u := parse_uid(n)) is not None
            ]
        found = []
        for owner in owners:
            found += [
                e
                for n in self._owner_entries(label, owner, limit)
                if (e := parse_entry(n, owner)) is not None
            ]
        return sorted(found)

    def _owner_entries(self, label: str, uid: int, limit: int | None) -> list[str]:
        return self._names(self._path(INDEX_DIR, label, str(uid)))

    def index_labels(self) -> list[str]:
        return sorted(n for n in self._names(self._path(INDEX_DIR)) if n != FORMAT_FILE)

    def index_ready(self) -> bool:
        return bool(self.fs.exists(self._path(INDEX_DIR, FORMAT_FILE)))

    def mark_index_ready(self) -> None:
        self._make_dir(self._path(INDEX_DIR))
        self.fs.pipe_file(self._path(INDEX_DIR, FORMAT_FILE), FORMAT)


# A publish under way refreshes this object in its checkpoint's directory (`heartbeat`).
PUBLISHING_NOTE = ".publishing"
# Where `clock` writes the object it reads the server's time from.
CLOCK_DIR = ".clock"


def _stamp(entry: Mapping[str, Any]) -> float | None:
    """When a listed object was written: each backend names it its own way (S3 LastModified,
    local mtime, memory created)."""
    stamp = entry.get("LastModified") or entry.get("mtime") or entry.get("created")
    if isinstance(stamp, datetime):
        return stamp.timestamp()
    if isinstance(stamp, int | float):
        return float(stamp)
    return None
