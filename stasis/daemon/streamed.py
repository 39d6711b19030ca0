"""Full restore of a checkpoint in a local store that CRIU may not read in place (compressed,
encrypted, or in a directory others can write: store.images_in_place), decoded while CRIU reads
it: CRIU restores with `--stream` from our image streamer (stasis/engine/streamer.py), which
decodes each page file chunk by chunk into the pipe CRIU reads, every chunk checked (its AES-GCM
tag or its BLAKE3 hash in the signed manifest) before CRIU sees a byte of it. What is checked is
the daemon's own copy of the chunk, the very bytes handed to the pipe: a store writer changing
the file afterwards changes nothing CRIU gets. No plain copy is written first, and decoding runs
on one core while CRIU fills the tree's memory on the other.

The small images are fetched (decoded, verified) into a private directory first, as a lazy
restore does; the page files are served straight from the store. The restored tree resumes only
once every page file was served whole and checked (the supervisor's gate): a chunk that fails
fails the restore, and nothing runs on bytes that did not verify.

Checkpoints this cannot serve (pages in a parent checkpoint, stored before images were chunked)
are restored as before (stasis/daemon/lazystore.py, or a decoded copy).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from stasis.engine.pageserver import PagemapError, process_pagemaps
from stasis.engine.streamer import ImageServer, PipeWriter
from stasis.errors import ReaderGone, StasisError
from stasis.store import Manifest, Store
from stasis.store.reader import PAGES

log = logging.getLogger("stasis.daemon")

_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


class StreamedRestore:
    """One streamed restore: its private directory (small images and the streamer's socket),
    its image server, and the first error a page file met."""

    def __init__(self, store: Store, manifest: Manifest, scratch: Path) -> None:
        self.store = store
        self.manifest = manifest
        scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.images = Path(tempfile.mkdtemp(prefix=f"{manifest.id}-stream-", dir=scratch))
        self._pages = {f.name for f in manifest.files if PAGES.match(f.name)}
        self._server: ImageServer | None = None
        self._lock = threading.Lock()
        self.error: StasisError | None = None

    def prepare(self) -> None:
        """Fetch (verified) every image but the page files and start listening. StasisError
        if the checkpoint cannot be had; PagemapError if this path cannot serve it."""
        if not self.store.reader.by_range(self.manifest):
            raise PagemapError("it was stored before images were chunked")
        self.store.reader.fetch_files(
            self.manifest, self.images, only=lambda f: f.name not in self._pages
        )
        pagemaps = process_pagemaps(self.images)
        if any(pm.in_parent() for pm in pagemaps.values()):
            raise PagemapError("its pages lean on a parent checkpoint")
        self._server = ImageServer(self.images, self._source)

    def check(self) -> None:
        """The gate: returns once every page file was served whole and checked (or CRIU went
        away: its own answer says why); raises the error a page file met."""
        assert self._server is not None
        self._server.wait(self._pages)
        if self.error is not None:
            raise self.error
        if self._server.failure is not None:
            raise StasisError(
                f"restore of checkpoint {self.manifest.id}: " f"{self._server.failure}"
            )

    def stop_waiting(self) -> None:
        """The restore answered before the gate was passed (it failed before CRIU read its
        images, or CRIU never came): `check` returns."""
        if self._server is not None:
            self._server.close()

    def discard(self) -> None:
        """The restore is over (or never started): stop serving, remove the small images."""
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self.images, ignore_errors=True)

    def _source(self, name: str) -> Callable[[PipeWriter], None] | None:
        if name in self._pages:
            return lambda out: self._stream_pages(name, out)
        if not _SAFE_NAME.match(name) or name.startswith("."):
            return None
        path = self.images / name
        if not path.is_file():
            return None
        return lambda out: _send_file(path, out)

    def _stream_pages(self, name: str, out: PipeWriter) -> None:
        try:
            self.store.reader.stream_file(self.manifest, name, out)
        except ReaderGone:
            raise
        except StasisError as e:
            with self._lock:
                if self.error is None:
                    self.error = e
            log.error("restore of checkpoint %s: %s", self.manifest.id, e)
            raise


def _send_file(path: Path, out: PipeWriter) -> None:
    with open(path, "rb", buffering=0) as src:
        size = os.fstat(src.fileno()).st_size
        sent = 0
        while sent < size:
            try:
                n = os.sendfile(out.fd, src.fileno(), None, min(size - sent, 1 << 20))
            except BrokenPipeError:
                raise ReaderGone() from None
            if n == 0:
                raise OSError(f"{path.name} ended at byte {sent} of {size}")
            sent += n


def stream_restore(store: Store, manifest: Manifest, scratch: Path) -> StreamedRestore | None:
    """A prepared streamed restore of `manifest`, or None when this path cannot serve it (the
    caller restores it another way). StasisError when the checkpoint cannot be had."""
    streamed = StreamedRestore(store, manifest, scratch)
    try:
        streamed.prepare()
    except PagemapError as e:
        log.info("checkpoint %s is not restored streamed: %s", manifest.id, e)
        streamed.discard()
        return None
    except BaseException:
        streamed.discard()
        raise
    return streamed
