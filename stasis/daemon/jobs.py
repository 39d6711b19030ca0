"""Jobs: start them, checkpoint them, restore them, kill them, follow them until they end.

Blocking code (CRIU runs, file copies); the API calls it from worker threads. Every method takes
the Caller and checks that the job or checkpoint is theirs before touching it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from stasis.config import Settings
from stasis.daemon import staging
from stasis.daemon.db import JobDB, JobRow
from stasis.daemon.inflight import DumpJournal, InFlightDump
from stasis.daemon.netlocks import NetLocks
from stasis.daemon.reaper import Reaper
from stasis.daemon.models import (
    DumpAnswer,
    DumpCheckAnswer,
    DumpRequest,
    Job,
    KillAnswer,
    RestoreAnswer,
    RestoreRequest,
    RunAnswer,
    RunRequest,
    validate_job_id,
)
from stasis.daemon.users import (
    Caller,
    account,
    job_account,
    job_environment,
    owner_uid,
    user_name,
)
from stasis.engine import CRIU, DumpOptions, DumpResult, find_criu, kdat, netlock, obstacles
from stasis.engine import proctree
from stasis.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NotFoundError,
    PermissionDeniedError,
    RestoreError,
    StasisError,
    StoreError,
    UnreadableManifestError,
    UntrustedCheckpointError,
    UsageError,
    error_from_wire,
)
from stasis.store import (
    CheckpointInfo,
    CompressionRequest,
    FileEntry,
    Manifest,
    Store,
    new_checkpoint_id,
    validate_checkpoint_id,
    validate_label,
)

log = logging.getLogger("stasis.daemon")

# (bytes done, bytes expected) while a dump or restore runs.
Progress = Callable[[int, int], None]

# CRIU logs this young are never pruned: a CRIU may still be writing them.
_CRIU_LOG_GRACE_S = 3600.0
# A restore of several GiB can take a while; a shim that says nothing for this long is stuck.
_SHIM_ANSWER_TIMEOUT_S = 600


# `make install` puts stasis-init (stasis/daemon/stasis-init.c) here, where every job's user may
# run it, and builds it next to the venv's python.
_INIT_CANDIDATES = ("/usr/local/libexec/stasis/stasis-init",)


def find_init(configured: str) -> str:
    candidates = (configured,) if configured else (
        *_INIT_CANDIDATES, str(Path(sys.executable).parent / "stasis-init"),
        shutil.which("stasis-init") or "")
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise UsageError("stasis-init is not built; run `make install`")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class JobManager:
    def __init__(self, settings: Settings, store: Store, db: JobDB,
                 job_umask: int = 0o022) -> None:
        self.settings = settings
        self.job_umask = job_umask  # new jobs get it; the daemon's own files are private
        self.store = store
        self.db = db
        self.state_dir = settings.state_dir
        self.logs_dir = self.state_dir / "logs"
        self.jobs_dir = self.state_dir / "jobs"
        self.criu_logs = self.state_dir / "criu-logs"
        self.scratch = self.state_dir / "scratch"
        self._shims: dict[int, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()
        self._hostname = settings.node
        self._criu_version: str | None = None
        self.reaper = Reaper()
        self.journal = DumpJournal(self.state_dir / "dumps")
        self._spare = _SpareSupervisor(self.reaper)
        self.netlocks = NetLocks(db, store, settings.netlock_timeout_s)
        # What is being dumped (or recovered from a dump a killed daemon left): at most one dump
        # of a job at a time. A second CRIU on a tree the first one holds fails, and a second
        # stop-dump would find the tree the first one stopped (see `_dump_slot`).
        self._busy: dict[str, str] = {}
        self._busy_lock = threading.Lock()

    def close(self) -> None:
        """Let the spare supervisor go (running jobs and their supervisors are not touched)."""
        self._spare.close()

    def prepare(self) -> None:
        """Create the state layout: users traverse to their logs, nothing else is theirs."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o711)
        self.logs_dir.mkdir(exist_ok=True)
        os.chmod(self.logs_dir, 0o711)
        for d in (self.jobs_dir, self.criu_logs, self.scratch):
            d.mkdir(exist_ok=True)
            os.chmod(d, 0o700)
        for name in staging.remove_leftovers(self.settings.stage_dir):
            log.info("removed %s from the memory stage: a dump that never finished", name)
        self.journal.prepare()
        self.recover_dumps()
        try:
            for name in self.store.remove_stale_staging():
                log.info("removed staging/%s from the store: a dump that never finished", name)
        except StasisError as e:
            log.warning("%s", e)  # the daemon still works; the space stays taken
        cache_problem = kdat.ensure_cache_dir()
        if cache_problem:
            log.warning("%s", cache_problem)
        if kdat.clear_stale_tmp():
            log.info("removed a stale %s.tmp left by a killed CRIU: CRIU caches its kernel "
                     "probes again", kdat.CACHE)
        self._spare.warm()

    @property
    def criu(self) -> CRIU:
        return CRIU(find_criu(self.settings.criu), self.criu_logs)

    def criu_version(self, criu: CRIU) -> str:
        # Asked once: each ask starts a criu process, and a dump should not wait for that.
        if self._criu_version is None:
            self._criu_version = ".".join(str(p) for p in criu.version())
        return self._criu_version

    # -- queries -------------------------------------------------------------------------------

    def _row(self, job_id: str, caller: Caller) -> JobRow:
        row = self.db.get(validate_job_id(job_id))
        if row is None:
            raise NotFoundError(f"no job {job_id}; see `stasis ps`")
        caller.require(row.uid, f"job {job_id}")
        return row

    def get(self, job_id: str, caller: Caller) -> Job:
        self.poll()
        return _job(self._row(job_id, caller))

    def jobs(self, caller: Caller) -> list[Job]:
        self.poll()
        return [_job(r) for r in self.db.all() if caller.may_act_on(r.uid)]

    def checkpoints(self, label: str | None, caller: Caller,
                    user: str | None = None) -> list[Manifest]:
        """The caller's checkpoints (of `label`). A label is looked up among one owner's: the
        caller's, or whose `user` names (root only). Without either, root sees every owner's."""
        if label is not None:
            validate_label(label)
        if label is None and user is None and caller.is_root:
            return self.store.list()
        return self.store.list(label, uid=owner_uid(caller, user))

    def delete_checkpoint(self, checkpoint_id: str, caller: Caller) -> None:
        try:
            manifest = self.store.get(validate_checkpoint_id(checkpoint_id))
        except (UnreadableManifestError, UntrustedCheckpointError) as e:
            # Its owner cannot be told (garbage) or believed (unsigned, forged, another site's):
            # root alone may remove it.
            if not caller.is_root:
                raise PermissionDeniedError(
                    f"permission denied: the manifest of checkpoint {checkpoint_id} is "
                    "unreadable or untrusted, so nobody can tell whose it is; only root can "
                    "delete it"
                ) from e
            log.warning("root deletes checkpoint %s: %s", checkpoint_id, e)
        else:
            caller.require(manifest.uid, f"checkpoint {checkpoint_id}")
        self.store.delete(checkpoint_id)
        self.netlocks.release(checkpoint_id, "the checkpoint was deleted")

    def sweep_store(self) -> None:
        """Free what nobody can use: checkpoints whose manifest has been garbage for longer than
        `remove_corrupt_after_s` (the daemon runs this at its start and then every hour)."""
        if self.settings.remove_corrupt_after_s == 0:
            return
        try:
            self.store.remove_unreadable(self.settings.remove_corrupt_after_s)
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
        keep, max_age_s = self.settings.keep_finished_jobs, self.settings.finished_jobs_max_age_s
        if not keep and not max_age_s:
            return 0
        now = time.time()
        doomed: list[tuple[str, str]] = []
        for index, (job_id, created, job_dir, shim_pid) in enumerate(self.db.finished()):
            if shim_pid and proctree.alive(shim_pid, None):
                continue  # its supervisor may still write the exit status into its directory
            if (keep and index >= keep) or (max_age_s and now - _ended(created, job_dir)
                                             > max_age_s):
                doomed.append((job_id, job_dir))
        # Directories first: a row whose directory is gone is pruned again next time, a
        # directory whose row is gone would stay forever.
        for job_id, job_dir in doomed:
            path = Path(job_dir)
            if path.parent == self.jobs_dir and path.name == job_id:  # only what we made
                shutil.rmtree(path, ignore_errors=True)
        return self.db.remove_finished([job_id for job_id, _ in doomed]) if doomed else 0

    def _prune_criu_logs(self) -> int:
        keep, max_age_s = self.settings.keep_criu_logs, self.settings.criu_logs_max_age_s
        if not keep and not max_age_s:
            return 0
        entries = []
        with os.scandir(self.criu_logs) as found:
            for entry in found:
                # Logs, and lazy restores' work directories (their lazy-pages log); not CRIU's
                # stats-dump and stats-restore, which each run overwrites.
                if not entry.name.endswith(".log") and not (
                        entry.name.startswith("restore-") and entry.is_dir(follow_symlinks=False)):
                    continue
                try:
                    entries.append((entry.stat(follow_symlinks=False).st_mtime, entry))
                except FileNotFoundError:
                    continue
        entries.sort(key=lambda e: e[0], reverse=True)
        spared = {row.id for row in self.db.live()} | self.journal.active()
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

    # -- run -----------------------------------------------------------------------------------

    def run(self, req: RunRequest, caller: Caller) -> RunAnswer:
        acct = job_account(caller, req.user)
        job_id = secrets.token_hex(6)
        label = validate_label(req.label) if req.label else job_id
        env = job_environment(acct, req.env)
        if req.log:
            log = req.log
        else:
            log = str(self.logs_dir / f"{job_id}.log")
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
            os.fchown(fd, acct.uid, acct.gid)
            os.fchmod(fd, 0o640)  # the daemon's umask is 077; the log is its owner's to read
            os.close(fd)
        spec = {
            "mode": "run",
            "command": req.command,
            "cwd": req.cwd,
            "env": env,
            "uid": acct.uid,
            "gid": acct.gid,
            "groups": acct.groups,
            "log": log,
            "init": find_init(self.settings.init),
            "umask": self.job_umask,
        }
        job_dir, answer = self._start_shim(job_id, spec)
        if "error" in answer:
            raise error_from_wire(answer["error"]["type"], answer["error"]["message"])
        pid = int(answer["pid"])
        self.db.add(
            JobRow(
                id=job_id, pid=pid, pid_start=proctree.start_time(pid), shim_pid=answer["shim"],
                state="running", label=label, exit_code=None, command=req.command, cwd=req.cwd,
                env=sorted(req.env), user=acct.name, uid=acct.uid, gid=acct.gid, log=log,
                checkpoint=None, created=_now(), job_dir=str(job_dir),
            )
        )
        return RunAnswer(job=job_id, pid=pid, label=label)

    def _start_shim(self, job_id: str, spec: dict[str, Any], progress: Progress | None = None,
                    expected: int = 0, gate: _Gate | None = None
                    ) -> tuple[Path, dict[str, Any]]:
        job_dir = self.jobs_dir / job_id
        job_dir.mkdir(mode=0o700)
        shim = self._spare.take()
        assert shim.stdin is not None and shim.stdout is not None
        with self._lock:
            self._shims[shim.pid] = shim
        watcher = _ReadWatcher(shim.pid, expected, progress) if progress else None
        try:
            try:
                # The spec holds the job's --env values: through the pipe, never into a file.
                shim.stdin.write(f"{job_dir}\n{json.dumps(spec)}\n".encode())
                shim.stdin.flush()
                if gate is not None:
                    gate.open(shim.stdin, shim.pid)
                else:
                    shim.stdin.close()
            except BrokenPipeError:
                pass  # it died; the empty answer below says so
            line = shim.stdout.readline()
        finally:
            if watcher:
                watcher.stop()
        shim.stdout.close()
        if not line:
            return job_dir, {"error": {"type": "StasisError", "message": "job supervisor died"}}
        answer: dict[str, Any] = json.loads(line)
        answer["shim"] = shim.pid
        return job_dir, answer

    # -- dump ----------------------------------------------------------------------------------

    def dump(self, job_id: str, req: DumpRequest, caller: Caller,
             progress: Progress | None = None) -> DumpAnswer:
        started = time.monotonic()
        row = self._row(job_id, caller)
        # Held until the job is recorded checkpointed and killed: a second request in between
        # would otherwise dump the stopped tree, or report the first one's success as a failure.
        with self._dump_slot(f"job {row.id}", f"job {job_id}"):
            return self._dump(job_id, req, caller, progress, started)

    @contextmanager
    def _dump_slot(self, key: str, what: str,
                   why: str = "being checkpointed already; wait for it") -> Iterator[None]:
        """Hold `key` (a job, or a process tree by its pid) for one dump. Whoever asks for it
        meanwhile gets a CheckpointError at once: "<what> is <why the holder gave>"."""
        with self._busy_lock:
            held = self._busy.get(key)
            if held is not None:
                raise CheckpointError(f"{what} is {held}")
            self._busy[key] = why
        try:
            yield
        finally:
            with self._busy_lock:
                del self._busy[key]

    def _dump(self, job_id: str, req: DumpRequest, caller: Caller, progress: Progress | None,
              started: float) -> DumpAnswer:
        self.poll()
        row = self._row(job_id, caller)
        if row.state not in ("running", "restored") or row.pid is None:
            raise UsageError(f"job {job_id} is not running (state {row.state}); nothing to dump")
        if not proctree.alive(row.pid, row.pid_start):
            raise UsageError(f"job {job_id} is no longer running; nothing to dump")
        label = validate_label(req.label) if req.label else row.label
        criu = self.criu
        notes: list[str] = []
        if req.incremental and not criu.features().mem_track:
            # Without soft-dirty tracking CRIU refuses pre-dumps: a full dump is the honest answer.
            notes.append("incremental dump not possible: this kernel does not track dirty "
                         "memory (no soft-dirty); took a full dump")
        created = datetime.now(timezone.utc)
        checkpoint_id = new_checkpoint_id(created)
        info = CheckpointInfo(
            id=checkpoint_id, label=label, job=row.id, host=self._hostname, created=created,
            criu_version=self.criu_version(criu), command=row.command,
            cwd=row.cwd, user=row.user, uid=row.uid, gid=row.gid, log_path=row.log,
        )
        what = f"job {job_id}"
        manifest, result, staged = self.checkpoint_tree(
            row.pid, info, req.leave_running, req.compress, what, progress, notes)
        if not req.leave_running:
            self.db.set(row.id, state="checkpointed")
            os.kill(row.pid, signal.SIGKILL)  # the namespace init: the whole tree goes with it
            self.dump_settled(manifest.id)
        return DumpAnswer(
            checkpoint=manifest.id, label=manifest.label, job=row.id,
            size_bytes=manifest.size_bytes, duration_s=round(result.duration_s, 4),
            staged=staged, notes=notes, elapsed_s=round(time.monotonic() - started, 4),
        )

    def dump_check(self, job_id: str, caller: Caller) -> DumpCheckAnswer:
        """What would make a dump of the job fail, or its restore differ, found without
        dumping (`stasis dump --check`)."""
        row = self._row(job_id, caller)
        self.poll()
        row = self._row(job_id, caller)
        if row.state not in ("running", "restored") or row.pid is None \
                or not proctree.alive(row.pid, row.pid_start):
            raise UsageError(f"job {job_id} is not running (state {row.state}); nothing to check")
        try:
            found = obstacles.find(row.pid, viewer=row.uid)
        except OSError as e:
            raise StasisError(f"cannot look into job {job_id}: {e}") from e
        return DumpCheckAnswer(job=row.id, obstacles=found.obstacles, notes=found.notes)

    def checkpoint_tree(self, pid: int, info: CheckpointInfo, leave_running: bool,
                        compress: CompressionRequest, what: str,
                        progress: Progress | None = None, notes: list[str] | None = None
                        ) -> tuple[Manifest, DumpResult, bool]:
        """Dump the tree under `pid` and publish it as checkpoint `info.id`.

        Unless `leave_running`, the tree is left stopped (not killed) once this returns: the
        caller records that, kills it, then calls `dump_settled(info.id)`. Any failure resumes
        it and publishes nothing. One dump of a tree at a time: a second is refused at once.
        Returns the manifest, CRIU's result and whether the images were staged in memory; what
        was not done as asked (not staged, not compressed), and why, is added to `notes`.
        """
        notes = [] if notes is None else notes
        with self._dump_slot(f"pid {pid}", what):
            # Written down until settled: should the daemon die meanwhile, its next start
            # removes the staging and resumes the tree (`recover_dumps`).
            self.journal.begin(InFlightDump(
                checkpoint=info.id, job=info.job, pid=pid, pid_start=proctree.start_time(pid),
                leave_running=leave_running))
            try:
                done = self._checkpoint_tree(pid, info, leave_running, compress, what,
                                             progress, notes)
            except BaseException:
                self.journal.end(info.id)
                raise
            if leave_running:
                self.journal.end(info.id)
            return done

    def dump_settled(self, checkpoint_id: str) -> None:
        """The tree a dump stopped was killed (or resumed): nothing is left to undo."""
        self.journal.end(checkpoint_id)

    def _checkpoint_tree(self, pid: int, info: CheckpointInfo, leave_running: bool,
                         compress: CompressionRequest, what: str, progress: Progress | None,
                         notes: list[str]) -> tuple[Manifest, DumpResult, bool]:
        asked = compress
        criu = self.criu
        expected = proctree.resident_bytes(pid)
        # Leave-running dumps may go to node memory first, so the job is frozen only that long;
        # a dump that stops the job goes straight to the store (one copy, not two).
        fast = None
        if leave_running:
            fast, unstaged = staging.stage(self.settings.stage_dir, info.id, expected)
            if unstaged:
                notes.append(f"not staged in memory ({unstaged}): the job stayed frozen while "
                             "its images went to the store")
        target = fast or self.store.staging_dir(info.id)
        # Until the checkpoint is published the tree stays stopped, not killed: a failed publish
        # (full disk, store down) resumes the job as if nothing happened.
        options = DumpOptions(leave_running=leave_running, leave_stopped=not leave_running,
                              criu_started=lambda criu_pid: self.journal.note_criu(
                                  info.id, criu_pid, proctree.start_time(criu_pid)))
        watcher = _DirWatcher(target, expected, progress) if progress else None
        # A dump that stops the job has it down until published: its images are hashed (and
        # written back to disk, or compressed) while CRIU writes them. A leave-running dump does
        # all that after the job resumed instead: on these 2 CPUs the hashing slowed CRIU's
        # frozen part by ~25%.
        tail = self.store.follow(info.id, compress) if not leave_running else None
        try:
            result = criu.dump(pid, target, options, f"dump-{info.id}.log")
        except StasisError as e:
            if tail:
                tail.finish()  # before its files go: it may be creating one
            self._discard(info.id, fast)
            # CRIU names no process when one end of a connection is outside the job: we can.
            why = obstacles.explain(pid, viewer=info.uid)
            raise CheckpointError(f"checkpoint of {what} failed, job still running: "
                                  + (f"{why} (CRIU: {e})" if why else str(e))) from e
        finally:
            if watcher:
                watcher.stop()
            hashed = tail.finish() if tail else None
        if tail is not None and tail.compression is not None:
            compress = tail.compression  # what `auto` settled on while following
        # What CRIU's lock holds of the job's TCP connections until its checkpoint is restored.
        rules = [] if leave_running else netlock.rules_from_log(result.log_path)
        try:
            manifest = self.store.publish(info, compress, source=fast, hashed=hashed)
        except StasisError as e:
            self._discard(info.id, fast)
            if not leave_running:
                self._resume(pid, rules, what)
            raise CheckpointError(f"checkpoint of {what} failed, job still running: {e}") from e
        self.netlocks.hold(info.id, info.job, rules)
        if asked == "auto" and manifest.compression == "none":
            why = "it is under 1 MiB" if manifest.size_bytes < (1 << 20) else \
                "a sample of its memory did not shrink to half"
            notes.append(f"--compress auto stored the checkpoint uncompressed: {why}")
        return manifest, result, fast is not None

    def _resume(self, pid: int, rules: list[netlock.LockRule], what: str) -> None:
        """Let a tree a dump left stopped run on, its TCP connections too (CRIU left them
        locked and in repair mode: the job would run with every connection dead)."""
        for problem in netlock.reopen_connections(pid, rules):
            log.warning("%s: %s", what, problem)
        proctree.signal_tree(pid, signal.SIGCONT)

    def recover_dumps(self) -> None:
        """Undo what dumps that a killed daemon never finished left (called at start, before
        any dump): their staging goes at once, and their trees, which CRIU may have left
        stopped, run again. A CRIU of theirs that still runs is waited for first, in the
        background, with the tree held against new dumps: resumed under it, the tree would
        be stopped again when it finished."""
        for entry in self.journal.leftovers():
            try:
                self.store.discard(entry.checkpoint)
            except StasisError as e:
                log.warning("cannot remove the staging of checkpoint %s: %s", entry.checkpoint, e)
            log.warning("the dump of job %s (checkpoint %s) never finished: the daemon stopped "
                        "during it; its staging is removed", entry.job, entry.checkpoint)
            criu = entry.criu_pid
            if criu is None or not proctree.alive(criu, entry.criu_start):
                self._settle(entry)
                continue
            key = f"pid {entry.pid}"
            with self._busy_lock:
                self._busy[key] = ("being resumed: a daemon that stopped during its dump left "
                                   "it to CRIU; wait for it")
            threading.Thread(target=self._settle_after_criu, args=(entry, criu, key),
                             daemon=True).start()

    def _settle_after_criu(self, entry: InFlightDump, criu: int, key: str) -> None:
        try:
            log.warning("job %s: waiting for CRIU (pid %d), still dumping it for a daemon that "
                        "stopped, before resuming it", entry.job, criu)
            while proctree.alive(criu, entry.criu_start):
                time.sleep(0.1)
            # It may have written more before it found its directory gone.
            self.store.discard(entry.checkpoint)
            self._settle(entry)
        except Exception:  # a thread of its own: say so rather than die silently
            log.exception("cannot resume job %s after its interrupted dump", entry.job)
        finally:
            with self._busy_lock:
                self._busy.pop(key, None)

    def _settle(self, entry: InFlightDump) -> None:
        """Finish or undo the dump `entry` records, now that no CRIU holds its tree."""
        rules = [] if entry.leave_running else netlock.rules_from_log(
            self.criu_logs / f"dump-{entry.checkpoint}.log")
        published = not entry.leave_running and self._published(entry.checkpoint)
        if not proctree.alive(entry.pid, entry.pid_start):
            if published:
                self.netlocks.hold(entry.checkpoint, entry.job, rules)
            else:
                netlock.remove(rules)  # nothing left to protect
            self.journal.end(entry.checkpoint)
            return
        row = self.db.get(entry.job) if _is_job_id(entry.job) else None
        if row is not None and row.pid == entry.pid and published:
            # The checkpoint made it: do the rest of what was asked (the job stops here), so
            # the job and its checkpoint never run side by side unasked.
            self.netlocks.hold(entry.checkpoint, entry.job, rules)
            self.db.set(row.id, state="checkpointed")
            os.kill(entry.pid, signal.SIGKILL)
            log.warning("job %s: its checkpoint %s was published before the daemon stopped; "
                        "the job is stopped now, as asked", row.id, entry.checkpoint)
        elif proctree.stopped(entry.pid):
            self._resume(entry.pid, rules, f"job {entry.job}")
            log.warning("job %s: resumed; a daemon that stopped during its dump had left it "
                        "stopped", entry.job)
        self.journal.end(entry.checkpoint)

    def _published(self, checkpoint_id: str) -> bool:
        try:
            self.store.get(checkpoint_id)
        except StasisError:
            return False
        return True

    def _discard(self, checkpoint_id: str, fast: Path | None) -> None:
        self.store.discard(checkpoint_id)
        if fast is not None:
            shutil.rmtree(fast, ignore_errors=True)

    # -- restore -------------------------------------------------------------------------------

    def restore(self, req: RestoreRequest, caller: Caller,
                progress: Progress | None = None) -> RestoreAnswer:
        started = time.monotonic()
        if req.checkpoint:
            if req.user is not None:
                raise UsageError("--user says whose label to restore; a checkpoint id needs none")
            candidates = [self.store.get(validate_checkpoint_id(req.checkpoint))]
        elif req.label:
            owner = owner_uid(caller, req.user)
            candidates = self.store.list(validate_label(req.label), uid=owner)
            if not candidates:
                raise NotFoundError(self._no_label(req.label, owner, caller))
        else:
            raise UsageError("name a checkpoint id or --label")
        for manifest in candidates:
            caller.require(manifest.uid, f"checkpoint {manifest.id}")
        skipped: list[str] = []
        for manifest in candidates:
            try:
                answer = self._restore_one(manifest, progress, req.lazy)
            except CorruptCheckpointError as e:
                # By label, an older complete checkpoint is better than none.
                skipped.append(f"{manifest.id}: {e}")
                if req.checkpoint:
                    raise
                continue
            answer.skipped = skipped
            answer.elapsed_s = round(time.monotonic() - started, 4)
            return answer
        raise RestoreError("no usable checkpoint with label "
                           f"{req.label}: " + "; ".join(skipped))

    def _no_label(self, label: str, owner: int, caller: Caller) -> str:
        whose = "" if owner == caller.uid else f" of user {user_name(owner)}"
        text = f"no checkpoint with label {label}{whose}"
        if caller.is_root and owner == caller.uid:
            # Root may restore anyone's: point at the owners that label has (nobody else may
            # learn which labels other users have).
            others = sorted({user_name(m.uid) for m in self.store.list(label)})
            if others:
                text += f"; {', '.join(others)} {'has' if len(others) == 1 else 'have'} " \
                        f"checkpoints with that label: add --user {others[0]}"
        return text

    def _restore_one(self, manifest: Manifest, progress: Progress | None,
                     lazy: bool | None) -> RestoreAnswer:
        acct = account(manifest.uid)
        job_id = secrets.token_hex(6)
        log = manifest.log_path or str(self.logs_dir / f"{job_id}.log")
        if Path(log).parent == self.logs_dir and not Path(log).exists():
            # Restored on another node: our logs directory is not the user's to create files in.
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
            os.fchown(fd, acct.uid, acct.gid)
            os.fchmod(fd, 0o640)  # the daemon's umask is 077; the log is its owner's to read
            os.close(fd)
        spec: dict[str, Any] = {
            "mode": "restore",
            "uid": acct.uid,
            "gid": acct.gid,
            "groups": acct.groups,
            "log": log,
            "image_log": manifest.log_path or log,
            "criu": find_criu(self.settings.criu),
            "criu_log_dir": str(self.criu_logs),
            "criu_log_name": f"restore-{job_id}.log",
            "umask": self.job_umask,  # for a log the supervisor creates as the user
        }
        lazy = self.settings.lazy_restore if lazy is None else lazy
        notes: list[str] = []
        in_place = self.store.images_in_place(manifest.id)
        if in_place is not None:
            # CRIU reads the images where they are while we verify them; the restored tree is
            # resumed only once they passed (the supervisor waits for our word at post-restore).
            manifest, images = in_place
            spec.update(images=str(images), lazy=lazy, gate=True)
            checked = manifest
            if lazy:
                # A lazy job runs before its memory is back, so it cannot wait for the hash of
                # GiBs of pages either: everything else (and every size) gates the resume, the
                # page images are hashed right after, and a mismatch kills the job.
                gate = _Gate(lambda: self.store.verify(checked, only=lambda f: not _is_pages(f)))
            else:
                gate = _Gate(lambda: self.store.verify(checked))
            job_dir, answer = self._start_shim(job_id, spec, progress, manifest.size_bytes, gate)
            if gate.error is not None:
                raise gate.error
            if lazy and "pid" in answer:
                threading.Thread(target=self._verify_pages_after, daemon=True,
                                 args=(manifest, job_dir, int(answer["pid"]))).start()
        else:
            with self.store.open_images(manifest.id, self.scratch) as (manifest, images):
                # Lazy pages read the images after the restore returns: not from a scratch copy
                # that goes away when this block ends.
                spec.update(images=str(images), lazy=False)
                if lazy:
                    why = f"the checkpoint is compressed ({manifest.compression}) and was " \
                        "unpacked" if manifest.compression != "none" else \
                        f"the store {self.store.url} is not a local directory: the images were " \
                        "fetched"
                    notes.append(f"lazy restore not possible: {why} into scratch space that "
                                 "goes away after the restore; restored in full")
                job_dir, answer = self._start_shim(job_id, spec, progress, manifest.size_bytes)
        if "error" in answer:
            message = answer["error"]["message"]
            if acct.uid != 0 and "Permission denied" in message:
                # Swapped for a symlink, or its permissions changed since the dump.
                message += (f" (a restore reopens the job's paths with the rights of its owner, "
                            f"{acct.name}, who may not open that path now)")
            raise RestoreError(f"restore of checkpoint {manifest.id} failed: {message}")
        pid = int(answer["pid"])
        self._restored(manifest)
        if answer.get("fallback"):
            # The supervisor's CRIU could not restore lazily and restored in full.
            notes.append(f"lazy restore failed, restored in full: {answer['fallback']}")
        self.db.add(
            JobRow(
                id=job_id, pid=pid, pid_start=proctree.start_time(pid), shim_pid=answer["shim"],
                state="restored", label=manifest.label, exit_code=None, command=manifest.command,
                cwd=manifest.cwd, env=[], user=manifest.user, uid=manifest.uid, gid=manifest.gid,
                log=log, checkpoint=manifest.id, created=_now(), job_dir=str(job_dir),
            )
        )
        return RestoreAnswer(job=job_id, pid=pid, checkpoint=manifest.id,
                             lazy=bool(answer.get("lazy")), notes=notes,
                             duration_s=round(float(answer.get("duration_s", 0.0)), 4))

    def _restored(self, manifest: Manifest) -> None:
        """CRIU lifted the checkpoint's network lock if this node holds it; a node that dumped
        it elsewhere learns from the store that it may lift its own."""
        self.netlocks.lifted_by_restore(manifest.id)
        if manifest.host != self._hostname:
            try:
                self.store.mark_restored(manifest.id, self._hostname)
            except StasisError as e:
                log.warning("cannot note in the store that checkpoint %s was restored: %s",
                            manifest.id, e)

    def _verify_pages_after(self, manifest: Manifest, job_dir: Path, pid: int) -> None:
        try:
            self.store.verify(manifest, only=_is_pages)
        except StasisError as e:
            started = proctree.start_time(pid)
            if started is not None:
                proctree.signal_tree(pid, signal.SIGKILL)
            (job_dir / "killed.json").write_text(json.dumps({"reason": str(e)}))
            log.error("killed lazily restored job %s: %s", job_dir.name, e)

    # -- kill / follow -------------------------------------------------------------------------

    def signal_job(self, job_id: str, caller: Caller, sig: signal.Signals) -> JobRow | None:
        """Send `sig` to the caller's job `job_id`; its row, or None when it was not running.

        The signal goes to the job's init, stasis-init, which forwards it to every process of
        the job (a daemonized server too); SIGKILL ends the init and with it the whole PID
        namespace."""
        row = self._row(job_id, caller)
        return row if self.send(row, sig) else None

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

    def kill_answer(self, job_id: str, caller: Caller, asked: signal.Signals, sent: bool,
                    killed: bool, timeout_s: float) -> KillAnswer:
        """How `stasis kill` went: `asked` was `sent` (not: the job was not running), then
        SIGKILL if `killed`. SIGKILL ended the job only if its init died of it: a job that ended
        on `asked` just as SIGKILL went out ended by `asked`."""
        self.poll()
        row = self._row(job_id, caller)
        ended_by = None
        if sent:
            if row.state in ("running", "restored"):
                raise StasisError(
                    f"job {job_id} is still running after SIGKILL: a process of it is stuck in "
                    f"the kernel (state D in /proc/{row.pid}/stat); try again later")
            ended_by = "SIGKILL" if killed and _died_of(row, signal.SIGKILL) else asked.name
        return KillAnswer(job=row.id, state=row.state,  # type: ignore[arg-type]
                          ended_by=ended_by, exit_code=row.exit_code, signal=asked.name,
                          timeout_s=timeout_s)

    def poll(self) -> None:
        """Record the end of every job whose supervisor wrote its exit status (or vanished)."""
        with self._lock:
            for pid, shim in list(self._shims.items()):
                if shim.poll() is not None:
                    del self._shims[pid]
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
            self.db.finish(row.id, "exited", code)
        elif row.pid is None or not proctree.alive(row.pid, row.pid_start):
            if row.shim_pid and proctree.alive(row.shim_pid, None):
                return  # the supervisor is about to write the status
            if (Path(row.job_dir) / "exit.json").exists():
                return  # it just did: read next time
            self.db.finish(row.id, "exited", None)


