"""A job's supervisor process (stasis.daemon.jobsupervisor, the parent of the job): started ahead of
need, handed the job's spec, asked for its answer, and the row that records the job it started;
the gate a restored tree waits at; the job's log, created for its owner.

What a job is (its row without pid) goes into `job.json` in its directory before its supervisor
gets the spec, and the supervisor writes `pid.json` there before it answers: whatever dies
where, a job that runs has both, and a daemon that starts adopts it (tracking.adopt_orphans).
The spec, the answer and the files: stasis/daemon/supervisorwire.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

from stasis import faults
from stasis.atomicfile import write_atomically
from stasis.daemon.db import JobRow, now
from stasis.daemon.progress import Progress, ReadWatcher
from stasis.daemon.reaper import Reaper
from stasis.daemon.supervisorwire import (
    Failed,
    Images,
    Ran,
    Restored,
    RestoreJob,
    RestoreSpec,
    RunSpec,
    Spec,
)
from stasis.daemon.users import Account
from stasis.engine import proctree
from stasis.errors import StasisError, UsageError
from stasis.layout import StateLayout
from stasis.wire import WireError

log = logging.getLogger("stasis.daemon")

REFUSED_END_S = 10.0  # a refused restore's supervisor kills it and answers in well under that
# `make install` and the node package put stasis-init (stasis/daemon/stasis-init.c) at the first
# path, where every job's user may run it (`make install` also builds it next to the venv's
# python); the second is where `make install` put it before (it links it to the first now).
_INIT_CANDIDATES = ("/usr/libexec/stasis/stasis-init", "/usr/local/libexec/stasis/stasis-init")


def find_init(configured: str) -> str:
    candidates = (
        (configured,)
        if configured
        else (
            *_INIT_CANDIDATES,
            str(Path(sys.executable).parent / "stasis-init"),
            shutil.which("stasis-init") or "",
        )
    )
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise UsageError("stasis-init is not built; run `make install`")


def create_log(path: str, acct: Account) -> None:
    """Create a job's log, its owner's, where the owner may not create files (the daemon's
    logs directory); never one that is there already."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    os.fchown(fd, acct.uid, acct.gid)
    os.fchmod(fd, 0o640)  # the daemon's umask is 077; the log is its owner's to read
    os.close(fd)


# What a supervisor answers when it started the job: Ran for a run, Restored for a restore.
A = TypeVar("A", Ran, Restored)


@dataclass(frozen=True)
class Started(Generic[A]):
    """What a job's supervisor answered: the job it started, or why not (Failed)."""

    job_id: str
    job_dir: Path
    supervisor_pid: int
    answer: A | Failed

    @property
    def pid(self) -> int:
        """The job's; only for an answer that is not Failed."""
        if "error" in self.answer:
            raise ValueError(f"job {self.job_id} did not start: {self.answer['error']}")
        return self.answer["pid"]

    def row(self, job: JobRow) -> JobRow:
        """The job's record, as it starts: `job` (its record before the start) with the job's
        pid and its supervisor."""
        pid = self.pid
        return replace(
            job,
            pid=pid,
            pid_start=proctree.start_time(pid),
            shim_pid=self.supervisor_pid,
            created=now(),
            job_dir=str(self.job_dir),
        )


