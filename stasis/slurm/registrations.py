"""Slurm jobs under stasis on this node: registering a job's workload, checkpointing it (and
requeueing the job), retiring its label when it ends. The daemon side of the integration.

A registration is accepted only from the job's own launcher: the process named must be the
caller's child, run as the caller's uid, be the init of a PID namespace, and `scontrol pidinfo`
must put the caller in that Slurm job, which Slurm must say is the caller's. Afterwards a user may
act only on their own jobs (root on all). Registrations are rows of the daemon's database
(table `slurm_jobs`), so they survive a restart of the daemon; the JSON files an older daemon
kept in <state_dir>/slurm/ are moved there at the first start. Each row is kept as a file too
(stasis.daemon.records): a corrupt database is rebuilt with them, and a job registered before
is still checkpointed at its preemption and restored at its requeue.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import signal
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast, get_args, get_origin, get_type_hints

from sqlalchemy import (
    Column,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    delete,
    insert,
    inspect,
    select,
    text,
    update,
)

from stasis import faults
from stasis.daemon import records
from stasis.daemon.db import JobDatabaseError, JobDB
from stasis.daemon.jobs import JobManager
from stasis.daemon.users import Caller
from stasis.engine import cgroupjoin, proctree
from stasis.errors import (
    CheckpointError,
    NotFoundError,
    PermissionDeniedError,
    SlurmError,
    SlurmJobNotFoundError,
    StasisError,
    UsageError,
)
from stasis.slurm import jobcut, scontrol, steps
from stasis.slurm.labels import candidates, cut_candidates, slurm_extra
from stasis.slurm.mirrors import Mirrors
from stasis.slurm.models import CheckpointRequest, FinishRequest, RegisterRequest
from stasis.store import (
    CheckpointInfo,
    Manifest,
    is_checkpoint_id,
    new_checkpoint_id,
    validate_checkpoint_id,
    validate_label,
)
from stasis.wire import FinishAnswer, Registration, SlurmCheckpointAnswer

log = logging.getLogger("stasis.daemon")

_metadata = MetaData()
slurm_jobs_table = Table(
    "slurm_jobs",
    _metadata,
    Column("slurm_job", String(16), primary_key=True),
    Column("pid", Integer, nullable=False),
    Column("pid_start", Integer, nullable=True),
    Column("launcher_pid", Integer, nullable=False),
    Column("uid", Integer, nullable=False),
    Column("gid", Integer, nullable=False),
    Column("user", String(64), nullable=False),
    Column("label", String(128), nullable=False),
    Column("explicit_label", Integer, nullable=False),
    Column("token", String(128), nullable=False),
    Column("stdout", Text, nullable=False),
    Column("stderr", Text, nullable=False),
    Column("work_dir", Text, nullable=False),
    Column("command", Text, nullable=False),  # JSON list
    Column("state", String(16), nullable=False),
    Column("registered", String(32), nullable=False),
    # Issue 28 (added to an older table by Registrations.upgrade):
    Column("stop_asked", Integer, nullable=False, server_default="0"),
    Column("final_failed", Integer, nullable=False, server_default="0"),
    Column("stop_checkpoint", String(64), nullable=True),
    Column("restarts", Integer, nullable=False, server_default="0"),
    Column("restored_from", String(64), nullable=True),
    info={records.KEY: records.ALL},
)
# Columns a table made by an older daemon lacks: (name, SQL type and default).
_ADDED = (
    ("stop_asked", "INTEGER NOT NULL DEFAULT 0"),
    ("final_failed", "INTEGER NOT NULL DEFAULT 0"),
    ("stop_checkpoint", "VARCHAR(64)"),
    ("restarts", "INTEGER NOT NULL DEFAULT 0"),
    ("restored_from", "VARCHAR(64)"),
)
# A run whose workload is being stopped or was: not `running` any more, not ended either.
_STOPPED = ("stopping", "checkpointed", "requeued")
# How long a daemon back from a crash keeps trying to finish a stop it had begun (the tree may
# still be held by the CRIU of the dead daemon; the grace time bounds it in any case).
_RECOVER_TRIES = 10
_RECOVER_PAUSE_S = 2.0
_ROOT = Caller(pid=0, uid=0, gid=0)

# The job's last step's Slurm record must end before the job does (that ends it as cancelled):
# its end waits that long at most for it.
_MIRRORS_WAIT_S = 5.0


def _slurm_requeues(job_id: str) -> bool:
    """Whether Slurm requeues the job by itself once its batch step ends: it is being preempted,
    on a Slurm that does so (scontrol.requeues_preempted_job_when_it_ends); a requeue of ours as
    well would make it run twice. When Slurm cannot tell, we requeue."""
    try:
        return (
            scontrol.job_info(job_id).preempted and scontrol.requeues_preempted_job_when_it_ends()
        )
    except SlurmError:
        return False


# What a workload's /proc files may give at most: its command line is the user's to make as long as
# the kernel lets (up to the stack limit); a registration keeps its first 64 KiB.
_PROC_READ_MAX = 64 * 1024


def _read_proc(pid: int, name: str) -> bytes:
    """The first _PROC_READ_MAX bytes of /proc/PID/NAME, never following a link."""
    fd = os.open(f"/proc/{int(pid)}/{name}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        chunks: list[bytes] = []
        left = _PROC_READ_MAX
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _user_name(uid: int) -> str:
    """The account name of `uid` as this node knows it (never what Slurm prints: a job's name
    can forge that)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _status(pid: int) -> dict[str, str]:
    try:
        text = _read_proc(pid, "status").decode(errors="replace")
    except OSError:
        raise UsageError(f"no process {pid}") from None
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


