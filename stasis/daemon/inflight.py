"""Dumps in flight, written down, so that a daemon killed during one can undo it at its next start.

A dump that stops its job keeps the tree stopped (SIGSTOP) until the checkpoint is published,
and CRIU writes the images into a staging directory that only a finished dump consumes. A daemon
killed (kill -9, OOM) in between left the job frozen forever while listed running, and hundreds
of MiB of staging. So each dump gets a small file under `<state_dir>/dumps/` for as long as it
runs: which checkpoint, which tree (pid and start time, so a recycled pid is never taken for it),
which CRIU process (a CRIU outlives a killed daemon and may still hold the tree). A file that is
still there when the daemon starts is a dump that never finished: it is this node's own, so its
staging goes at once (no idle hour, as for staging another node of a shared store may be using),
and its tree is resumed (see `JobManager.recover_dumps`).

The files are not fsynced: they only matter after the daemon died, and its writes are in the
page cache by then; a crash of the whole node takes the stopped jobs with it.

An entry ends only once its tree was killed or resumed and what the dump did is recorded in the
job database: one whose record failed (the database locked or corrupt) stays, and is settled
again until it can be (`Dumper.settle_pending`); its tree is never left stopped meanwhile.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from stasis.atomicfile import write_atomically
from stasis.store import is_checkpoint_id


@dataclass
class InFlightDump:
    checkpoint: str
    job: str  # the job's id (a stasis job, or a Slurm job)
    pid: int
    pid_start: int | None
    leave_running: bool
    criu_pid: int | None = None
    criu_start: int | None = None
    # Set once the checkpoint is in the store, before anything else is recorded: a daemon that
    # starts then knows the stop asked is to be carried out (kill), not undone (resume),
    # without asking a store that may be unreachable.
    published: bool = False


class DumpJournal:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._entries: dict[str, InFlightDump] = {}
        self._lock = threading.Lock()

    def prepare(self) -> None:
        self.directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.directory, 0o700)

    def _path(self, checkpoint_id: str) -> Path:
        return self.directory / f"{checkpoint_id}.json"

    def _write(self, entry: InFlightDump) -> None:
        # Atomically: a reader never sees half of it.
        # Not synced to disk: it guards against the daemon's death, and a node that crashes
        # takes its frozen trees with it (and a fsync here would wait on a busy disk).
        write_atomically(
            self._path(entry.checkpoint), json.dumps(asdict(entry)).encode(), durable=False
        )

    def begin(self, entry: InFlightDump) -> None:
        with self._lock:
            self._entries[entry.checkpoint] = entry
            self._write(entry)

    def note_criu(self, checkpoint_id: str, criu_pid: int, criu_start: int | None) -> None:
        """The CRIU process that dumps `checkpoint_id` (it outlives a killed daemon)."""
        with self._lock:
            entry = self._entries.get(checkpoint_id)
            if entry is not None:
                entry.criu_pid, entry.criu_start = criu_pid, criu_start
                self._write(entry)

    def mark_published(self, checkpoint_id: str) -> None:
        with self._lock:
            entry = self._entries.get(checkpoint_id)
            if entry is not None:
                entry.published = True
                self._write(entry)

    def entry(self, checkpoint_id: str) -> InFlightDump | None:
        with self._lock:
            return self._entries.get(checkpoint_id)

    def end(self, checkpoint_id: str) -> None:
        with self._lock:
            self._entries.pop(checkpoint_id, None)
            self._path(checkpoint_id).unlink(missing_ok=True)

    def active(self) -> set[str]:
        """The checkpoint ids of the dumps recorded now."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return set()
        return {n.removesuffix(".json") for n in names if n.endswith(".json")}

    def leftovers(self) -> list[InFlightDump]:
        """What the previous daemon recorded and never ended (call before any dump starts).
        Unreadable files (a write cut short) are dropped: nothing can be done with them."""
        found = []
        for name in sorted(self.active()):
            path = self._path(name)
            try:
                entry = InFlightDump(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                path.unlink(missing_ok=True)
                continue
            if is_checkpoint_id(entry.checkpoint):
                found.append(entry)
            else:
                path.unlink(missing_ok=True)
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        return found
