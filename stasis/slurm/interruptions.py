"""How often a partition's jobs are interrupted, from Slurm's accounting (sacct).

Over a window (30 days by default), per partition:

    interruptions   job records that ended PREEMPTED, NODE_FAIL, REQUEUED, REQUEUE_HOLD or
                    REQUEUE_FED (`sacct -D` keeps every attempt of a requeued job): work was
                    taken from a running job at a time it did not choose
    node_hours      the node-hours its jobs ran within the window (the exposure)
    rate            interruptions per node-hour; a job of N nodes is interrupted N times as often

TIMEOUT is not counted: a time limit is known in advance and not random, and the time-limit
checkpoint (the warning signal before it) covers it; counted, it would make periodic
checkpoints pay for a loss that never happens to a protected job. A REQUEUED record includes
`scontrol requeue`, `stasis slurm drain` and `stasis dump --slurm-job`: maintenance is an
interruption too, from the job's side.

sacct is read by stasis.slurm.report (`query`, `parse_sacct`): the same records, the same
parsing as `stasis slurm report`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from stasis.errors import StasisError
from stasis.slurm import report

log = logging.getLogger("stasis.daemon")

INTERRUPTION_STATES = report.REQUEUE_STATES
WINDOW = timedelta(days=30)
REFRESH_S = 300.0  # the daemon asks sacct again this often (slurmdbd is shared by all nodes)


@dataclass
class PartitionRate:
    partition: str
    interruptions: int = 0
    node_hours: float = 0.0
    since: str = ""
    until: str = ""

    @property
    def rate_per_node_hour(self) -> float:
        return self.interruptions / self.node_hours if self.node_hours > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "rate_per_node_hour": self.rate_per_node_hour}


def rates(
    records: Iterable[report.Record], since: datetime, until: datetime
) -> dict[str, PartitionRate]:
    """Per partition: interruptions that ended in [since, until), node-hours run in it."""
    out: dict[str, PartitionRate] = {}
    fmt = "%Y-%m-%dT%H:%M:%S"
    for r in records:
        if r.start is None or not r.partition:
            continue  # never ran: exposed to nothing
        end = r.end or until  # still running
        ran_s = (min(end, until) - max(r.start, since)).total_seconds()
        p = out.setdefault(
            r.partition,
            PartitionRate(r.partition, since=since.strftime(fmt), until=until.strftime(fmt)),
        )
        if ran_s > 0:
            p.node_hours += r.nnodes * ran_s / 3600
        if r.state in INTERRUPTION_STATES and r.end is not None and since <= r.end < until:
            p.interruptions += 1
    return out


def read(window: timedelta = WINDOW, now: datetime | None = None) -> dict[str, PartitionRate]:
    """Ask sacct (SLURM_CONF picks the cluster); raises SlurmError when it cannot."""
    until = now or datetime.now()  # sacct speaks the cluster's local time
    since = until - window
    return rates(report.parse_sacct(report.query(since, until)), since, until)


class RateCache:
    """The rates the daemon last read, refreshed by its task (`refresh`) every REFRESH_S: a
    job asking for its interval never waits on sacct."""

    def __init__(self, window: timedelta = WINDOW) -> None:
        self.window = window
        self._lock = threading.Lock()
        self._rates: dict[str, PartitionRate] = {}
        self._read_at = 0.0
        self._error = "not read yet"

    def refresh(self) -> None:
        try:
            found = read(self.window)
        except StasisError as e:
            with self._lock:
                if self._error != str(e):
                    log.warning(
                        "interruption rates for STASIS_INTERVAL=auto: %s (the last "
                        "rates read are used; none: the ceiling)",
                        e,
                    )
                self._error = str(e)
            return
        self.put(found)

    def put(self, found: dict[str, PartitionRate]) -> None:
        with self._lock:
            self._rates, self._read_at, self._error = found, time.time(), ""

    def get(self, partition: str) -> tuple[PartitionRate | None, str]:
        """(its rate, "") once read; (None, why) when sacct never answered. A partition sacct
        has no record of has a rate of 0."""
        with self._lock:
            if not self._read_at:
                return None, self._error
            return self._rates.get(partition, PartitionRate(partition)), ""

    def all(self) -> dict[str, PartitionRate]:
        with self._lock:
            return dict(self._rates)
