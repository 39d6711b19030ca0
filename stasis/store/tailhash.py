"""Hash CRIU's page images while CRIU is still writing them.

Publishing used to read every image once more after the dump, ~0.1 s per 256 MiB on these
machines, all of it added to the time the caller waits (and, for a dump that stops the job, to the
time the job is down). CRIU writes each pages-*.img front to back and never goes back, so a thread
can follow the files as they grow, on the CPU that CRIU leaves idle, and hand the publish a hash
that only needs the last few MiB. On a disk store it also starts the write-back of what it has
read (sync_file_range), so the fsync before the manifest waits for the tail, not for everything.

The partial hashes are a shortcut only: publish checks each against the file's final size and
re-reads any file that does not fit, so a wrong guess costs time, never a wrong checksum.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import xxhash

log = logging.getLogger(__name__)

_CHUNK = 8 << 20
_IDLE_S = 0.003
_SYNC_FILE_RANGE_WRITE = 2


@dataclass
class Partial:
    """The first `offset` bytes of one file, already fed to `hasher`."""

    offset: int
    hasher: xxhash.xxh3_128


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
    disk; pointless on tmpfs).
    """

    def __init__(self, directory: Path, writeback: bool = False) -> None:
        self.directory = directory
        self._stop = threading.Event()
        self._files: dict[str, tuple[int, Partial]] = {}  # name -> (fd, partial)
        self._buffer = bytearray(_CHUNK)
        self._sync = _sync_file_range() if writeback else None
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="stasis-tailhash", daemon=True)
        self._thread.start()

    def finish(self) -> dict[str, Partial]:
        """Stop following (the writer is done) and return what was hashed, by file name."""
        self._stop.set()
        self._thread.join()
        partials = {name: partial for name, (fd, partial) in self._files.items()}
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()
        if self._failed is not None:
            # Not an error for the dump: each partial is still whole up to its offset, and
            # publish hashes the rest of every file itself.
            log.debug("tail hashing of %s stopped early: %s", self.directory, self._failed)
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
                self._files[entry.name] = (fd, Partial(0, xxhash.xxh3_128()))
            fd, partial = self._files[entry.name]
            size = os.fstat(fd).st_size
            view = memoryview(self._buffer)
            start = partial.offset
            while partial.offset < size and not self._stop.is_set():
                n = os.preadv(fd, [view[:min(_CHUNK, size - partial.offset)]], partial.offset)
                if n <= 0:
                    break
                partial.hasher.update(view[:n])
                partial.offset += n
                progressed = True
            if self._sync is not None and partial.offset > start:
                self._sync(fd, start, partial.offset - start, _SYNC_FILE_RANGE_WRITE)
        return progressed