class _SpareSupervisor:
    """One supervisor process started ahead of need, its imports done, waiting on its stdin for
    the directory of the job it is to supervise.

    Starting Python and importing CRIU's RPC classes took 50-90 ms of every restore and run on
    these machines; with a spare, a job's supervisor starts in the time it takes to write one
    line, and the next spare warms up while the job runs. A spare that is never used exits when
    its stdin closes (the daemon stopped).
    """

    def __init__(self, reaper: Reaper | None = None) -> None:
        self._lock = threading.Lock()
        self._next: subprocess.Popen[bytes] | None = None
        self._reaper = reaper or Reaper()

    def _start(self) -> subprocess.Popen[bytes]:
        # In a session of its own, like the orphans the reaper reaps: it must know this one.
        with self._reaper.spawning() as supervisors:
            spare = subprocess.Popen(
                [sys.executable, "-m", "stasis.daemon.shim", "--spare"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,  # the job must outlive a restart of the daemon
            )
            supervisors[spare.pid] = spare
        return spare

    def take(self) -> subprocess.Popen[bytes]:
        with self._lock:
            shim, self._next = self._next, None
        if shim is None or shim.poll() is not None:
            shim = self._start()
        self.warm()
        return shim

    def warm(self) -> None:
        """Have a spare ready (in the background): the first job need not wait for one."""
        threading.Thread(target=self._refill, daemon=True).start()

    def _refill(self) -> None:
        spare = self._start()
        with self._lock:
            kept = self._next is None
            if kept:
                self._next = spare
        if not kept:  # two jobs started at once: one spare is enough
            _dismiss(spare)

    def close(self) -> None:
        with self._lock:
            spare, self._next = self._next, None
        if spare is not None:
            _dismiss(spare)


def _dismiss(spare: subprocess.Popen[bytes]) -> None:
    assert spare.stdin is not None and spare.stdout is not None
    spare.stdin.close()
    spare.stdout.close()
    spare.wait()


class _Gate:
    """Runs a check while the supervisor restores, then tells it (on its stdin) whether the
    restored tree may be resumed: b"ok", or b"no" and the whole restore is killed (CRIU can
    spin forever on a truncated image, so it cannot be trusted to reach the gate). The
    check's error is kept for the caller."""

    def __init__(self, check: Callable[[], None]) -> None:
        self.check = check
        self.error: StasisError | None = None

    def open(self, pipe: IO[bytes], shim_pid: int) -> None:
        try:
            self.check()
        except StasisError as e:
            self.error = e
            proctree.signal_tree(shim_pid, signal.SIGKILL)
            return
        try:
            pipe.write(b"ok\n")
            pipe.close()
        except BrokenPipeError:
            pass  # the restore failed before it asked: its own answer says why


class _Watcher:
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


class _DirWatcher(_Watcher):
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


class _ReadWatcher(_Watcher):
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


def _died_of(row: JobRow, sig: signal.Signals) -> bool:
    """Whether the job's init was ended by `sig`, as its supervisor recorded. No record (the
    supervisor vanished with the job): taken as yes, `sig` being the last thing sent."""
    try:
        return bool(json.loads((Path(row.job_dir) / "exit.json").read_text())
                    .get("signal") == sig)
    except FileNotFoundError:
        return True
    except (OSError, ValueError, AttributeError):
        return False


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


def _is_job_id(text: str) -> bool:
    try:
        validate_job_id(text)
    except UsageError:
        return False
    return True


def _is_pages(entry: FileEntry) -> bool:
    return entry.name.startswith("pages-")


def _job(row: JobRow) -> Job:
    return Job(
        job=row.id, pid=row.pid, state=row.state,  # type: ignore[arg-type]
        label=row.label, exit_code=row.exit_code, command=row.command, user=row.user,
        uid=row.uid, cwd=row.cwd, log=row.log, checkpoint=row.checkpoint, created=row.created,
    )


__all__ = ["JobManager", "Progress", "StoreError", "find_init"]
