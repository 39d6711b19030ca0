"""Whose each job is and whether it still runs: the job table as the jobs' supervisors leave it
(each writes its job's exit status into the job's directory, exit.json).

A job's directory also holds `job.json` (its record, written before its supervisor started it)
and `pid.json` (its tree, written by the supervisor before it answered): a `restoring` row
becomes `restored` from them, and a job that runs without a row (a daemon killed between its
start and its record, a database rebuilt) is adopted at the daemon's start (`adopt_orphans`).
Adopted, not killed: its owner's work goes on and is listed, protected, and a restore asked
again finds it running under its checkpoint rather than starting it a second time.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import fields
from pathlib import Path
from typing import Any

from stasis.daemon.db import JobDatabaseError, JobDB, JobRow
from stasis.daemon.models import validate_job_id
from stasis.daemon.supervisor import Supervisors
from stasis.daemon.supervisorwire import EXIT_FILE, KILLED_FILE, read_exit, read_pid
from stasis.daemon.users import Caller
from stasis.engine import proctree
from stasis.errors import NotFoundError

log = logging.getLogger("stasis.daemon")


class JobTracker:
    def __init__(self, db: JobDB, supervisors: Supervisors) -> None:
        self.db = db
        self._supervisors = supervisors
        # Jobs found running whose record could not be rebuilt (the daemon is not ready).
        self.unadoptable: list[str] = []

    def row(self, job_id: str, caller: Caller) -> JobRow:
        row = self.db.get(validate_job_id(job_id))
        if row is None:
            raise NotFoundError(f"no job {job_id}; see `stasis ps`")
        caller.require(row.uid, f"job {job_id}")
        return row

    def send(self, row: JobRow, sig: signal.Signals) -> bool:
        """Send `sig` to the job's init if it still runs (the same process, not a recycled pid);
        whether it did."""
        if row.state not in ("running", "restored") or not row.pid:
            return False
        if not proctree.alive(row.pid, row.pid_start):
            return False
        try:
            os.kill(row.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def has_ended(self, row: JobRow) -> bool:
        """Whether the job's supervisor recorded its end (or both are gone). A stat and a /proc
        read or two: cheap enough to ask from the event loop every few ms."""
        if (Path(row.job_dir) / EXIT_FILE).exists():
            return True
        return not (row.pid and proctree.alive(row.pid, row.pid_start)) and not (
            row.shim_pid and proctree.alive(row.shim_pid, None)
        )

    def poll(self) -> None:
        """Record the end of every job whose supervisor wrote its exit status (or vanished)."""
        self._supervisors.reap()
        for row in self.db.live():
            # A job is `exited` only on what was seen: its status written, or its process and
            # supervisor gone. A failure to look (out of files, say) leaves it for next time.
            try:
                self._follow(row)
            except OSError as e:
                log.warning("cannot tell whether job %s still runs: %s", row.id, e)
            except JobDatabaseError as e:
                # Listing and the rest go on from what can be read; the next poll records it.
                log.warning("cannot record how job %s is now: %s", row.id, e)

    def _follow(self, row: JobRow) -> None:
        if row.state == "restoring" and self._settle_restoring(row):
            return
        job_dir = Path(row.job_dir)
        if (job_dir / EXIT_FILE).exists():
            ended = read_exit(job_dir)
            code = ended["exit_code"] if ended else None  # None: garbled, but the job did end
            # Killed by the daemon because its memory could not be had (a lazy restore whose
            # pages did not verify or did not come): killed.json says why.
            killed = (job_dir / KILLED_FILE).exists()
            self.db.finish(row.id, "failed" if killed else "exited", code)
        elif row.pid is None or not proctree.alive(row.pid, row.pid_start):
            if row.shim_pid and proctree.alive(row.shim_pid, None):
                return  # the supervisor is about to write the status
            if (job_dir / EXIT_FILE).exists():
                return  # it just did: read next time
            self.db.finish(row.id, "exited", None)

    def _settle_restoring(self, row: JobRow) -> bool:
        """A `restoring` row: `restored` once its tree runs (pid.json), removed when its
        supervisor ended without one (the restore failed, or its daemon died before its word);
        True when there is nothing more to look at now."""
        job_dir = Path(row.job_dir)
        if (job_dir / EXIT_FILE).exists():
            return False  # it ran and ended: recorded as any job's end
        tree = read_pid_file(job_dir)
        if tree is not None and proctree.alive(*tree):
            self.db.set(row.id, state="restored", pid=tree[0], pid_start=tree[1])
            log.info("job %s: restored (recorded from its supervisor's pid.json)", row.id)
            return True
        if row.shim_pid and proctree.alive(row.shim_pid, None):
            return True  # still restoring
        if tree is None and self.db.remove_unstarted(row.id):
            log.warning(
                "job %s: its restore of checkpoint %s ended without a job (failed, or "
                "its daemon stopped before the job could resume); nothing runs, the "
                "checkpoint is kept",
                row.id,
                row.checkpoint,
            )
            return True
        return False

    def adopt_orphans(self, jobs_dir: Path) -> list[str]:
        """Record every job whose tree runs but whose row is missing (the daemon died between
        starting it and recording it, or its database was rebuilt); the adopted ids."""
        adopted: list[str] = []
        unadoptable: list[str] = []
        try:
            names = sorted(os.listdir(jobs_dir))
        except FileNotFoundError:
            return []
        for name in names:
            job_dir = jobs_dir / name
            if not _is_job_id(name) or self.db.get(name) is not None:
                continue
            tree = read_pid_file(job_dir)
            if tree is None or (job_dir / EXIT_FILE).exists() or not proctree.alive(*tree):
                continue
            row = _row_of(job_dir, name, tree)
            if row is None:
                log.error(
                    "job %s (pid %d) runs without a record this daemon can rebuild (no "
                    "readable job.json in %s); it is left running, unlisted: stop it "
                    "with kill -TERM %d if it is not wanted",
                    name,
                    tree[0],
                    job_dir,
                    tree[0],
                )
                unadoptable.append(name)
                continue
            self.db.add(row)
            adopted.append(name)
            log.warning(
                "adopted job %s (pid %d, %s of user %s): it ran without a record in "
                "the job database (its daemon stopped before recording it, or the "
                "database was rebuilt)",
                name,
                tree[0],
                row.state,
                row.user,
            )
        self.unadoptable = unadoptable
        return adopted


def read_pid_file(job_dir: Path) -> tuple[int, int | None] | None:
    """The (pid, start time) a job's supervisor wrote before answering, if it did."""
    tree = read_pid(job_dir)
    return None if tree is None else (tree["pid"], tree["pid_start"])


def _row_of(job_dir: Path, job_id: str, tree: tuple[int, int | None]) -> JobRow | None:
    """The row `job.json` recorded for a job now running as `tree`; None if unreadable."""
    try:
        data: dict[str, Any] = json.loads((job_dir / "job.json").read_text())
        names = {f.name for f in fields(JobRow)}
        if set(data) != names or data["id"] != job_id:
            return None
        row = JobRow(**data)
    except (OSError, ValueError, TypeError):
        return None
    row.pid, row.pid_start = tree
    row.job_dir = str(job_dir)
    # A restore's record said `restoring`; its tree runs: `restored`.
    row.state = "restored" if row.checkpoint else "running"
    return row


def _is_job_id(name: str) -> bool:
    try:
        validate_job_id(name)
    except Exception:  # noqa: BLE001 - UsageError: not one of ours
        return False
    return True


def died_of(row: JobRow, sig: signal.Signals) -> bool:
    """Whether the job's init was ended by `sig`, as its supervisor recorded. No record (the
    supervisor vanished with the job): taken as yes, `sig` being the last thing sent."""
    try:
        ended = read_exit(Path(row.job_dir))
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return ended is not None and ended["signal"] == sig
