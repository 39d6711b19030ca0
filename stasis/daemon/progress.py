"""How far a dump or restore has come, told every 0.2 s to whoever asked while it runs."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from stasis.engine import proctree

# (bytes done, bytes expected) while a dump or restore runs.
Progress = Callable[[int, int], None]


class Watcher:
    """Calls `progress(done, expected)` every 0.2 s from a thread, and once more at the end."""

    def __init__(self, expected: int, progress: Progress) -> None:
        self.expected = expected
        self.progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _size(self) -> int:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.progress(self._size(), self.expected)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.progress(self._size(), self.expected)


class DirWatcher(Watcher):
    """How many bytes CRIU has written into the images directory so far (dump)."""

    def __init__(self, path: Path, expected: int, progress: Progress) -> None:
        self.path = path
        super().__init__(expected, progress)

    def _size(self) -> int:
        total = 0
        try:
            for entry in os.scandir(self.path):
                try:
                    total += entry.stat().st_size
                except OSError:
                    pass
        except OSError:
            pass
        return total


class ReadWatcher(Watcher):
    """How many bytes the restoring processes (CRIU and the tasks it forks) have read (restore)."""

    def __init__(self, shim_pid: int, expected: int, progress: Progress) -> None:
        self.shim_pid = shim_pid
        self._best = 0
        super().__init__(expected, progress)

    def _size(self) -> int:
        total = 0
        for pid in proctree.tree(self.shim_pid):
            try:
                for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                    if line.startswith("rchar:"):
                        total += int(line.split()[1])
            except OSError:
                continue
        # Processes come and go during a restore: never report going backwards.
        self._best = min(max(self._best, total), self.expected or total)
        return self._best
