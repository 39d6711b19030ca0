"""The store on any fsspec filesystem (object stores, memory://, dir::file://...).

Same layout as the local store, `<root>/<id>/{images..., manifest.json}`, but images are dumped
into a local staging directory first and uploaded from there, compressed on the way. There is no
directory rename to lean on, so manifest.json is written last, under a temporary name and then
moved into place (on S3, where one PUT is atomic and there is no rename, written in place:
see _s3.py): a checkpoint without it is never listed, and a failed publish removes what it
uploaded. Permissions are the remote's business: grant writes to root alone.
"""

from __future__ import annotations

import posixpath
import shutil
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, cast

from stasis.store._tree import MAX_MANIFEST_BYTES, manifest_bytes, pack_staged, staged_names
from stasis.store.compression import Reader, Writer
from stasis.store.index import FORMAT, FORMAT_FILE, INDEX_DIR, Entry, parse_entry, parse_uid
from stasis.store.crypt import DataKey
from stasis.store.tailhash import Partial
from stasis.store.manifest import (
    MANIFEST_NAME,
    CheckpointInfo,
    Compression,
    Manifest,
    is_checkpoint_id,
)


class RemoteTree:
    def __init__(self, fs: Any, root: str, where: str, staging_root: Path) -> None:
        self.fs = fs  # an fsspec AbstractFileSystem; fsspec ships no type information
        self.root = root.rstrip("/")
        self.where = where
        self.staging_root = staging_root

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
        return cast(bytes, self.fs.cat_file(self._path(checkpoint_id, MANIFEST_NAME),
                                            start=0, end=MAX_MANIFEST_BYTES))

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

    def packing_dir(self, checkpoint_id: str) -> Path:
        raise NotImplementedError("only a local store's images are followed while CRIU writes")

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
        shutil.rmtree(self._staging_path(checkpoint_id), ignore_errors=True)

    def _open_write(self, path: str) -> AbstractContextManager[Writer]:
        return cast(AbstractContextManager[Writer], self.fs.open(path, "wb"))

    def publish(
        self, info: CheckpointInfo, compression: Compression, source: Path | None = None,
        hashed: Mapping[str, Partial] | None = None,
        *,
        seal: Callable[[Manifest], Manifest],
        data_key: DataKey | None = None,
    ) -> Manifest:
        # `hashed` is of no use here: every image is read anyway, to be copied.
        staging = source or self._staging_path(info.id)
        target = self._path(info.id)
        started = False
        try:
            names = staged_names(staging)
            if self.fs.exists(target):
                raise FileExistsError(f"checkpoint {info.id} already exists in {self.where}")
            started = True
            self._make_dir(target)
            entries = pack_staged(
                staging, names, compression, lambda n: self._open_write(self._path(info.id, n)),
                data_key=data_key,
            )
            manifest = seal(Manifest.build(
                info, compression, entries,
                data_key.encryption if data_key is not None else None))
            self._put_manifest(info.id, manifest_bytes(manifest))
        except BaseException:
            if started:
                self._remove_quietly(target)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return manifest

    def _make_dir(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

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

    def read_stored_range(self, checkpoint_id: str, stored_name: str, start: int,
                          end: int) -> bytes:
        return cast(bytes, self.fs.cat_file(self._path(checkpoint_id, stored_name),
                                            start=start, end=end))

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

    def newest_write(self, checkpoint_id: str) -> float | None:
        try:
            entries = self.fs.ls(self._path(checkpoint_id), detail=True)
        except FileNotFoundError:
            return None
        times = []
        for entry in entries:
            # Each backend names it its own way: S3 LastModified, local mtime, memory created.
            stamp = entry.get("LastModified") or entry.get("mtime") or entry.get("created")
            if hasattr(stamp, "timestamp"):
                times.append(float(stamp.timestamp()))
            elif isinstance(stamp, int | float):
                times.append(float(stamp))
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
            owners = [u for n in self._names(self._path(INDEX_DIR, label))
                      if (u := parse_uid(n)) is not None]
        found = []
        for owner in owners:
            found += [e for n in self._owner_entries(label, owner, limit)
                      if (e := parse_entry(n, owner)) is not None]
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
