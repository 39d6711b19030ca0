"""Slurm's own record of the steps that stasis runs inside a job: what sacct lists for them.

The steps our srun runs inside an opted-in job's tree (stasis.slurm.steps) are not Slurm steps:
slurmstepd never sees them. So the node daemon mirrors each one with a Slurm step of its own.
Our srun records every step in the job's step book (a SysV segment in the job's IPC namespace);
every POLL_S the daemon reads the books of the jobs it protects (entering each job's IPC
namespace from one thread of its own), and

  - for a step that started, runs, as the job's user, `srun --jobid=J --overlap -N1 -n1
    -w NODE -J NAME` of a shell that waits on its standard input;
  - for a step that ended, writes its exit code and signal there: the shell ends the same way
    (exits with the code, or kills itself with the signal), and Slurm records the step as it
    would have recorded the real one.

sacct then lists the step with its name, node, exit code and state, started and ended within
POLL_S (plus srun's start) of the real step; its usage (CPU time, MaxRSS) is the waiting
shell's: the tasks themselves run, and are counted, in the batch step. Step ids are Slurm's, in
the order the mirrors start (the order of the srun calls, unless two start within one poll).

The daemon holds each job's IPC namespace open while it mirrors the job, so that a step that
ends with the job (the usual last line of a batch script) is read after the tree is gone.

A restored job's book is the checkpointed one: the steps that had ended were recorded by the run
that ran them and are not mirrored again; a step that was running resumes and gets a Slurm step
in this run (the earlier run's ended when Slurm requeued the job). A step whose mirror could not
start (or ended early) is said once in the daemon's log and not tried again.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import pwd
import select
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from stasis.config import Settings
from stasis.engine import proctree
from stasis.slurm import steps
from stasis.wire import Registration

log = logging.getLogger("stasis.daemon")

POLL_S = 1.0
# A read of a book is a few system calls and at most 256 KiB parsed: one that takes this long
# is stuck, and given up.
READ_TIMEOUT_S = 5.0
_CLONE_NEWIPC = 0x08000000
# Says it started (so that the next mirror starts after it: Slurm numbers steps as they
# start), then waits for "<exit code> <signal>" on its stdin. SIGTERM at preemption (slurmctld signals every
# step when the grace time starts) is ignored: the mirror ends with the real step, which is
# checkpointed, not terminated. Stdin closed without a line (the daemon stopped): unknown, 1.
_WAIT = (
    'trap "" TERM INT HUP; [ "$SLURM_PROCID" = 0 ] && echo started; '
    'read code sig || exit 1; '
    'if [ "${sig:-0}" -gt 0 ] 2>/dev/null; then trap - TERM INT HUP; kill -"$sig" $$; fi; '
    'exit "${code:-0}"'
)
_NAME_MAX = 100
# Steps of one job recorded at once, at most (each is an srun of the job's user).
_MAX_OPEN = 64
# Tasks a step's record asks Slurm for, at most (the book says how many the step has).
_MAX_TASKS = 4096
# A mirror that has not started after this long is left to start while the next one does.
_START_WAIT_S = 10.0
# Mirrors of one job started in one poll, at most, and the time that may take: the rest wait
# for the next poll. Each start waits on srun under the lock that every job's registration and
# checkpoint takes: a book listing thousands of steps (its user's to write) must not hold it.
_STARTS_PER_POLL = 8
_START_BUDGET_S = 2.0


class BookReader:
    """Reads a job's step book from inside its IPC namespace, on one thread of its own (setns
    moves only the calling thread; no other work of the daemon ever runs in a job's
    namespace).

    The book is the job user's memory: steps.read_records copies out at most the segment's
    real size, through the kernel (a short or faulting mapping cannot kill the daemon), and
    refuses a segment of another owner. A read that does not answer within READ_TIMEOUT_S is
    given up (its thread left behind, a new one takes over): nothing a job does can hold the
    daemon's mirroring, nor the requests that wait on it."""

    def __init__(self) -> None:
        self._pool = self._new_pool()
        self._own = os.open("/proc/self/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
        self._libc = ctypes.CDLL(None, use_errno=True)

    @staticmethod
    def _new_pool() -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="stasis-step-book")

    def read(self, ns_fd: int, owner: int | None = None) -> list[steps.StepRecord]:
        """The records of the book in the IPC namespace `ns_fd`; `owner`: the uid that must own
        the segment (steps.BookRefused otherwise)."""
        future = self._pool.submit(self._read, ns_fd, owner)
        try:
            return future.result(timeout=READ_TIMEOUT_S)
        except FutureTimeout:
            stuck = self._pool
            self._pool = self._new_pool()
            stuck.shutdown(wait=False)
            raise OSError(errno.ETIMEDOUT, f"no answer within {READ_TIMEOUT_S:g} s") from None

    def _setns(self, fd: int) -> None:
        if self._libc.setns(fd, _CLONE_NEWIPC) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns: {os.strerror(err)}")

    def _read(self, ns_fd: int, owner: int | None) -> list[steps.StepRecord]:
        self._setns(ns_fd)
        try:
            return steps.read_records(owner)
        finally:
            try:
                self._setns(self._own)
            except OSError:
                # This thread is stuck in a job's namespace: it must never read or run anything
                # else. A new pool takes over.
                log.error("cannot leave a job's IPC namespace; step mirroring restarts")
                stuck = self._pool
                self._pool = self._new_pool()
                stuck.shutdown(wait=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        os.close(self._own)


@dataclass
class _Job:
    pid: int
    pid_start: int | None
    ns_fd: int
    uid: int
    gid: int
    user: str
    done: set[int] = field(default_factory=set)  # steps recorded (or never to be)
    open: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    told: list[subprocess.Popen[bytes]] = field(default_factory=list)  # mirrors told to end
    full: bool = False  # _MAX_OPEN reached once (said in the log)
    refused: str = ""  # why its book was refused, as last said in the log
    stuck: bool = False  # a read of its book hung: never read again (each leaves a thread)


class Mirrors:
    def __init__(self, settings: Settings, node: str) -> None:
        self.settings = settings
        self.node = node
        self.reader = BookReader()
        self._jobs: dict[str, _Job] = {}
        self._ending: list[subprocess.Popen[bytes]] = []  # mirrors told to end: to be reaped
        self._lock = threading.Lock()

    # -- the job's life -----------------------------------------------------------------------

    def begin(self, reg: Registration, fresh: bool) -> None:
        """Follow the job of `reg` from now: `fresh`, every step in its book is new; else (a
        restored job) the steps that had ended are the earlier run's, not to be mirrored."""
        with self._lock:
            self._forget(reg["slurm_job"])
            self._follow(reg, fresh)

    def end(self, job_id: str, wait_s: float = 0.0) -> None:
        """The job's tree is gone (ended, or checkpointed and killed): the steps that ended
        are recorded, the mirrors of the others end (Slurm ends them anyway at the requeue).
        `wait_s`: wait that long at most for the job's mirrors to end, so that they are
        recorded before the job ends (which ends what is left of its steps)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            self._sync(job_id, job)
            ending = [*job.open.values(), *job.told]
            self._forget(job_id)
        deadline = time.monotonic() + wait_s
        for proc in ending:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break

    def poll(self, running: list[Registration]) -> None:
        """Mirror what the books of the `running` jobs say now."""
        with self._lock:
            self._reap()
            live = {r["slurm_job"]: r for r in running}
            for job_id in list(self._jobs):
                reg = live.get(job_id)
                if reg is None or reg["pid"] != self._jobs[job_id].pid:
                    self._sync(job_id, self._jobs[job_id])
                    self._forget(job_id)
            for job_id, reg in live.items():
                job = self._jobs.get(job_id) or self._follow(reg, fresh=False)
                if job is not None:
                    self._sync(job_id, job)

    def close(self) -> None:
        with self._lock:
            for job_id in list(self._jobs):
                self._forget(job_id)
        self.reader.close()

    # -- inside -------------------------------------------------------------------------------

    def _follow(self, reg: Registration, fresh: bool) -> _Job | None:
        pid = reg["pid"]
        try:
            ns_fd = os.open(f"/proc/{pid}/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        if not proctree.alive(pid, reg["pid_start"]):  # the pid was another process's
            os.close(ns_fd)
            return None
        job = _Job(
            pid=pid,
            pid_start=reg["pid_start"],
            ns_fd=ns_fd,
            uid=reg["uid"],
            gid=reg["gid"],
            user=reg["user"],
        )
        if not fresh:
            # A daemon that restarted, or a restored job: what ended was recorded before.
            job.done = {r["step"] for r in self._read(reg["slurm_job"], job) if "exit" in r}
        self._jobs[reg["slurm_job"]] = job
        return job

    def _read(self, job_id: str, job: _Job) -> list[steps.StepRecord]:
        if job.stuck:
            return []
        try:
            records = self.reader.read(job.ns_fd, job.uid)
        except steps.BookRefused as e:
            if str(e) != job.refused:  # said once, not at every poll
                log.warning(
                    "Slurm job %s: its step book is refused: %s; its steps are not "
                    "recorded in Slurm (the job itself stays protected)",
                    job_id,
                    e,
                )
                job.refused = str(e)
            return []
        except OSError as e:
            if e.errno == errno.ETIMEDOUT:
                job.stuck = True
                log.warning(
                    "Slurm job %s: reading its step book hung (%s): it is not read "
                    "again, its steps are not recorded in Slurm",
                    job_id,
                    e,
                )
                return []
            log.warning("Slurm job %s: cannot read its step book: %s", job_id, e)
            return []
        except Exception:  # noqa: BLE001 - a bug on a job's bytes costs that read, no more
            log.exception("Slurm job %s: reading its step book failed", job_id)
            return []
        job.refused = ""
        return records

    def _sync(self, job_id: str, job: _Job) -> None:
        # The book is the job's memory, written by the user's processes: every value was checked
        # as it was read (steps.parse_record).
        starts, deadline = 0, time.monotonic() + _START_BUDGET_S
        for rec in self._read(job_id, job):
            step = rec["step"]
            if rec.get("where") != "stasis" or step in job.done:
                continue
            proc = job.open.get(step)
            if proc is None:
                if starts >= _STARTS_PER_POLL or time.monotonic() >= deadline:
                    continue  # the next poll
                if len(job.open) >= _MAX_OPEN:
                    if not job.full:
                        log.warning(
                            "Slurm job %s: %d of its steps run at once: the others are "
                            "not recorded in Slurm",
                            job_id,
                            _MAX_OPEN,
                        )
                        job.full = True
                    job.done.add(step)
                    continue
                starts += 1
                proc = self._start(
                    job_id,
                    job,
                    step,
                    rec.get("name") or "step",
                    min(rec.get("ntasks", 1), _MAX_TASKS),
                )
                if proc is None:
                    job.done.add(step)
                    continue
                job.open[step] = proc
            elif proc.poll() is not None:
                log.warning(
                    "Slurm job %s: the Slurm record of step %d ended early (srun exit " "%s)",
                    job_id,
                    step,
                    proc.returncode,
                )
                del job.open[step]
                job.done.add(step)
                continue
            if "exit" in rec:
                self._tell(proc, f"{rec['exit']} {rec.get('signal', 0)}\n".encode())
                self._ending.append(proc)
                job.told = [p for p in job.told if p.poll() is None] + [proc]
                del job.open[step]
                job.done.add(step)

    def _start(
        self, job_id: str, job: _Job, step: int, name: str, ntasks: int
    ) -> subprocess.Popen[bytes] | None:
        # Found as the daemon finds scontrol: on its own PATH.
        srun = shutil.which("srun")
        if srun is None:
            log.warning(
                "Slurm job %s: no srun on this node: its step %d is not recorded in " "Slurm",
                job_id,
                step,
            )
            return None
        # The name and groups of the uid the job's launcher connected with (SO_PEERCRED), never
        # of the name Slurm's record gave: a job name can forge fields of `scontrol -o` output.
        try:
            user = pwd.getpwuid(job.uid).pw_name
            groups = os.getgrouplist(user, job.gid)
        except (KeyError, OSError):
            user, groups = str(job.uid), [job.gid]
        env = {
            "PATH": f"{os.path.dirname(srun)}:/usr/local/bin:/usr/bin:/bin",
            "USER": user,
            "LOGNAME": user,
            "HOME": "/",
        }
        if self.settings.slurm_conf:
            env["SLURM_CONF"] = self.settings.slurm_conf
        argv = [
            srun,
            f"--jobid={job_id}",
            "--overlap",
            "--nodes=1",
            f"--ntasks={ntasks}",
            f"--nodelist={self.node}",
            f"--job-name={_name(name)}",
            "--quiet",
            "--error=/dev/null",
            "/bin/sh",
            "-c",
            _WAIT,
        ]
        try:
            # In the daemon's session: the reaper leaves it to this Popen.
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                cwd="/",
                user=job.uid,
                group=job.gid,
                extra_groups=groups,
            )
        except OSError as e:
            log.warning(
                "Slurm job %s: cannot start the Slurm record of step %d: %s", job_id, step, e
            )
            return None
        assert proc.stdout is not None
        # Left open until it is reaped: srun must never write into a closed pipe.
        ready, _, _ = select.select([proc.stdout], [], [], _START_WAIT_S)
        if not ready:
            log.warning(
                "Slurm job %s: the Slurm record of step %d has not started after " "%.0f s",
                job_id,
                step,
                _START_WAIT_S,
            )
        return proc

    @staticmethod
    def _tell(proc: subprocess.Popen[bytes], line: bytes) -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(line)
            proc.stdin.flush()
        except OSError:
            pass  # it ended already: nothing to tell
        try:
            proc.stdin.close()
        except OSError:
            pass

    def _forget(self, job_id: str) -> None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return
        for proc in job.open.values():
            try:
                proc.send_signal(signal.SIGTERM)  # srun cancels its step
            except OSError:
                pass
            self._ending.append(proc)
        os.close(job.ns_fd)

    def _reap(self) -> None:
        still = []
        for proc in self._ending:
            if proc.poll() is None:
                still.append(proc)
            elif proc.stdout is not None:
                proc.stdout.close()
        self._ending = still


def _name(text: str) -> str:
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean[:_NAME_MAX] or "step"
