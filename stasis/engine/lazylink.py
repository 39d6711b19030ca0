"""The link between a lazy restore's `criu lazy-pages` and the page server that feeds it, kept
so that a server that goes away can never let the kernel hand the tree zero pages.

lazy-pages exits when its page server's socket closes, and the kernel then fills whatever
memory had not arrived yet with zeros. The server is another process (the daemon). So the
restoring process (the job's supervisor) makes the socket itself: a socketpair whose one end
lazy-pages inherits, the other handed to the server over a control connection (SCM_RIGHTS),
and a copy of that server end stays here. Should the server's process die, lazy-pages sees no
hangup (our copy holds the socket open): the tree's faults wait, and the control connection's
end tells us. We kill the tree first, and only then let lazy-pages go.

The server says it is done, by one byte on the control connection, when it stopped serving
for its own reasons (all pages sent, or it had the tree killed for a page it could not have).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable

from stasis.engine import proctree

# What the server sends on the control connection when it stops serving of its own accord.
DONE = b"."
# How long a lost server's link waits for the restore to say which tree it made.
_PID_WAIT_S = 120.0


class PageServerLink:
    """Connects to the page server listening at `path` and hands it its end of a fresh
    socketpair. `lazy_pages_fd` goes to `criu lazy-pages --ps-socket`; call `spawned` once it
    runs, `tree` once the restore answered. `on_lost(reason)` is called before a tree is
    killed because the server went away."""

    def __init__(
        self, connect: socket.socket, on_lost: Callable[[str], None] | None = None
    ) -> None:
        self._ctrl = connect
        self._on_lost = on_lost
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._ours: socket.socket | None = ours
        self._theirs: socket.socket | None = theirs
        socket.send_fds(connect, [b"S"], [ours.fileno()])
        self.lost: str | None = None  # why the tree was killed, when the server went away
        self._lazy_pages: int | None = None
        self._pid: int | None = None
        self._pid_known = threading.Event()
        self._lock = threading.Lock()
        self._closing = False
        self.ended = threading.Event()  # the server is done with this restore, one way or another
        threading.Thread(target=self._watch, name="stasis-page-link", daemon=True).start()

    @property
    def lazy_pages_fd(self) -> int:
        assert self._theirs is not None
        return self._theirs.fileno()

    def spawned(self, lazy_pages: subprocess.Popen[bytes] | None) -> None:
        """lazy-pages runs with its copy of our socket's other end (None: it did not start)."""
        self._lazy_pages = lazy_pages.pid if lazy_pages is not None else None
        if self._theirs is not None:
            self._theirs.close()
            self._theirs = None

    def tree(self, pid: int | None) -> None:
        """The restored tree's root (None: the restore failed, there is nothing to guard)."""
        self._pid = pid
        self._pid_known.set()
        if pid is None:
            self.close()

    def close(self) -> None:
        """Nothing to guard any more (the restore failed): let everything go."""
        self._closing = True
        with self._lock:
            for sock in (self._ours, self._theirs):
                if sock is not None:
                    sock.close()
            self._ours = self._theirs = None
        try:
            self._ctrl.shutdown(socket.SHUT_RDWR)  # wakes the watcher's recv; close would not
        except OSError:
            pass
        self._ctrl.close()

    def _watch(self) -> None:
        try:
            said = self._ctrl.recv(1)
        except OSError:
            said = b""
        if not said and not self._closing and not self._lazy_pages_done():
            self.lost = "the page server went away before all of the job's memory was back"
            self._pid_known.wait(_PID_WAIT_S)
            if self._pid is not None:
                if self._on_lost is not None:
                    self._on_lost(self.lost)  # before its end: whoever sees it ended knows why
                kill_tree(self._pid)
        with self._lock:
            if self._ours is not None:
                self._ours.close()  # lazy-pages hears the hangup now, and ends
                self._ours = None
        self.ended.set()

    def _lazy_pages_done(self) -> bool:
        """Whether lazy-pages already exited well: all memory was back before the server went.
        Looked at without reaping it (its parent's wait loop does that)."""
        if self._lazy_pages is None:
            return False
        try:
            info = os.waitid(os.P_PID, self._lazy_pages, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        return info is not None and info.si_code == os.CLD_EXITED and info.si_status == 0


def kill_tree(pid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL every process of the tree under `pid` and wait for its root to be dead (a job's
    root is the init of its PID namespace: once it is gone, so is everything in it)."""
    proctree.signal_tree(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.002)


def _alive(pid: int) -> bool:
    try:
        return proctree.alive(pid, None)
    except OSError:
        return False  # cannot tell: the wait is bounded anyway
