"""How a restore's images reach CRIU: one `Source`, whatever the way.

The store's reader chooses the way a checkpoint fits (`ImageReader.choose`): in place, where
nobody but root can change the images (CRIU reads them while the daemon hashes them; the tree
resumes once that passed, a lazy one's pages are hashed right after it runs and the job killed on
a mismatch: damage, since no forger can write there); streamed from a local store (decoded and
checked while CRIU reads: stasis/daemon/streamed.py); by range for a lazy restore (pages served
by the daemon, each chunk checked as it is read: stasis/daemon/lazystore.py); or fetched, checked,
into a private directory first. A way that turns out not to fit once the small images are read
(pages in a parent checkpoint, no userfaultfd here) falls back to fetching, with a note.

A source, once entered, says where CRIU finds the images (`images`), what the restore's gate
checks before the tree resumes (`check`), what follows the restore (`started`), and cleans up
on exit.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType

from stasis.daemon.lazystore import LazyRestore, page_reader
from stasis.daemon.streamed import StreamedRestore, stream_restore
from stasis.daemon.supervisor import Started
from stasis.daemon.supervisorwire import Images, Restored, note_killed
from stasis.engine import nodelocal, proctree
from stasis.engine.pageserver import PagemapError
from stasis.errors import CorruptCheckpointError, StasisError
from stasis.store import FileEntry, Manifest, Store
from stasis.store.reader import Choice

log = logging.getLogger("stasis.daemon")


class ImageSources:
    """The sources of this daemon's restores: `scratch` holds what is fetched; `has_uffd`
    says whether CRIU can restore lazily here; `serving` hears of each lazy restore whose pages
    this process serves (a graceful stop waits for them)."""

    def __init__(
        self,
        store: Store,
        scratch: Path,
        has_uffd: Callable[[], bool],
        serving: Callable[[LazyRestore], None],
        page_delay_s: float = 0.0,
    ) -> None:
        self._store = store
        self._scratch = scratch
        self._has_uffd = has_uffd
        self._serving = serving
        self._page_delay_s = page_delay_s

    def source(self, manifest: Manifest, lazy: bool) -> Source:
        """The source of `manifest`'s images for a restore (`lazy` or in full), not yet
        prepared: nothing is fetched before it is entered. UntrustedCheckpointError for images
        only xxh3 checks."""
        return Source(self, self._store.reader.choose(manifest, lazy), lazy)


class Source:
    """The images of one restore, as the store's reader chose them (`way`), then as they were
    had (`mode`: "inplace", "streamed", "lazy" or "fetched"). Entering prepares them
    (StasisError when the checkpoint cannot be had); leaving removes what was fetched, but for
    a lazy restore's page server once it serves a running job."""

    def __init__(self, sources: ImageSources, choice: Choice, lazy: bool) -> None:
        self._sources = sources
        self._store = sources._store
        self.choice = choice
        self.lazy = lazy
        self.manifest = choice.manifest
        self.mode = ""
        self.images = Images(images="", lazy=False, gate=True)
        self.notes: list[str] = []
        self._check: Callable[[], None] = lambda: None
        self.cancel: Callable[[], None] | None = None
        self._streamed: StreamedRestore | None = None
        self._served: LazyRestore | None = None
        self._handed_over = False
        self._held = ExitStack()

    @property
    def in_place(self) -> bool:
        """CRIU reads the images where they are: the supervisor compares the node's files."""
        return self.choice.way == "inplace"

    def check(self) -> None:
        """The gate's check, before the restored tree resumes."""
        self._check()

    # -- preparing ----------------------------------------------------------------------------

    def __enter__(self) -> Source:
        try:
            way = self.choice.way
            if way == "inplace":
                self._in_place()
            elif way == "streamed" and self._stream():
                pass
            elif way == "ranged" and self._serve():
                pass
            else:
                self._fetch()
        except BaseException:
            self.close()
            raise
        return self

    def _in_place(self) -> None:
        assert self.choice.in_place is not None
        store, manifest = self._store, self.manifest
        self.mode = "inplace"
        # The node-local files are written out before CRIU runs, before the gate's hash of
        # the rest could catch damage: checked first (engine/nodelocal.py).
        store.reader.verify(manifest, only=_is_node_local)
        self.images = Images(images=str(self.choice.in_place), lazy=self.lazy, gate=True)
        if self.lazy:
            # A lazy job runs before its memory is back, so it cannot wait for the hash of
            # GiBs of pages either: everything else (and every size) gates the resume, the
            # page images are hashed right after, and a mismatch kills the job. Nobody but
            # root can write them here: that catches damage, there is no forger to stop.
            self._check = lambda: store.reader.verify(manifest, only=lambda f: not _is_pages(f))
        else:
            self._check = lambda: store.reader.verify(manifest)

    def _stream(self) -> bool:
        # Read, checked and decoded while CRIU reads them (its image streamer), rather than
        # written out in plain first and read again; the tree resumes once every page file
        # was served whole and checked.
        streamed = stream_restore(self._store, self.manifest, self._sources._scratch)
        if streamed is None:
            return False
        self._streamed = streamed
        self.mode = "streamed"
        self.images = Images(images=str(streamed.images), lazy=False, stream=True, gate=True)
        self._check = streamed.check
        self.cancel = streamed.stop_waiting
        return True

    def _serve(self) -> bool:
        """Serve the pages from the store by range; False (and a note) where this node cannot."""
        sources = self._sources
        read = page_reader(self._store, self.manifest)
        if read is None:
            return False
        if not sources._has_uffd():
            self.notes.append(
                "lazy restore not possible: this kernel has no userfaultfd for CRIU's "
                "lazy pages; restored in full"
            )
            return False
        served = LazyRestore(
            self._store, self.manifest, read, sources._scratch, delay_s=sources._page_delay_s
        )
        try:
            served.prepare()
        except PagemapError as e:
            served.discard()
            self.notes.append(f"lazy restore not possible: {e}; restored in full")
            return False
        except BaseException:
            served.discard()
            raise
        sources._serving(served)
        self._served = served
        self.mode = "lazy"
        self.images = Images(
            images=str(served.images), lazy=True, page_server=str(served.socket_path), gate=True
        )
        # The pages are checked as they are served: the gate is the daemon's word that the
        # job is recorded, no more.
        return True

    def _fetch(self) -> None:
        # Fetched and checked whole before CRIU reads them: the gate is the daemon's word that
        # the job is recorded (a daemon killed before it leaves no tree). Lazy pages would read
        # the images after the restore returns: not from a scratch copy that goes away.
        self.mode = "fetched"
        self.manifest, images = self._held.enter_context(
            self._store.reader.open_images(self.manifest.id, self._sources._scratch)
        )
        self.images = Images(images=str(images), lazy=False, gate=True)
        if self.lazy and not self.notes:
            self.notes.append(_why_not_lazy())

    # -- after the restore ------------------------------------------------------------------

    def started(self, started: Started[Restored], refused: bool) -> None:
        """The supervisor answered (`refused`: the gate did not let the tree resume). A lazy
        restore's page server learns the job it serves, or fails the restore with why a page
        could not be had; a lazy restore in place has its pages hashed now."""
        running = "pid" in started.answer
        if self._served is not None:
            if not running:
                if self._served.failure is not None:
                    raise CorruptCheckpointError(self._served.failure)
                return
            self._served.started(started.pid, started.job_dir)
            self._handed_over = True
        elif self.mode == "inplace" and self.lazy and running and not refused:
            threading.Thread(
                target=self._verify_pages_after,
                daemon=True,
                args=(started.job_dir, started.pid),
            ).start()

    def _verify_pages_after(self, job_dir: Path, pid: int) -> None:
        try:
            self._store.reader.verify(self.manifest, only=_is_pages)
        except StasisError as e:
            # Why, before the kill: the supervisor records the end as soon as the tree dies.
            note_killed(job_dir, str(e))
            if proctree.start_time(pid) is not None:
                proctree.signal_tree(pid, signal.SIGKILL)
            log.error("killed lazily restored job %s: %s", job_dir.name, e)

    def close(self) -> None:
        """Remove what this source fetched and stop what it serves, but a page server that
        serves a running job (it ends once all its memory is back)."""
        if self._streamed is not None:
            self._streamed.discard()
        if self._served is not None and not self._handed_over:
            self._served.discard()
        self._held.close()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _why_not_lazy() -> str:
    # Only checkpoints stored before images were chunked come here (page_reader).
    why = "the checkpoint was stored before images were chunked: its images were fetched"
    return (
        f"lazy restore not possible: {why} into scratch space that goes away after the "
        "restore; restored in full"
    )


def _is_node_local(entry: FileEntry) -> bool:
    return entry.name == nodelocal.ARCHIVE_NAME


def _is_pages(entry: FileEntry) -> bool:
    return entry.name.startswith("pages-")
