"""Lazy restore from a store CRIU cannot read in place (not a local directory, or compressed):
the small images and the pages the restore reads itself are fetched into a scratch directory
(the page files as sparse files of their full size), and the daemon serves the rest, on demand
and in the background, over CRIU's page-server protocol (stasis/engine/pageserver.py) to the
job's `criu lazy-pages`, from the store.

A page that cannot be had (the store fails, a chunk does not verify) kills the restored tree
before lazy-pages hears of it (it would let the kernel hand the tree zero pages): the job ends,
`killed.json` in its directory and the daemon's log say why.

The pages are served by the daemon process. A daemon that dies before every page arrived
takes the server with it: the job's supervisor, which holds the other end of the socket
lazy-pages reads, then kills the job before lazy-pages can end (engine/lazylink.py), so that
it never reads zeros for what was missing; `killed.json` says so. A graceful stop waits for
those restores to finish (`drain`).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path

from stasis.daemon.supervisorwire import note_killed
from stasis.engine import proctree
from stasis.engine.lazylink import DONE
from stasis.engine.pageserver import (
    PagemapError,
    PageReader,
    PageServer,
    fill_sparse,
    process_pagemaps,
)
from stasis.store import Manifest, Store
from stasis.store.reader import PAGES

log = logging.getLogger("stasis.daemon")

SOCKET_NAME = "page-server.sock"
# How long a page that cannot be had waits for the restore's answer before it ends the restore.
_ANSWER_S = 1.0


def _peer_pid(conn: socket.socket) -> int | None:
    pid, _, _ = struct.unpack(
        "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    return pid if pid > 0 else None


def page_reader(store: Store, manifest: Manifest) -> PageReader | None:
    """How the plaintext of the checkpoint's page files is read by range:
    `ImageReader.read_range_views`, which verifies every chunk it reads (its checksum, or its
    tag when encrypted). None for a checkpoint stored before images were chunked (no table to
    read ranges by): the caller restores it in full."""
    if not store.reader.by_range(manifest):
        return None
    return lambda name, offset, length: store.reader.read_range_views(
        manifest, name, offset, length
    )


class LazyRestore:
    """One lazy restore served from the store: its scratch images, its page server, and what
    to kill should a page not come."""

    def __init__(
        self,
        store: Store,
        manifest: Manifest,
        read: PageReader,
        scratch: Path,
        delay_s: float = 0.0,
    ) -> None:
        self.store = store
        self.manifest = manifest
        self._read = read
        self._delay_s = delay_s
        scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.images = Path(tempfile.mkdtemp(prefix=f"{manifest.id}-lazy-", dir=scratch))
        self.socket_path = self.images / SOCKET_NAME
        self._sizes: dict[str, int] = {}
        self._listener: socket.socket | None = None
        self._server: PageServer | None = None
        self._job: tuple[int | None, Path | None] = (None, None)
        self._started = threading.Event()
        self._restoring: int | None = None
        self.done = threading.Event()
        self.failure: str | None = None

    # -- before the restore ------------------------------------------------------------------

    def prepare(self) -> None:
        """Fetch (verified) every image but the page files, and of each page file what the
        restore reads itself; start listening. StasisError (CorruptCheckpointError...) if the
        checkpoint cannot be had; PagemapError if it is not one this path serves."""
        pages = [f for f in self.manifest.files if PAGES.match(f.name)]
        self.store.reader.fetch_files(self.manifest, self.images, only=lambda f: f not in pages)
        pagemaps = process_pagemaps(self.images)
        by_file = {pm.pages_file: pm for pm in pagemaps.values()}
        if len(by_file) != len(pagemaps) or any(pm.in_parent() for pm in pagemaps.values()):
            raise PagemapError("its pagemaps share page files or lean on a parent checkpoint")
        sizes = {f.name: f.size_bytes for f in pages}
        for entry in pages:
            pm = by_file.get(entry.name)
            # Page files no task's pagemap names (shared memory's) are read whole by the restore.
            ranges = pm.eager_ranges() if pm else [(0, entry.size_bytes)]
            fill_sparse(self.images / entry.name, entry.size_bytes, ranges, self._read, entry.name)
        self._sizes = sizes
        self._listen()

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        dir_fd = os.open(self.images, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # Through /proc: sun_path holds 107 bytes, a state directory's path may be longer.
            listener.bind(f"/proc/self/fd/{dir_fd}/{SOCKET_NAME}")
        finally:
            os.close(dir_fd)
        listener.listen(1)
        self._listener = listener
        threading.Thread(target=self._accept, name="stasis-page-accept", daemon=True).start()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            self._listener.settimeout(60.0)  # the supervisor connects at the restore's start
            conn, _ = self._listener.accept()
            self._restoring = _peer_pid(conn)  # the job's supervisor, under which CRIU runs
        except OSError:
            self._finish()
            return
        finally:
            self._listener.close()
        # The directory is root's alone (0700): only the job's supervisor could have connected.
        # It hands us our end of the socket lazy-pages reads (engine/lazylink.py) and keeps
        # this connection open: its end is how it learns that we are gone.
        try:
            conn.settimeout(10.0)
            _, fds, _, _ = socket.recv_fds(conn, 1, 1)
            conn.settimeout(None)
        except OSError:
            fds = []
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            conn.close()
            self._finish()
            return
        self._server = PageServer(
            socket.socket(fileno=fds[0]),
            self.images,
            self._sizes,
            self._read,
            self._on_failure,
            delay_s=self._delay_s,
        )
        try:
            self._server.serve()
        finally:
            try:
                conn.sendall(DONE)  # stopped of our own accord: nothing for it to guard
            except OSError:
                pass
            conn.close()
            self._finish()

    # -- after the restore -------------------------------------------------------------------

    def started(self, pid: int | None, job_dir: Path | None) -> None:
        """The restore ended: its tree's pid (None: it failed, nothing to kill)."""
        self._job = (pid, job_dir)
        self._started.set()
        if pid is None and self._listener is not None:
            self._listener.close()

    def _on_failure(self, reason: str) -> None:
        self.failure = reason
        # The tree is waiting for this very page: it runs no further until killed, so waiting
        # for its pid (the restore's answer is on its way) feeds it nothing. Unless the one
        # waiting is CRIU's own restorer (it touches the tasks' memory before they resume: a
        # Python 3.13 job's rseq area, say): then no answer comes until the restore is ended.
        if not self._started.wait(_ANSWER_S):
            self._end_restore()
            self._started.wait(60.0)  # its answer, a failure, follows
        pid, job_dir = self._job
        if pid is None:
            return
        # The reason goes down before the kill: the job's supervisor records its end as soon as
        # the tree dies, and an end seen without killed.json would read as a plain exit.
        if job_dir is not None:
            note_killed(job_dir, reason)
        started = proctree.start_time(pid)
        tree = proctree.tree(pid)
        proctree.signal_tree(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(proctree.alive(p, None) for p in tree):
            time.sleep(0.005)
        log.error(
            "killed lazily restored job %s (pid %d%s): a page could not be had from the "
            "store: %s",
            job_dir.name if job_dir else "?",
            pid,
            "" if started else ", already gone",
            reason,
        )

    def _end_restore(self) -> None:
        """Kill everything under the job's supervisor (CRIU, lazy-pages, the tasks being
        restored): the restore fails, naming the page that could not be had."""
        if self._restoring is None:
            return
        under = proctree.tree(self._restoring)[1:]
        for pid in under:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.error(
            "ended a lazy restore of %s under supervisor %d: a page could not be had "
            "from the store",
            self.manifest.id,
            self._restoring,
        )

    def _finish(self) -> None:
        shutil.rmtree(self.images, ignore_errors=True)
        self.done.set()

    def discard(self) -> None:
        """The restore did not happen: stop listening, remove the scratch images."""
        self.started(None, None)
        if self._server is None:
            self._finish()
