"""Whose each job is and whether it still runs: the job table as the jobs' supervisors leave it
(each writes its job's exit status into the job's directory, exit.json)."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

from stasis.daemon.db import JobDB, JobRow
from stasis.daemon.models import validate_job_id
from stasis.daemon.supervisor import Supervisors
from stasis.daemon.users import Caller
from stasis.engine import proctree
from stasis.errors import NotFoundError

log = logging.getLogger("stasis.daemon")


class JobTracker:
    def __init__(self, db: JobDB, supervisors: Supervisors) -> None:
        self.db = db
        self._supervisors = supervisors

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
        if (Path(row.job_dir) / "exit.json").exists():
            return True
        return not (row.pid and proctree.alive(row.pid, row.pid_start)) and \
            not (row.shim_pid and proctree.alive(row.shim_pid, None))

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

    def _follow(self, row: JobRow) -> None:
        exit_file = Path(row.job_dir) / "exit.json"
        if exit_file.exists():
            try:
                code = json.loads(exit_file.read_text())["exit_code"]
            except (ValueError, KeyError):
                code = None  # written, but garbled: the job did end
            # Killed by the daemon because its memory could not be had (a lazy restore whose
            # pages did not verify or did not come): killed.json says why.
            killed = (Path(row.job_dir) / "killed.json").exists()
            self.db.finish(row.id, "failed" if killed else "exited", code)
        elif row.pid is None or not proctree.alive(row.pid, row.pid_start):
            if row.shim_pid and proctree.alive(row.shim_pid, None):
                return  # the supervisor is about to write the status
            if (Path(row.job_dir) / "exit.json").exists():
                return  # it just did: read next time
            self.db.finish(row.id, "exited", None)


def died_of(row: JobRow, sig: signal.Signals) -> bool:
    """Whether the job's init was ended by `sig`, as its supervisor recorded. No record (the
    supervisor vanished with the job): taken as yes, `sig` being the last thing sent."""
    try:
        return bool(json.loads((Path(row.job_dir) / "exit.json").read_text())
                    .get("signal") == sig)
    except FileNotFoundError:
        return True
    except (OSError, ValueError, AttributeError):
        return False
