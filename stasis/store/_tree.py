"""The interface between `Store` and where its bytes live, plus the helpers both backends share.

A `Tree` knows one layout, `<root>/<id>/{images..., manifest.json}`, on one kind of storage:
a local directory (`_local.LocalTree`), any fsspec filesystem (`_remote.RemoteTree`) or S3
(`_s3.S3Tree`); what differs between them is a method here, never a type test in the store.
Trees raise OSError (FileNotFoundError for anything absent) and leave the wording of errors, the
validation of requests and the verification of images to `Store`.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol, TypeVar

from stasis.errors import StoreError
from stasis.store.chunked import ChunkSpec, ChunkWriter
from stasis.store.compression import Reader, Streamed, Writer, cpu_workers, stored_name
from stasis.store.crypt import ChunkCipher, DataKey
from stasis.store.index import Entry
from stasis.store.manifest import (
    CheckpointInfo,
    Chunks,
    Compression,
    CompressionRequest,
    FileEntry,
    Manifest,
    is_checkpoint_id,
    is_safe_file_name,
)
from stasis.store.tailhash import Partial, TailHasher

# A manifest lists files, not data: anything this large is garbage, and is not read whole.
MAX_MANIFEST_BYTES = 64 << 20

T = TypeVar("T")
R = TypeVar("R")


class Tree(Protocol):
    where: str  # the store as users name it, for messages
    read_workers: int  # manifests read at once in a listing: a remote store answers slowly

    def ids(self) -> list[str]:
        """Names under the root that look like checkpoint ids; [] when the root does not exist."""
        ...

    def read_manifest(self, checkpoint_id: str) -> bytes: ...

    def manifest_mtime(self, checkpoint_id: str) -> float:
        """When manifest.json was last written (seconds since the epoch)."""
        ...

    def exists(self, checkpoint_id: str) -> bool: ...

    def staging_dir(self, checkpoint_id: str) -> Path:
        """Create a fresh empty local directory for the images of `checkpoint_id`."""
        ...

    def staged_path(self, checkpoint_id: str) -> Path:
        """Where `staging_dir` put the images of `checkpoint_id` (without creating anything)."""
        ...

    def discard(self, checkpoint_id: str) -> None: ...

    def staging_area(self) -> Path:
        """The directory holding every staging directory (and half-published copy) of this tree."""
        ...

    def publish(self, job: Publication) -> Manifest:
        """Store the staged images of `job.info.id` and its manifest, all or nothing.

        Always consumes the staging directory: it becomes the checkpoint, or is removed on
        failure (see `Publication`).
        """
        ...

    def follow(self, checkpoint_id: str, how: Following) -> TailHasher | None:
        """A follower of the staging directory of `checkpoint_id` (`Publisher.follow`): it
        hashes, and compresses or seals or uploads, the images while CRIU writes them, as this
        tree can take them; None where it cannot (publish then does all of it)."""
        ...

    def describe(self, e: BaseException) -> str | None:
        """A line saying what a failure of this backend means for a user, or None to use the
        failure's own words."""
        ...

    def abort_abandoned_uploads(self, idle_s: float, now: datetime, alive: set[str]) -> list[str]:
        """Abort the uploads started `idle_s` before `now` (the store's clock) and never
        finished, but for those of the checkpoints in `alive`; the keys aborted (gc)."""
        ...

    def write_manifest(self, checkpoint_id: str, data: bytes) -> None:
        """Replace a published checkpoint's manifest.json atomically (readers see the old one
        or the new one, never a part); FileNotFoundError when there is no such checkpoint."""
        ...

    def read_stored_range(
        self, checkpoint_id: str, stored_name: str, start: int, end: int
    ) -> bytes:
        """Bytes [start, end) of a stored file (fewer only where the file is shorter)."""
        ...

    def remove(self, checkpoint_id: str) -> None:
        """Remove manifest.json first, then the rest; FileNotFoundError if there is no such dir."""
        ...

    def put_note(self, checkpoint_id: str, name: str, data: bytes) -> None:
        """Write a small file beside a published checkpoint's images (not part of the manifest:
        what it says must never decide on a restore)."""
        ...

    def has_note(self, checkpoint_id: str, name: str) -> bool: ...

    def note_times(self, checkpoint_id: str, prefix: str) -> dict[str, float]:
        """The notes of a checkpoint whose names start with `prefix`, with when each was last
        written by the store's clock (`clock`); FileNotFoundError if there is no checkpoint."""
        ...

    def remove_note(self, checkpoint_id: str, name: str) -> None:
        """Remove a note; nothing happens when it is not there."""
        ...

    def clock(self) -> float:
        """The store's own time (epoch seconds): when an object written now says it was
        written. Ages of what is in the store are measured against it, never against this
        node's clock, which may be off (issue 28)."""
        ...

    def heartbeat(self, checkpoint_id: str) -> None:
        """Say, where any node's gc sees it, that the publish of `checkpoint_id` is alive."""
        ...

    def end_heartbeat(self, checkpoint_id: str) -> None:
        """Remove what `heartbeat` left, once the publish ended either way."""
        ...

    def open_stored(
        self, checkpoint_id: str, stored_name: str
    ) -> AbstractContextManager[Reader]: ...

    def stored_size(self, checkpoint_id: str, stored_name: str) -> int: ...

    def local_dir(self, checkpoint_id: str) -> Path | None:
        """The checkpoint's own directory when it is on a local filesystem, else None."""
        ...

    def newest_write(self, checkpoint_id: str) -> float | None:
        """When anything in a checkpoint's directory was last written (epoch seconds); None
        when it holds nothing or the backend cannot tell."""
        ...

    # -- the label index (index.py) ---------------------------------------------------------

    def index_put(self, label: str, uid: int, name: str) -> None:
        """Create the (empty) index entry `name` of (label, uid), durably."""
        ...

    def index_remove(self, label: str, uid: int, name: str) -> None:
        """Remove an index entry; nothing happens when it is not there."""
        ...

    def index_list(self, label: str, uid: int | None, limit: int | None = None) -> list[Entry]:
        """The entries of (label, uid), or of `label` for every owner (uid None), newest first;
        at least the newest `limit` of each owner when a limit is given (a tree may return more)."""
        ...

    def index_labels(self) -> list[str]:
        """Every label with index entries."""
        ...

    def index_ready(self) -> bool:
        """Whether the index is complete (`Store.ensure_index` finished once)."""
        ...

    def mark_index_ready(self) -> None: ...