class Registrations:
    """The `slurm_jobs` table, each row kept as a file under `records_root` too (None: not
    kept, a test's table)."""

    def __init__(self, db: JobDB, records_root: Path | None = None) -> None:
        self.db = db
        self._records = records.Records(db, records_root) if records_root else None

    def _kept(self, job_id: str) -> None:
        if self._records is not None:
            self._records.refresh(slurm_jobs_table, job_id)

    def save(self, reg: Registration) -> None:
        values: dict[str, object] = {**reg, "command": json.dumps(reg["command"])}
        with self.db.transaction() as conn:
            conn.execute(
                delete(slurm_jobs_table).where(slurm_jobs_table.c.slurm_job == reg["slurm_job"])
            )
            conn.execute(insert(slurm_jobs_table).values(**values))
        self._kept(reg["slurm_job"])

    def get(self, job_id: str) -> Registration | None:
        with self.db.transaction() as conn:
            row = conn.execute(
                select(slurm_jobs_table).where(slurm_jobs_table.c.slurm_job == job_id)
            ).first()
        return _registration(row._mapping) if row else None

    def running(self) -> list[Registration]:
        with self.db.transaction() as conn:
            rows = conn.execute(
                select(slurm_jobs_table).where(slurm_jobs_table.c.state == "running")
            ).all()
        return [_registration(r._mapping) for r in rows]

    def set_state(self, job_id: str, state: str, pid: int | None = None, **values: object) -> None:
        """`pid`: only if the registration is still of the run whose workload that is."""
        query = update(slurm_jobs_table).where(slurm_jobs_table.c.slurm_job == job_id)
        if pid is not None:
            query = query.where(slurm_jobs_table.c.pid == pid)
        with self.db.transaction() as conn:
            conn.execute(query.values(state=state, **values))
        self._kept(job_id)

    def in_state(self, *states: str) -> list[Registration]:
        with self.db.transaction() as conn:
            rows = conn.execute(
                select(slurm_jobs_table).where(slurm_jobs_table.c.state.in_(states))
            ).all()
        return [_registration(r._mapping) for r in rows]

    def upgrade(self) -> None:
        """Add the columns an older daemon's table lacks (its rows: nothing asked yet)."""
        with self.db.transaction() as conn:
            have = {c["name"] for c in inspect(conn).get_columns("slurm_jobs")}
            for name, kind in _ADDED:
                if name not in have:
                    conn.execute(text(f"ALTER TABLE slurm_jobs ADD COLUMN {name} {kind}"))

    def remove(self, job_id: str) -> None:
        with self.db.transaction() as conn:
            conn.execute(delete(slurm_jobs_table).where(slurm_jobs_table.c.slurm_job == job_id))
        self._kept(job_id)

    def migrate(self, legacy: Path) -> int:
        """Move the registrations an older daemon kept as <legacy>/<job>.json into the table."""
        moved = 0
        try:
            files = sorted(legacy.glob("*.json"))
        except OSError:
            return 0
        for path in files:
            try:
                reg = _legacy(path)
            except (OSError, ValueError) as e:
                log.warning("Slurm registration %s left where it is: %s", path, e)
                continue
            if self.get(reg["slurm_job"]) is None:
                self.save(reg)
                moved += 1
            path.unlink(missing_ok=True)
        try:
            legacy.rmdir()
        except OSError:
            pass  # not empty (files we could not read), or never there
        return moved