class Supervisors:
    """The jobs' supervisors this daemon starts, one per job, each from a spare."""

    def __init__(self, layout: StateLayout, reaper: Reaper) -> None:
        self._layout = layout
        self._running: dict[int, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()
        self._spare = _SpareSupervisor(reaper)

    def warm(self) -> None:
        self._spare.warm()

    def close(self) -> None:
        """Let the spare go (running jobs and their supervisors are not touched)."""
        self._spare.close()

    def run(self, job_id: str, spec: RunSpec, job: JobRow) -> Started[Ran]:
        """Have a supervisor start the job `spec` describes."""
        return self._start(job_id, spec, job)

    def restore(
        self,
        job_id: str,
        restoring: RestoreJob,
        images: Images,
        job: JobRow,
        record: Callable[[JobRow], None],
        gate: Gate,
        progress: Progress | None = None,
        expected: int = 0,
    ) -> Started[Restored]:
        """Have a supervisor restore `images` as the job `restoring` describes; the job resumes
        once `gate` says so. `progress`: told the bytes CRIU read, of `expected`."""
        spec: RestoreSpec = {**restoring, **images}
        return self._start(job_id, spec, job, record, gate, progress, expected)

    def _start(
        self,
        job_id: str,
        spec: Spec,
        job: JobRow,
        record: Callable[[JobRow], None] | None = None,
        gate: Gate | None = None,
        progress: Progress | None = None,
        expected: int = 0,
    ) -> Started[Any]:
        """`job` (its row, pid unknown) goes into the job's directory and to `record` (the
        database) before the supervisor hears of the job; should `record` raise, nothing was
        started."""
        job_dir = self._layout.job_dir(job_id)
        job_dir.mkdir(mode=0o700)
        proc = self._spare.take()
        assert proc.stdin is not None and proc.stdout is not None
        job.shim_pid, job.job_dir = proc.pid, str(job_dir)
        try:
            write_job_file(job_dir, job)
            if record is not None:
                record(job)
        except BaseException:
            _dismiss(proc)
            shutil.rmtree(job_dir, ignore_errors=True)
            raise
        with self._lock:
            self._running[proc.pid] = proc
        watcher = ReadWatcher(proc.pid, expected, progress) if progress else None
        gating: threading.Thread | None = None
        try:
            try:
                # The spec holds the job's --env values: through the pipe, never into a file.
                proc.stdin.write(f"{job_dir}\n{json.dumps(spec)}\n".encode())
                proc.stdin.flush()
                if gate is not None:
                    # Beside the answer, not before it: a restore that fails before it reaches
                    # the gate answers at once, and the gate's check is told to give up.
                    gating = threading.Thread(
                        target=gate.open,
                        args=(proc.stdin, proc),
                        name="stasis-gate",
                        daemon=True,
                    )
                    gating.start()
                else:
                    proc.stdin.close()
            except BrokenPipeError:
                pass  # it died; the empty answer below says so
            line = proc.stdout.readline()
        finally:
            if gating is not None:
                assert gate is not None
                gate.cancel()
                gating.join()
            if watcher:
                watcher.stop()
        proc.stdout.close()
        if not line:
            died = Failed(error=WireError(type="StasisError", message="job supervisor died"))
            return Started(job_id, job_dir, proc.pid, died)
        # The line of a process this daemon started, of its own version: as supervisorwire says.
        return Started(job_id, job_dir, proc.pid, json.loads(line))

    def reap(self) -> None:
        """Forget the supervisors that exited (their jobs ended)."""
        with self._lock:
            for pid, proc in list(self._running.items()):
                if proc.poll() is not None:
                    del self._running[pid]


def _refuse(pipe: IO[bytes], supervisor: subprocess.Popen[bytes]) -> None:
    try:
        pipe.write(b"no\n")
        pipe.close()
    except (BrokenPipeError, ValueError):
        pass  # it died, or answered and closed its end: the answer says why
    try:
        # Unreaped until this returns (or the reaper's poll reaps it): its pid is not reused.
        supervisor.wait(timeout=REFUSED_END_S)
    except subprocess.TimeoutExpired:
        log.warning(
            "the supervisor of a refused restore (pid %d) did not end within %.0f s: killed, "
            "with what it ran (ghost files its CRIU made may be left)",
            supervisor.pid,
            REFUSED_END_S,
        )
        proctree.signal_tree(supervisor.pid, signal.SIGKILL)


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
                [sys.executable, "-m", "stasis.daemon.jobsupervisor", "--spare"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,  # the job must outlive a restart of the daemon
            )
            supervisors[spare.pid] = spare
        return spare

    def take(self) -> subprocess.Popen[bytes]:
        with self._lock:
            spare, self._next = self._next, None
        if spare is None or spare.poll() is not None:
            spare = self._start()
        self.warm()
        return spare

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


def write_job_file(job_dir: Path, job: JobRow) -> None:
    """`job.json`: the job's record as its start left it, for a daemon that lost its row."""
    write_atomically(job_dir / "job.json", json.dumps(asdict(job)).encode(), durable=False)


class Gate:
    """Runs a check while the supervisor restores, then tells it (on its stdin) whether the
    restored tree may be resumed: b"ok", or b"no" and the supervisor kills the whole restore
    at once (CRIU can spin forever on a truncated image, so it cannot be trusted to reach the
    gate), removes what its CRIU left on the node (engine/ghosts.py) and answers; a supervisor
    still there REFUSED_END_S later has its whole tree killed from here. The check's error is
    kept for the caller. `point`: the fault point just before the word."""

    def __init__(
        self, check: Callable[[], None], cancel: Callable[[], None] | None = None, point: str = ""
    ) -> None:
        self.check = check
        self._cancel = cancel
        self._point = point
        self.error: StasisError | None = None

    def cancel(self) -> None:
        """The restore answered: a check still waiting for it may stop (its verdict no longer
        matters: the tree resumed on "ok", or the restore failed before the gate)."""
        if self._cancel is not None:
            self._cancel()

    def open(self, pipe: IO[bytes], supervisor: subprocess.Popen[bytes]) -> None:
        try:
            self.check()
        except StasisError as e:
            self.error = e
            _refuse(pipe, supervisor)
            return
        if self._point:
            faults.point(self._point)
        try:
            pipe.write(b"ok\n")
            pipe.close()
        except BrokenPipeError:
            pass  # the restore failed before it asked: its own answer says why
