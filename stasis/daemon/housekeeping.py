"""What would otherwise grow without bound or stay taken for nothing: rows of finished jobs and
their directories, CRIU's logs, checkpoints whose manifest is garbage. The daemon runs it at its
start and then every hour."""

from __future__ import annotations

import logging
import os
import shutil
import time
from contextlib import suppress
from datetime import datetime
from pathlib import Path

from stasis.daemon.core import Core
from stasis.engine import proctree
from stasis.errors import StasisError

log = logging.getLogger("stasis.daemon")

# CRIU logs this young are never pruned: a CRIU may still be writing them.
_CRIU_LOG_GRACE_S = 3600.0


class Housekeeping:
    def __init__(self, core: Core) -> None:
        self.core = core

    def sweep_store(self) -> None:
        """Keep the store usable and bounded (the daemon runs this at its start and then every
        hour): complete its label index (once: a store written by a stasis without one), delete
        checkpoints older than `keep_max_age_s`, and free what nobody can use: checkpoints whose
        manifest has been garbage for longer than `remove_corrupt_after_s`."""
        store = self.core.store
        try:
            added = store.catalog.ensure_index()
            if added:
                log.info("indexed %d checkpoint(s) of %s by label", added, store.url)
        except StasisError as e:
            log.warning("cannot index the checkpoints of %s: %s", store.url, e)
        if self.core.settings.keep_max_age_s:
            try:
                expired = store.catalog.expire()
                if expired:
                    log.info(
                        "deleted %d checkpoint(s) older than %d s",
                        len(expired),
                        self.core.settings.keep_max_age_s,
                    )
            except StasisError as e:
                log.warning("cannot delete old checkpoints: %s", e)
        if self.core.settings.remove_corrupt_after_s == 0:
            return
        try:
            store.catalog.remove_unreadable(self.core.settings.remove_corrupt_after_s)
        except StasisError as e:
            log.warning("cannot remove corrupt checkpoints: %s", e)

    def prune_history(self) -> None:
        """Forget what would otherwise grow without bound: rows of finished jobs and CRIU's
        logs beyond their configured count and age (the daemon runs this at its start and then
        every hour). Never a live job's row, nor its CRIU logs."""
        try:
            jobs = self._prune_finished_jobs()
            logs = self._prune_criu_logs()
        except Exception as e:  # housekeeping: the next round tries again
            log.warning("pruning old job rows and CRIU logs failed: %s", e)
            return
        if jobs or logs:
            log.info("pruned %d finished job row(s) and %d CRIU log(s)", jobs, logs)

    def _prune_finished_jobs(self) -> int:
        settings = self.core.settings
        keep, max_age_s = settings.keep_finished_jobs, settings.finished_jobs_max_age_s
        if not keep and not max_age_s:
            return 0
        now = time.time()
        doomed: list[tuple[str, str]] = []
        for index, (job_id, created, job_dir, shim_pid) in enumerate(self.core.db.finished()):
            if shim_pid and proctree.alive(shim_pid, None):
                continue  # its supervisor may still write the exit status into its directory
            if (keep and index >= keep) or (
                max_age_s and now - _ended(created, job_dir) > max_age_s
            ):
                doomed.append((job_id, job_dir))
        # Directories first: a row whose directory is gone is pruned again next time, a
        # directory whose row is gone would stay forever.
        jobs_dir = settings.layout.jobs
        for job_id, job_dir in doomed:
            path = Path(job_dir)
            if path.parent == jobs_dir and path.name == job_id:  # only what we made
                shutil.rmtree(path, ignore_errors=True)
        return self.core.db.remove_finished([job_id for job_id, _ in doomed]) if doomed else 0

    def _prune_criu_logs(self) -> int:
        settings = self.core.settings
        keep, max_age_s = settings.keep_criu_logs, settings.criu_logs_max_age_s
        if not keep and not max_age_s:
            return 0
        entries = []
        with os.scandir(settings.layout.criu_logs) as found:
            for entry in found:
                # Logs, and lazy restores' work directories (their lazy-pages log); not CRIU's
                # stats-dump and stats-restore, which each run overwrites.
                if not entry.name.endswith(".log") and not (
                    entry.name.startswith("restore-") and entry.is_dir(follow_symlinks=False)
                ):
                    continue
                try:
                    entries.append((entry.stat(follow_symlinks=False).st_mtime, entry))
                except FileNotFoundError:
                    continue
        entries.sort(key=lambda e: e[0], reverse=True)
        spared = {row.id for row in self.core.db.live()} | self.core.journal.active()
        now = time.time()
        removed = 0
        for index, (mtime, entry) in enumerate(entries):
            if not ((keep and index >= keep) or (max_age_s and now - mtime > max_age_s)):
                continue
            # A CRIU may still be writing a young one (a long dump, a restore streaming pages).
            if now - mtime < _CRIU_LOG_GRACE_S or _criu_log_owner(entry.name) in spared:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with suppress(FileNotFoundError):
                    os.unlink(entry.path)
            removed += 1
        return removed


def _ended(created: str, job_dir: str) -> float:
    """When a finished job ended, near enough: its supervisor writes the exit status into its
    directory then. A job whose supervisor vanished has only its start time."""
    try:
        started = datetime.fromisoformat(created).timestamp()
    except ValueError:
        started = 0.0
    try:
        return max(started, os.stat(job_dir).st_mtime)
    except OSError:
        return started


def _criu_log_owner(name: str) -> str | None:
    """The job or checkpoint a CRIU log (or lazy restore's work directory) belongs to:
    dump-<checkpoint>.log, restore-<job>.log, restore-<job>/."""
    kind, _, rest = name.removesuffix(".log").partition("-")
    return rest if kind in ("dump", "restore") and rest else None
