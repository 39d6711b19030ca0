"""Hash (and compress) CRIU's page images while CRIU is still writing them.

Publishing used to read every image once more after the dump, ~0.1 s per 256 MiB on these
machines, all of it added to the time the caller waits (and, for a dump that stops the job, to the
time the job is down). CRIU writes each pages-*.img front to back and never goes back, so a thread
can follow the files as they grow, on the CPU that CRIU leaves idle, and hand the publish a hash
that only needs the last few MiB. On a disk store it also starts the write-back of what it has
read (sync_file_range), so the fsync before the manifest waits for the tail, not for everything.

A compressed or encrypted dump is chunked, compressed and sealed the same way (chunked.py), into
the files the store will keep: `open_out(stored name)` makes each (`local_opener`: files in the
local store's packing directory, written back to disk as they grow; another opener can stream
them elsewhere). Publish then encodes only the tail. Only whole chunks are taken while CRIU
writes, so what publish continues is always at a chunk boundary. An uncompressed encrypted image
of a local store is sealed in place (`seal_in_place`, `InPlaceOutput`): each chunk CRIU finished
is overwritten by its ciphertext, which is as long, and publish renames the file, as it does a
plain one; CRIU only appends, so it never sees (or rewrites) what was sealed behind it. Such a
file can no longer be encoded again from its start: a follower that fails after sealing part of
one says so (`Partial.spoiled`), and publish fails instead of sealing ciphertext as if plain.

With `auto` the follower compresses with zstd and watches what it gets: once a few MiB say the pages do not shrink to half, it drops what it compressed and
goes on uncompressed (from the start of each file, re-reading a few MiB), so incompressible memory costs a few MiB of zstd, not a whole pass.

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
from typing import Protocol, cast

from stasis.store.chunked import CHUNK_BYTES, ChunkSpec, ChunkWriter
from stasis.store.compression import AUTO_MAX_RATIO, stored_name
from stasis.store.crypt import ChunkCipher
from stasis.store.manifest import Compression, CompressionRequest

log = logging.getLogger(__name__)

_READ_CHUNKS = 8  # chunks read per pread while following
_IDLE_S = 0.003
_SYNC_FILE_RANGE_WRITE = 2
# `auto` judges the pages after this many bytes (and again after every chunk): the same amount
# the sample of `choose_compression` reads, and the same rule (compress at half or less).
AUTO_JUDGE_BYTES = 4 << 20
AUTO_MIN_BYTES = 1 << 20  # below this, checkpoints are not compressed (choose_compression)


class Output(Protocol):
    """Where a follower writes one stored file: written in order, then closed, or discarded
    (closed and removed: publish encodes that file again)."""

    def write(self, data: bytes | memoryview, /) -> int | None: ...

    def close(self) -> None: ...

    def discard(self) -> None: ...


Opener = Callable[[str], Output]


class _FileOutput:
    """A local file written in order from `written` on, its pages sent to disk as they are
    written when `writeback`."""

    def __init__(self, path: Path, flags: int, writeback: bool) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | flags, 0o600)
        self._sync = _sync_file_range() if writeback else None
        self.written = 0

    def write(self, data: bytes | memoryview, /) -> int:
        view = memoryview(data)
        start = self.written
        while view:
            n = os.pwrite(self._fd, view, self.written)
            view = view[n:]
            self.written += n
        if self._sync is not None:
            self._sync(self._fd, start, self.written - start, _SYNC_FILE_RANGE_WRITE)
        return len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalOutput(_FileOutput):
    """A new file in a local directory (O_EXCL: never a link planted where an image goes)."""

    def __init__(self, path: Path, writeback: bool) -> None:
        super().__init__(path, os.O_CREAT | os.O_EXCL, writeback)

    def discard(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


class InPlaceOutput(_FileOutput):
    """The staged file itself: what is written overwrites it from its start, at the offsets
    the plain bytes had (each write as long as what it replaces: a sealed, uncompressed chunk).
    Pages go to disk as they are sealed when `writeback`; never before (they were plain)."""

    def __init__(self, path: Path, writeback: bool) -> None:
        super().__init__(path, os.O_NOFOLLOW, writeback)
        # Some plain bytes were overwritten and the table that opens them was dropped.
        self.spoiled = False

    def discard(self) -> None:
        self.close()
        self.spoiled = self.spoiled or self.written > 0


def local_opener(directory: Path, writeback: bool = False) -> Opener:
    return lambda name: LocalOutput(directory / name, writeback)


@dataclass
class Partial:
    """The first `offset` bytes of one file (a multiple of the chunk size), already taken by
    `writer`, which writes to `output` (None: it only checksums, the file itself is stored)."""

    writer: ChunkWriter
    output: Output | None = None
    stored_name: str = ""
    # The staged file was sealed in part, in place, and what opens it was dropped: it cannot
    # be published any more (see InPlaceOutput).
    spoiled: bool = field(default=False, init=False)

    @property
    def offset(self) -> int:
        return self.writer.offset

    def discard(self) -> None:
        self.writer.close()
        if self.output is not None:
            self.output.discard()
            if isinstance(self.output, InPlaceOutput) and self.output.spoiled:
                self.spoiled = True
            self.output = None


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
    `compression` and `cipher` with `open_out`: also encode each image into `open_out(<stored
    name>)` ("auto": zstd while the pages shrink to half or less). `compression` says what was
    settled on once `finish()` returned: the codec, "none", or None (auto saw too little to
    judge). Without `open_out` only uncompressed images are followed (sealed in place with
    `cipher` and `seal_in_place`).
    `seal_in_place`: uncompressed images are sealed where they are (InPlaceOutput) rather than
    into `open_out`, for a store that keeps the staged files (a local one).
    `copy_plain`: uncompressed, unencrypted images go to `open_out` too (a store that keeps
    them elsewhere, S3 say, uploads them while CRIU writes).
    """

    def __init__(
        self,
        directory: Path,
        writeback: bool = False,
        compression: CompressionRequest = "none",
        open_out: Opener | None = None,
        cipher: ChunkCipher | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        seal_in_place: bool = False,
        copy_plain: bool = False,
    ) -> None:
        self.directory = directory
        self._copy_plain = copy_plain and open_out is not None
        self._stop = threading.Event()
        self._files: dict[str, tuple[int, Partial]] = {}  # name -> (fd, partial)
        self._chunk = chunk_bytes
        self._buffer = bytearray(chunk_bytes * _READ_CHUNKS)
        self._writeback = writeback
        self._sync = _sync_file_range() if writeback else None
        self._failed: BaseException | None = None
        self._auto = compression == "auto"
        self._cipher = cipher
        self._open_out = open_out
        self._in_place = seal_in_place and cipher is not None
        self._codec: Compression = "zstd" if self._auto else cast(Compression, compression)
        self._raw = 0
        self.compression: Compression | None = "none" if compression == "none" else None
        # Partials that were dropped after sealing part of their file in place: publish must
        # see them, and refuse.
        self._spoiled: dict[str, Partial] = {}
        if open_out is None and (
            self._codec != "none" or (cipher is not None and not self._in_place)
        ):
            raise ValueError("encoding images while CRIU writes them needs open_out")
        self._thread = threading.Thread(target=self._run, name="stasis-tailhash", daemon=True)
        self._thread.start()

    def finish(self) -> dict[str, Partial]:
        """Stop following (the writer is done) and return what was taken, by file name."""
        self._stop.set()
        self._thread.join()
        if self._failed is not None:
            # Not an error for the dump: publish hashes (and encodes) every file itself. All
            # is dropped, since a failed write can leave a writer ahead of its output.
            log.debug("tail hashing of %s stopped early: %s", self.directory, self._failed)
            self._drop_all()
            self.compression = "none" if self.compression == "none" else None
        elif self._auto and self.compression is None:
            if self._raw < AUTO_MIN_BYTES:
                self._drop_all()  # too little seen: publish decides from the files
            else:
                self.compression = self._codec
        partials = {
            **self._spoiled,
            **{name: partial for name, (fd, partial) in self._files.items()},
        }
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

    def _spec(self) -> ChunkSpec:
        return ChunkSpec(self._codec, self._cipher, self._chunk)

    def _start(self, name: str) -> Partial:
        spec = self._spec()
        if spec.identity and not self._copy_plain:
            return Partial(ChunkWriter(name, spec, None))
        stored = stored_name(name, spec.compression, spec.encrypted)
        if self._in_place and spec.compression == "none":
            sealer = InPlaceOutput(self.directory / name, self._writeback)
            return Partial(ChunkWriter(name, spec, sealer), sealer, stored)
        assert self._open_out is not None
        output = self._open_out(stored)
        return Partial(ChunkWriter(name, spec, output), output, stored)

    def _sweep(self) -> bool:
        """Take whatever whole chunks were appended since the last sweep; True if any was."""
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
                self._files[entry.name] = (fd, self._start(entry.name))
            fd, partial = self._files[entry.name]
            size = os.fstat(fd).st_size
            # Whole chunks with at least a byte after them: CRIU may be in the middle of the
            # next one, and a chunk taken here is known not to be the file's last.
            whole = (size - 1) // self._chunk * self._chunk if size else 0
            view = memoryview(self._buffer)
            start = partial.offset
            while partial.offset < whole and not self._stop.is_set():
                want = min(len(view), whole - partial.offset)
                n = os.preadv(fd, [view[:want]], partial.offset)
                n -= n % self._chunk
                if n <= 0:
                    break
                for at in range(0, n, self._chunk):
                    partial.writer.add(view[at : at + self._chunk], last=False)
                self._raw += n
                progressed = True
                if self._auto and self.compression is None and self._shrinks() is False:
                    self._give_up_compressing()
                    return True  # every file starts again, uncompressed
            if self._sync is not None and partial.output is None and partial.offset > start:
                self._sync(fd, start, partial.offset - start, _SYNC_FILE_RANGE_WRITE)
        return progressed

    def _shrinks(self) -> bool | None:
        """Whether what zstd compressed so far shrank to half; None until it saw enough."""
        writers = [p.writer for _, p in self._files.values()]
        encoded = sum(w.encoded for w in writers)
        if encoded < AUTO_JUDGE_BYTES:
            return None
        return sum(w.stored_total for w in writers) <= encoded * AUTO_MAX_RATIO

    def _give_up_compressing(self) -> None:
        """`auto` saw pages that do not shrink: what was compressed goes, and every file is
        taken again from its start without compression (sealed still, when encrypted)."""
        self._codec = "none"
        self.compression = "none"
        for name, (fd, partial) in list(self._files.items()):
            partial.discard()
            self._files[name] = (fd, self._start(name))

    def _drop_all(self) -> None:
        for name, (_, partial) in self._files.items():
            partial.discard()
            if partial.spoiled:
                self._spoiled[name] = partial
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()