@dataclass(frozen=True)
class Following:
    """How `Tree.follow` takes the images CRIU writes: in `compression` ("auto" settles while
    following), sealed with `data_key`. A tree that writes into the store while following
    calls `uploading` first: the publish's heartbeat must run from then on."""

    compression: CompressionRequest
    data_key: DataKey | None
    uploading: Callable[[], object]

    @property
    def cipher(self) -> ChunkCipher | None:
        return self.data_key.cipher if self.data_key is not None else None


@dataclass(frozen=True)
class Publication:
    """What `Tree.publish` stores: the images staged for `info.id`, in `compression`.

    `source` is a directory the images were staged in elsewhere (fast node-local memory);
    None means the tree's own staging directory. `hashed`: see `pack_staged` (a tree that
    copies the images anyway may ignore it). `seal` turns the manifest built from the files
    into the one written (the store signs it there): what it returns is returned. `data_key`:
    encrypt the images with it (the plain staged files never become stored ones, and are
    removed either way).
    """

    info: CheckpointInfo
    compression: Compression
    seal: Callable[[Manifest], Manifest]
    source: Path | None = None
    hashed: Mapping[str, Partial] | None = None
    data_key: DataKey | None = None

    @property
    def id(self) -> str:
        return self.info.id

    def staged(self, own_staging: Path) -> Path:
        """Where the images to publish are: `source`, else the tree's `own_staging`."""
        return self.source or own_staging

    def pack(
        self,
        staging: Path,
        names: list[str],
        open_dst: Callable[[str], AbstractContextManager[Writer]] | None,
        hashed: Mapping[str, Partial] | None,
    ) -> list[FileEntry]:
        """`pack_staged` of these images, with this publication's codec and key."""
        return pack_staged(staging, names, self.compression, open_dst, hashed, self.data_key)

    def manifest(self, entries: list[FileEntry]) -> Manifest:
        """The sealed manifest of the stored `entries`."""
        encryption = self.data_key.encryption if self.data_key is not None else None
        return self.seal(Manifest.build(self.info, self.compression, entries, encryption))


def staged_names(staging: Path) -> list[str]:
    """The image files CRIU left in `staging`; refuses anything but plain files with safe names."""
    names = []
    try:
        entries = os.scandir(staging)
    except FileNotFoundError:
        raise StoreError(
            f"no staged images for checkpoint {staging.name}: dump into Store.staging_dir() first"
        ) from None
    with entries:
        for entry in entries:
            if not entry.is_file(follow_symlinks=False) or not is_safe_file_name(entry.name):
                raise StoreError(
                    f"unexpected entry {entry.name!r} in staging directory {staging}: "
                    "only plain image files can be published"
                )
            names.append(entry.name)
    return sorted(names)


