"""What this node did that others want to hear of: checkpoints published and restores done,
each with the work it keeps. Listeners (the control plane's node integration) are called in the
thread that did it, after it is done; one that raises is logged and never fails the dump or
restore it hears of.

Work kept is counted in seconds of a job's run: a checkpoint holds the seconds its job had run
since it first started (across earlier restores: a restored job starts from its checkpoint's
count, kept in table `job_work`); restoring it keeps that many seconds that a rerun from
scratch would have spent again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, TypedDict

from sqlalchemy import Column, Float, MetaData, String, Table, delete, insert, select, update

from stasis.daemon.db import JobDB

log = logging.getLogger("stasis.daemon")

job_work_table = Table(
    "job_work",
    MetaData(),
    Column("job", String(64), primary_key=True),  # a daemon job id or a Slurm job id
    Column("checkpoint", String(64), nullable=False),  # what it was restored from
    Column("work_s", Float, nullable=False),  # the seconds that checkpoint held
)


@dataclass(frozen=True)
class Activity:
    kind: Literal["checkpoint", "restore"]
    checkpoint: str
    label: str
    job: str
    user: str
    size_bytes: int
    work_s: float  # seconds of the job's run the checkpoint holds (kept by a restore)
    duration_s: float  # CRIU's part
    stored_size_bytes: int = 0
    frozen_s: float = 0.0  # how long the job stood frozen for it (a checkpoint)
    leave_running: bool = True
    store: str = ""
    reason: str = ""  # why it was taken: asked, periodic, preemption or time limit, ...
    at: float = field(default_factory=time.time)


class ReportedJob(TypedDict):
    """A job an integration runs outside the daemon's own jobs (a Slurm job's workload), as
    the node reports it."""

    job: str
    label: str
    user: str
    state: str
    restored_from: str | None
    started: str
    kind: str  # slurm, ...
    partition: str | None  # the scheduler's partition (Kubernetes: the namespace)
    rss_bytes: int  # the resident memory of its processes


@dataclass(frozen=True)
class JobSource:
    """An integration's jobs, as others may act on them through the JobManager: listed, and
    checkpointed (`leave_running` False: stopped, and requeued where a scheduler runs them);
    `drain` (a scheduler's: this node takes no new job, its jobs requeued) and `state` (the
    scheduler's state of this node: IDLE, MIXED+DRAIN, ...) when it has them."""

    kind: str
    jobs: Callable[[], list[ReportedJob]]
    checkpoint: Callable[[str, bool, str], dict[str, object]]  # (job, leave_running, reason)
    drain: Callable[[str], dict[str, object]] | None = None  # (reason)
    state: Callable[[], str] | None = None  # the scheduler's state of this node


Listener = Callable[[Activity], object]


class Listeners:
    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    def add(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def notify(self, activity: Activity) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(activity)
            except Exception as e:  # a listener's trouble is its own
                log.warning(
                    "reporting %s %s failed: %s: %s",
                    activity.kind,
                    activity.checkpoint,
                    type(e).__name__,
                    e,
                )


class JobWork:
    """Seconds of work each running job started from (table `job_work`)."""

    def __init__(self, db: JobDB) -> None:
        self.db = db
        db.create_tables([job_work_table])

    def started_from(self, job: str, checkpoint: str, work_s: float) -> None:
        with self.db.transaction() as conn:
            n = conn.execute(
                update(job_work_table)
                .where(job_work_table.c.job == job)
                .values(checkpoint=checkpoint, work_s=work_s)
            ).rowcount
            if not n:
                conn.execute(
                    insert(job_work_table).values(job=job, checkpoint=checkpoint, work_s=work_s)
                )

    def forget(self, job: str) -> None:
        """`job` starts from nothing (a Slurm job run again from its start)."""
        with self.db.transaction() as conn:
            conn.execute(delete(job_work_table).where(job_work_table.c.job == job))

    def at(self, job: str, started: str | datetime, now: datetime) -> float:
        """The seconds of work `job` holds at `now`, having (re)started at `started`."""
        with self.db.transaction() as conn:
            base = conn.execute(
                select(job_work_table.c.work_s).where(job_work_table.c.job == job)
            ).scalar()
        begun = datetime.fromisoformat(started) if isinstance(started, str) else started
        if begun.tzinfo is None:
            begun = begun.replace(tzinfo=now.tzinfo)
        return round(float(base or 0.0) + max(0.0, (now - begun).total_seconds()), 3)


def work_of(extra: dict[str, object]) -> float:
    """The work a checkpoint's manifest says it holds (0 for one written before it did)."""
    value = extra.get("work_s")
    return float(value) if isinstance(value, (int, float)) else 0.0