def _registration(row: Any) -> Registration:
    data = dict(row)
    data["command"] = json.loads(data["command"])
    data["explicit_label"] = bool(data["explicit_label"])
    data["stop_asked"] = bool(data.get("stop_asked"))
    data["final_failed"] = bool(data.get("final_failed"))
    data["restarts"] = int(data.get("restarts") or 0)
    return cast(Registration, data)


def _legacy(path: Path) -> Registration:
    """A registration an older daemon wrote as JSON: every field there, each of its kind."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    data.setdefault("state", "running")
    for key, value in (
        ("stop_asked", False),
        ("final_failed", False),
        ("stop_checkpoint", None),
        ("restarts", 0),
        ("restored_from", None),
    ):
        data.setdefault(key, value)
    hints = get_type_hints(Registration)
    for key, hint in hints.items():
        if key not in data:
            raise ValueError(f"no {key}")
        if not _of_kind(data[key], hint):
            raise ValueError(f"{key} is {data[key]!r}, not of the kind {hint}")
    return cast(Registration, {k: data[k] for k in hints})


def _of_kind(value: object, hint: Any) -> bool:
    """Whether a JSON value fits a field's type (str, int, bool, list[str], X | None)."""
    args = get_args(hint)
    if get_origin(hint) is list:
        return isinstance(value, list) and all(_of_kind(v, args[0]) for v in value)
    if args:  # a union: X | None
        return any(_of_kind(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


class SlurmJobs:
    def __init__(self, manager: JobManager, mirrors: Mirrors | None = None) -> None:
        self.manager = manager
        self.mirrors = mirrors  # Slurm's records of the steps stasis runs (None: not kept)
        self.registrations = Registrations(manager.db, manager.settings.layout.records)
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        # What the database refused of a stop carried out (the workload killed or resumed
        # already): job -> (its workload's pid, state, values), written by `record_pending`.
        # Until then the registration says `stopping`, which a daemon started again finishes.
        self._pending: dict[str, tuple[int, str, dict[str, object]]] = {}
        self._pending_lock = threading.Lock()

    def _load(self, job_id: str, caller: Caller) -> Registration:
        reg = self.registrations.get(scontrol.validate_slurm_job_id(job_id))
        if reg is None:
            raise NotFoundError(f"Slurm job {job_id} is not under stasis on this node")
        caller.require(reg["uid"], f"Slurm job {job_id}")
        return reg

    def _lock(self, job_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(job_id, threading.Lock())

    # -- endpoints (blocking; run in threads) ---------------------------------------------------

    def register(self, req: RegisterRequest, caller: Caller) -> Registration:
        job_id = scontrol.validate_slurm_job_id(req.slurm_job)
        validate_label(req.label)
        st = _status(req.pid)
        if int(st.get("PPid", "-1")) != caller.pid:
            raise PermissionDeniedError(
                f"permission denied: process {req.pid} is not yours " "(not a child of the caller)"
            )
        if int(st.get("Uid", "-1").split()[0]) != caller.uid:
            raise PermissionDeniedError(
                f"permission denied: process {req.pid} runs as another " "user"
            )
        nspid = st.get("NSpid", "").split()
        if len(nspid) < 2 or nspid[-1] != "1":
            raise UsageError(f"process {req.pid} is not the init of a PID namespace")
        if scontrol.job_of_pid(caller.pid) != job_id:
            raise PermissionDeniedError(
                f"permission denied: the caller is not part of Slurm job " f"{job_id}"
            )
        try:
            info = scontrol.job_info(job_id)
        except SlurmError as e:
            log.warning("Slurm job %s (uid %d) not registered: %s", job_id, caller.uid, e)
            raise
        # Slurm's uid must agree with the kernel's; the identity kept is the kernel's alone.
        if info.uid != caller.uid:
            raise PermissionDeniedError(f"permission denied: Slurm job {job_id} is not yours")
        if not req.explicit_label and req.label != job_id:
            raise UsageError("without an explicit label the label is the job id")
        try:
            # A restored tree is where its restorer ran, before slurmstepd placed the task:
            # into the step's cgroups with the launcher (engine/cgroupjoin.py).
            cgroupjoin.join(caller.pid, req.pid)
        except OSError as e:
            log.warning("Slurm job %s: its tree stays outside the step's cgroups: %s", job_id, e)
        if jobcut.spans_nodes(job_id):
            # A part of a job on several nodes: frozen with the others in its cuts.
            try:
                jobcut.adopt(job_id, req.pid)
            except (OSError, StasisError) as e:
                raise CheckpointError(
                    f"Slurm job {job_id} spans nodes but its batch tree cannot be put in a "
                    f"freezer cgroup of its own ({e}); it runs unprotected"
                ) from e
        try:
            cmdline = _read_proc(req.pid, "cmdline").split(b"\0")
            command = [c.decode(errors="replace") for c in cmdline if c]
        except OSError:
            command = []
        reg = Registration(
            slurm_job=job_id,
            pid=req.pid,
            pid_start=proctree.start_time(req.pid),
            launcher_pid=caller.pid,
            uid=caller.uid,
            gid=caller.gid,
            user=_user_name(caller.uid),
            label=req.label,
            explicit_label=req.explicit_label,
            token=info.token,
            stdout=info.stdout,
            stderr=info.stderr or info.stdout,
            work_dir=info.work_dir,
            command=command or ["(slurm batch job)"],
            state="running",
            registered=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            stop_asked=False,
            final_failed=False,
            stop_checkpoint=None,
            restarts=info.restarts,
            restored_from=None,
        )
        # Before anything is kept: another user's checkpoint is refused, not counted.
        manifest = self._restored_from(reg, req.restored_from)
        # Its checkpoints descend from it (their parent), even when the store could not be
        # read just now; a forged id can only misplace the caller's own label (publish checks
        # the parent's owner and label).
        if manifest is not None:
            reg["restored_from"] = manifest.id
        elif req.restored_from is not None and is_checkpoint_id(req.restored_from):
            reg["restored_from"] = req.restored_from
        self.sweep()
        self.registrations.save(reg)
        with self._pending_lock:
            self._pending.pop(job_id, None)  # of a run before this one: its row is replaced
        if self.mirrors is not None:
            self.mirrors.begin(reg, fresh=req.restored_from is None)
        self._started(reg, manifest)
        return reg

    def _restored_from(self, reg: Registration, checkpoint: str | None) -> Manifest | None:
        """The caller's checkpoint its workload was restored from (None: none, or unreadable:
        the work is then counted from nothing)."""
        if checkpoint is None:
            return None
        try:
            manifest = self.manager.store.get(validate_checkpoint_id(checkpoint))
        except StasisError as e:
            log.warning(
                "Slurm job %s: cannot read checkpoint %s it was restored from: %s",
                reg["slurm_job"],
                checkpoint,
                e,
            )
            return None
        if manifest.uid != reg["uid"]:
            raise PermissionDeniedError(
                f"permission denied: checkpoint {manifest.id} is not " "yours"
            )
        return manifest

    def _started(self, reg: Registration, manifest: Manifest | None) -> None:
        """Count the job's work from the checkpoint it was restored from (or from nothing),
        and tell who listens of that restore."""
        self.manager.restarted(reg["slurm_job"], manifest, reg["user"], "Slurm requeue")

    def sweep(self) -> None:
        """Forget registrations of workloads that ended without telling us (scancel, crash)."""
        with self._pending_lock:
            waiting = set(self._pending)  # stopped on purpose; their record is late
        for old in self.registrations.running():
            if old["slurm_job"] not in waiting and not proctree.alive(old["pid"], old["pid_start"]):
                self.registrations.remove(old["slurm_job"])
                jobcut.forget(old["slurm_job"])

    def get(self, job_id: str, caller: Caller) -> Registration:
        return self._load(job_id, caller)

    def checkpoint(
        self, job_id: str, req: CheckpointRequest, caller: Caller
    ) -> SlurmCheckpointAnswer:
        lock = self._lock(job_id)
        if not lock.acquire(blocking=False):
            raise UsageError(f"a checkpoint of Slurm job {job_id} is already being taken")
        try:
            return self._checkpoint(job_id, req, caller)
        finally:
            lock.release()

    def _checkpoint(
        self, job_id: str, req: CheckpointRequest, caller: Caller
    ) -> SlurmCheckpointAnswer:
        reg = self._load(job_id, caller)
        if reg["state"] in ("checkpointed", "requeued") or not proctree.alive(
            reg["pid"], reg["pid_start"]
        ):
            raise UsageError(f"Slurm job {job_id} has no running workload on this node")
        # A step on Slurm's own srun runs outside the tree: its restored client would wait for a
        # step that is gone.
        outside = steps.real_srun_running(reg["pid"])
        if outside:
            raise CheckpointError(
                f"Slurm job {job_id} is not checkpointed: " f"{steps.refusal(outside)}"
            )
        m = self.manager
        created = datetime.now(timezone.utc)
        info = CheckpointInfo(
            id=new_checkpoint_id(created),
            label=reg["label"],
            job=job_id,
            host=m.settings.node,
            created=created,
            criu_version=m.criu_version(m.criu),
            command=reg["command"],
            cwd=reg["work_dir"] or "/",
            user=reg["user"],
            uid=reg["uid"],
            gid=reg["gid"],
            log_path=reg["stdout"] or None,
            parent=reg.get("restored_from"),
            extra={
                **slurm_extra(
                    job_id, reg["token"], reg["explicit_label"], reg["stdout"], reg["stderr"]
                ),
                "work_s": m.work.at(job_id, reg["registered"], created),
            },
        )
        if not req.leave_running:
            # Written before anything is frozen: this run's end retires nothing now, and a
            # daemon that dies from here on finishes the stop when it starts (`recover`). A
            # database that refuses it does not cost the checkpoint (the freeze itself is
            # journaled by checkpoint_tree): it is written as soon as it can be.
            self._record(reg, "stopping", stop_asked=1, stop_checkpoint=info.id)
            faults.point("slurm.checkpoint-asked")
        try:
            if jobcut.spans_nodes(job_id):
                # Every part of the job on every node, in one cut (stasis.slurm.jobcut).
                taken, batch = jobcut.take(
                    m, m.settings, reg["pid"], info, req.leave_running, req.reason
                )
                checkpoint_id = info.id  # the batch tree's (its registration's record)
                label, size, duration = taken.label, 0, taken.frozen_s
                if taken.unfinished:
                    log.warning("Slurm job %s: its cut %s: %s", job_id, label, taken.unfinished)
            else:
                manifest, result, _ = m.dumper.checkpoint_tree(
                    reg["pid"],
                    info,
                    req.leave_running,
                    "none",
                    f"Slurm job {job_id}",
                    reason=req.reason,
                )
                checkpoint_id, label = manifest.id, manifest.label
                size, duration = manifest.size_bytes, result.duration_s
        except BaseException:
            if not req.leave_running:
                # The tree runs on (checkpoint_tree resumed it): only the record may wait.
                self._record(reg, "running", final_failed=1)
            raise
        answer = SlurmCheckpointAnswer(
            checkpoint=checkpoint_id,
            label=label,
            slurm_job=job_id,
            size_bytes=size,
            duration_s=round(duration, 4),
            requeued=False,
            slurm_requeues=False,
        )
        if not req.leave_running:
            faults.point("slurm.after-publish")
            self._stopped(reg, checkpoint_id)
            faults.point("slurm.before-requeue")
            answer["requeued"] = True
            answer["slurm_requeues"] = self._requeue(reg, checkpoint_id)
        return answer

    def _stopped(self, reg: Registration, checkpoint: str) -> None:
        """The stop checkpoint is published: the workload goes (it must never run beside it),
        whether or not the database takes the record now (frozen until it did, it would be
        neither running nor requeued); a refused record is written later (`record_pending`),
        and a daemon killed before then finds the registration `stopping` and finishes it."""
        job_id = reg["slurm_job"]
        self._record(reg, "checkpointed")
        if proctree.alive(reg["pid"], reg["pid_start"]):
            os.kill(reg["pid"], signal.SIGKILL)  # the namespace init: the whole tree goes
        if self.mirrors is not None:
            self.mirrors.end(job_id)
        self.manager.dumper.dump_settled(checkpoint)

    def _requeue(self, reg: Registration, checkpoint: str) -> bool:
        """Requeue the job, unless Slurm does it itself (then True: the launcher must end)."""
        job_id = reg["slurm_job"]
        if _slurm_requeues(job_id):
            self._record(reg, "requeued")
            return True
        try:
            scontrol.requeue(job_id)
        except SlurmError as e:
            self._record(reg, "requeue-failed")
            raise CheckpointError(
                f"checkpoint {checkpoint} of Slurm job {job_id} was taken but the job could "
                f"not be requeued ({e}); submit it again with STASIS_CHECKPOINT="
                f"{reg['label']} to resume"
            ) from e
        self._record(reg, "requeued")
        return False

    def _record(self, reg: Registration, state: str, **values: object) -> None:
        """Write the run's new state, or keep it for `record_pending` if the database refuses
        it (locked, full): what was done to the workload is done either way."""
        job_id = reg["slurm_job"]
        with self._pending_lock:
            earlier = self._pending.pop(job_id, None)
        if earlier is not None:
            values = {**earlier[2], **values}  # what was refused before, then this
        try:
            self.registrations.set_state(job_id, state, pid=reg["pid"], **values)
            return
        except JobDatabaseError as e:
            log.warning(
                "Slurm job %s: %s, but the daemon's database cannot record it yet "
                "(retried every second): %s",
                job_id,
                state,
                e,
            )
        with self._pending_lock:
            self._pending[job_id] = (reg["pid"], state, values)

    def record_pending(self) -> None:
        """Write the states the database refused (a periodic task of the daemon)."""
        with self._pending_lock:
            waiting = list(self._pending.items())
        for job_id, (pid, state, values) in waiting:
            try:
                self.registrations.set_state(job_id, state, pid=pid, **values)
            except JobDatabaseError:
                return  # the same for the others: next time
            with self._pending_lock:
                if self._pending.get(job_id) == (pid, state, values):
                    del self._pending[job_id]
            log.info("Slurm job %s: recorded %s now", job_id, state)

    # -- a daemon back from a crash --------------------------------------------------------------

    def recover(self) -> None:
        """Finish the stops a killed daemon left half done (at start, in a thread of its own):
        published: the workload goes and the job is requeued; not published and the workload
        still runs: the stop checkpoint is taken again (it was asked, and a preemption's grace
        time may still allow it); otherwise the run goes on, its end retiring nothing."""
        while True:
            try:
                regs = self.registrations.in_state("stopping", "checkpointed")
                break
            except JobDatabaseError as e:
                # A database that refuses reads now (locked) may take them in a moment; the
                # trees themselves were settled already (killed when published, else resumed).
                log.warning("Slurm stops a stopped daemon began: cannot read them yet: %s", e)
                time.sleep(_RECOVER_PAUSE_S)
        for reg in regs:
            try:
                self._recover(reg)
            except Exception:  # one job's trouble must not keep the others unsettled
                log.exception(
                    "Slurm job %s: cannot finish the stop a stopped daemon had begun",
                    reg["slurm_job"],
                )

    def _recover(self, reg: Registration) -> None:
        job_id = reg["slurm_job"]
        checkpoint = reg.get("stop_checkpoint")
        if reg["state"] == "checkpointed" or (checkpoint and self._published(checkpoint)):
            assert checkpoint is not None
            log.warning(
                "Slurm job %s: checkpoint %s was published before the daemon stopped; "
                "the job is stopped and requeued now, as asked",
                job_id,
                checkpoint,
            )
            self._stopped(reg, checkpoint)
            if self._requeued_since(reg):
                self._record(reg, "requeued")
            else:
                self._requeue(reg, checkpoint)
            return
        for _ in range(_RECOVER_TRIES):
            if not proctree.alive(reg["pid"], reg["pid_start"]):
                break
            try:
                self.checkpoint(
                    job_id,
                    CheckpointRequest(
                        leave_running=False, reason="stop asked before a daemon restart"
                    ),
                    _ROOT,
                )
                log.warning(
                    "Slurm job %s: the stop checkpoint a stopped daemon had begun was "
                    "taken again; the job is requeued",
                    job_id,
                )
                return
            except StasisError as e:
                # The tree may still be held by the dead daemon's CRIU: wait and try again.
                log.warning(
                    "Slurm job %s: the stop checkpoint asked before the daemon stopped "
                    "cannot be taken yet: %s",
                    job_id,
                    e,
                )
                time.sleep(_RECOVER_PAUSE_S)
        self._record(reg, "running", final_failed=1)

    def _published(self, checkpoint: str) -> bool:
        try:
            self.manager.store.get(validate_checkpoint_id(checkpoint))
            return True
        except StasisError:
            return False

    @staticmethod
    def _requeued_since(reg: Registration) -> bool:
        """Whether Slurm already requeued this run (a second requeue would run it twice)."""
        try:
            info = scontrol.job_info(reg["slurm_job"])
        except SlurmJobNotFoundError:
            return True  # Slurm forgot the job (long ended): nothing to requeue any more
        except SlurmError:
            return False
        return info.restarts > reg.get("restarts", 0) or info.state in (
            "PENDING",
            "REQUEUED",
            "REQUEUE_HOLD",
            "REQUEUE_FED",
        )

    def finish(self, job_id: str, req: FinishRequest, caller: Caller) -> FinishAnswer:
        reg = self._load(job_id, caller)
        if not caller.is_root and caller.pid != reg["launcher_pid"]:
            raise PermissionDeniedError(
                "permission denied: only the job's launcher reports its " "end"
            )
        retired: list[str] = []
        # Retired only on a genuine success: an exit status (not a guess), 0, and nothing of
        # this run asked to stop it; a job that traps SIGTERM and exits 0 after its stop
        # checkpoint failed still needs the checkpoint before it.
        stopped = req.stopped or reg.get("stop_asked", False) or reg.get("final_failed", False)
        with self._pending_lock:
            # Only a stop writes states the database may refuse: one waiting is a stop asked.
            stopped = stopped or job_id in self._pending
        if req.exit_code is None or stopped:
            log.info(
                "Slurm job %s ended (exit %s%s): label %s kept",
                job_id,
                req.exit_code,
                ", a stop was asked" if stopped else "",
                reg["label"],
            )
        if req.exit_code == 0 and not stopped:
            store = self.manager.store
            found = candidates(
                store, reg["label"], reg["explicit_label"], reg["uid"], job_id, reg["token"]
            )
            if jobcut.spans_nodes(job_id):
                # Its cuts' checkpoints, every part's (each cut has a label of its own).
                found += cut_candidates(
                    store.list(uid=reg["uid"]),
                    reg["label"],
                    reg["explicit_label"],
                    reg["uid"],
                    job_id,
                    reg["token"],
                )
            retired = store.catalog.retire(m.id for m in found)
        if self.mirrors is not None:
            self.mirrors.end(job_id, wait_s=_MIRRORS_WAIT_S)
        self.registrations.remove(job_id)
        jobcut.forget(job_id)
        with self._pending_lock:
            self._pending.pop(job_id, None)  # nothing left to record it in
        return FinishAnswer(retired=retired)