def in_parallel(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """`[fn(x) for x in items]` on `workers` threads; raises the first failure after all finish."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stasis-store") as pool:
        return list(pool.map(fn, items))


def pack_staged(
    staging: Path,
    names: list[str],
    compression: Compression,
    open_dst: Callable[[str], AbstractContextManager[Writer]] | None,
    hashed: Mapping[str, Partial] | None = None,
    data_key: DataKey | None = None,
) -> list[FileEntry]:
    """Checksum (and chunk, compress, seal into `open_dst(stored_name)`) every staged file,
    reading each once.

    `open_dst=None` only checksums (no compression, no encryption): the staged files themselves
    become the stored ones. `hashed`: the beginnings of files a follower took while CRIU wrote
    them; each is continued where it fits (same codec and key, not past the file's end) and
    discarded where not.
    """
    spec = ChunkSpec(compression, data_key.cipher if data_key is not None else None)
    if open_dst is None and not spec.identity:
        raise ValueError("compressed or encrypted files need a destination")
    workers = cpu_workers(len(names))

    def one(name: str) -> FileEntry:
        stored = stored_name(name, compression, spec.encrypted)
        partial = (hashed or {}).get(name)
        # Unbuffered: the chunk loops read with readinto into their own buffers.
        with open(staging / name, "rb", buffering=0) as src:
            if partial is not None and not _continues(
                partial, spec, stored, src, open_dst is not None
            ):
                partial.discard()
                if partial.spoiled:
                    # Its first chunks are ciphertext whose seals are gone: sealing the file
                    # again would store garbage that opens fine.
                    raise StoreError(
                        f"{name} was sealed in part while CRIU wrote it and "
                        "that could not be finished; dump again"
                    )
                partial = None
            if partial is not None:
                src.seek(partial.offset)
                writer = partial.writer
                writer.workers = workers
                try:
                    streamed, table = _complete(writer, src)
                finally:
                    if partial.output is not None:
                        partial.output.close()
            elif open_dst is None:
                writer = ChunkWriter(name, spec, None)
                writer.add_from(src)
                streamed, table = writer.finish()
            else:
                with open_dst(stored) as dst:
                    writer = ChunkWriter(name, spec, dst, workers)
                    streamed, table = _complete(writer, src)
        return FileEntry(
            name=name,
            size_bytes=streamed.size_bytes,
            stored_name=stored,
            stored_size_bytes=streamed.stored_size_bytes,
            blake3=streamed.blake3 or None,
            xxh3_128=streamed.xxh3_128 or None,
            chunks=table,
        )

    for name, partial in (hashed or {}).items():
        if name not in names:
            partial.discard()
    # Files on threads of their own, and the chunks of each large one on threads too: the
    # small files cost opening and closing, the page images the codecs' time.
    return in_parallel(one, names, workers)


def _complete(writer: ChunkWriter, src: Reader) -> tuple[Streamed, Chunks]:
    try:
        writer.add_from(src)
    except BaseException:
        writer.close()
        raise
    return writer.finish()


def _continues(
    partial: Partial, spec: ChunkSpec, stored: str, src: Reader, copies: bool = False
) -> bool:
    """Whether publish can go on from what a follower took of this file (`copies`: publish
    writes even plain files to a destination, which a follower may have streamed them to)."""
    writer = partial.writer
    if writer.spec != spec:
        return False  # encoded for another codec (or key) than the one published
    if (partial.output is None) != spec.identity and not (
        copies and spec.identity and partial.output is not None
    ):
        return False
    if partial.output is not None and partial.stored_name != stored:
        return False
    assert isinstance(src, io.FileIO)
    return partial.offset <= os.fstat(src.fileno()).st_size


def manifest_bytes(manifest: Manifest) -> bytes:
    return manifest.model_dump_json(indent=2).encode() + b"\n"


def remove_idle(area: Path, idle_s: float, now: float) -> list[str]:
    """Remove the entries of `area` in which nothing was written for `idle_s` seconds (the entry
    and the files in it, which a running dump keeps touching); return their names."""
    removed = []
    try:
        entries = list(os.scandir(area))
    except FileNotFoundError:
        return []
    for entry in entries:
        if not is_checkpoint_id(entry.name.removesuffix(".publish")):
            continue  # not a dump's: not ours to judge
        try:
            newest = entry.stat(follow_symlinks=False).st_mtime
            if entry.is_dir(follow_symlinks=False):
                for inner in os.scandir(entry.path):
                    newest = max(newest, inner.stat(follow_symlinks=False).st_mtime)
        except FileNotFoundError:
            continue  # finished or discarded meanwhile
        if now - newest < idle_s:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)
        removed.append(entry.name)
    return removed
