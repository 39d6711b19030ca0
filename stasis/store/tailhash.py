"""Hash (and compress) CRIU's page images while CRIU is still writing them.

Publishing used to read every image once more after the dump, ~0.1 s per 256 MiB on these
machines, all of it added to the time the caller waits (and, for a dump that stops the job, to the
time the job is down). CRIU writes each pages-*.img front to back and never goes back, so a thread
can follow the files as they grow, on the CPU that CRIU leaves idle, and hand the publish a hash
that only needs the last few MiB. On a disk store it also starts the write-back of what it has
read (sync_file_range), so the fsync before the manifest waits for the tail, not for everything.

A compressed dump is compressed the same way, into the files the store will keep (`pack_into`):
publish then compresses only the tail. With `auto` the follower compresses with zstd and watches
what it gets: once a few MiB say the pages do not shrink to half, it drops what it compressed and
only hashes from then on, so incompressible memory costs a few MiB of zstd, not a whole pass.

The partial hashes are a shortcut only: publish checks each against the file's final size and
re-reads any file that does not fit, so a wrong guess costs time, never a wrong checksum.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, cast

import xxhash

from stasis.store.compression import AUTO_MAX_RATIO, Encoder, Reader, Streamed, stored_name
from stasis.store.manifest import Compression, CompressionRequest

log = logging.getLogger(__name__)

_CHUNK = 8 << 20
_IDLE_S = 0.003
_SYNC_FILE_RANGE_WRITE = 2
# `auto` judges the pages after this many bytes (and again after every chunk): the same amount
# the sample of `choose_compression` reads, and the same rule (compress at half or less).
AUTO_JUDGE_BYTES = 4 << 20
AUTO_MIN_BYTES = 1 << 20  # below this, checkpoints are not compressed (choose_compression)


@dataclass
class Packing:
    """The first bytes of one file, compressed into `out` (a file the store keeps)."""

    encoder: Encoder
    out: BinaryIO
    path: Path
    packed: int = 0

    def write(self, data: bytes | memoryview) -> None:
        blob = self.encoder.compress(data)
        if blob:
            self.out.write(blob)
            self.packed += len(blob)

    def finish(self, src: Reader, partial: Partial) -> Streamed:
        """Compress the rest of `src` (positioned at partial.offset) and close the frame."""
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        size = partial.offset
        try:
            while n := src.readinto(view):
                partial.hasher.update(view[:n])
                self.write(view[:n])
                size += n
            tail = self.encoder.flush()
            self.out.write(tail)
            self.packed += len(tail)
        finally:
            self.out.close()
        return Streamed(size_bytes=size, stored_size_bytes=self.packed,
                        xxh3_128=partial.hasher.hexdigest())

    def drop(self) -> None:
        self.out.close()
        self.path.unlink(missing_ok=True)


@dataclass
class Partial:
    """The first `offset` bytes of one file, already fed to `hasher` (and to `packing`)."""

    offset: int
    hasher: xxhash.xxh3_128
    packing: Packing | None = field(default=None, compare=False)


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], fn)


class TailHasher:
    """Follows the page images in `directory` on a thread until `finish()`.

    `writeback`: start the disk write of every hashed range at once (for a durable store on a
    disk; pointless on tmpfs), where the staged files are the ones the store keeps.
    `compression` with `pack_into`: also compress each image into `pack_into`/<stored name>
    ("auto": zstd while the pages shrink to half or less). `compression` says what was settled
    on once `finish()` returned: the codec, "none", or None (auto saw too little to judge).
    """

    def __init__(self, directory: Path, writeback: bool = False,
                 compression: CompressionRequest = "none", pack_into: Path | None = None) -> None:
        self.directory = directory
        self._stop = threading.Event()
        self._files: dict[str, tuple[int, Partial]] = {}  # name -> (fd, partial)
        self._buffer = bytearray(_CHUNK)
        self._writeback = writeback
        self._sync = _sync_file_range() if writeback else None
        self._failed: BaseException | None = None
        self._auto = compression == "auto"
        self._codec: Compression | None = None
        if pack_into is not None and compression != "none":
            self._codec = "zstd" if self._auto else cast(Compression, compression)
        self._pack_into = pack_into
        self._raw = 0
        self._packed = 0
        self.compression: Compression | None = "none" if compression == "none" else None
        self._thread = threading.Thread(target=self._run, name="stasis-tailhash", daemon=True)
        self._thread.start()

    def finish(self) -> dict[str, Partial]:
        """Stop following (the writer is done) and return what was hashed, by file name."""
        self._stop.set()
        self._thread.join()
        if self._failed is not None:
            # Not an error for the dump: publish hashes (and compresses) every file itself. All
            # is dropped, since a failed write can leave a hasher ahead of its packing.
            log.debug("tail hashing of %s stopped early: %s", self.directory, self._failed)
            self._give_up_packing()
            self.compression = "none" if self.compression == "none" else None
            partials = {}
        else:
            if self._codec is not None:
                if self._auto and self._raw < AUTO_MIN_BYTES:
                    self._give_up_packing()  # too little seen: publish decides from the files
                else:
                    self.compression = self._codec
            partials = {name: partial for name, (fd, partial) in self._files.items()}
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()
        return partials

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sweep():
                    self._stop.wait(_IDLE_S)
        except OSError as e:
            self._failed = e

    def _sweep(self) -> bool:
        """Hash whatever was appended since the last sweep; True if anything was."""
        progressed = False
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return False
        for entry in entries:
            if not (entry.name.startswith("pages-") and entry.name.endswith(".img")):
                continue
            if entry.name not in self._files:
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                self._files[entry.name] = (fd, Partial(0, xxhash.xxh3_128(),
                                                       self._start_packing(entry.name)))
            fd, partial = self._files[entry.name]
            size = os.fstat(fd).st_size
            view = memoryview(self._buffer)
            start = partial.offset
            while partial.offset < size and not self._stop.is_set():
                n = os.preadv(fd, [view[:min(_CHUNK, size - partial.offset)]], partial.offset)
                if n <= 0:
                    break
                partial.hasher.update(view[:n])
                if partial.packing is not None:
                    before = partial.packing.packed
                    partial.packing.write(view[:n])
                    self._raw += n
                    self._packed += partial.packing.packed - before
                partial.offset += n
                progressed = True
                if self._auto and self._codec is not None and self._raw >= AUTO_JUDGE_BYTES \
                        and self._packed > self._raw * AUTO_MAX_RATIO:
                    self._give_up_packing()
                    self.compression = "none"
                    if self._writeback:
                        start = 0  # the staged files are the stored ones after all
            if self._sync is not None and self._codec is None and partial.offset > start:
                self._sync(fd, start, partial.offset - start, _SYNC_FILE_RANGE_WRITE)
        return progressed

    def _start_packing(self, name: str) -> Packing | None:
        if self._codec is None or self._pack_into is None:
            return None
        path = self._pack_into / stored_name(name, self._codec)
        # O_EXCL: never follow a link planted where an image is going.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        return Packing(Encoder(self._codec), os.fdopen(fd, "wb"), path)

    def _give_up_packing(self) -> None:
        self._codec = None
        for _, partial in self._files.values():
            if partial.packing is not None:
                partial.packing.drop()
                partial.packing = None
