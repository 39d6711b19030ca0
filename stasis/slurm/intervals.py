"""Periodic checkpoint intervals of the Slurm jobs on this node (`STASIS_INTERVAL`).

The launcher keeps time (it asks for each leave-running checkpoint, as it always has); the
daemon says how long to wait. A job's launcher tells the daemon what its job asked for, after it
registered and after each periodic checkpoint:

    POST /slurm/jobs/{id}/interval  {"requested": "auto" | "<seconds>" | "default"}
    GET  /slurm/intervals           every job's current interval and why (root: all; a user:
                                    their own), for `stasis slurm intervals`

`default` is what a job that set no STASIS_INTERVAL asks: the node's `interval` setting decides
(none: the answer's interval_s is 0 and the job is not listed; seconds or `auto`: as if the job had
asked for them, its `why` saying it is the node's default).
`<seconds>` is used as asked (unbounded, as before `auto` existed) and only shown. `auto` is
Young/Daly's interval (stasis.interval) from
  - the job's cost of one checkpoint: the seconds its last checkpoint held it frozen (CRIU's
    dump, which writes the images while the tree is frozen; the upload to the store after the
    thaw costs the job nothing, and the next interval is counted from when the checkpoint
    returned, so checkpoints never overlap). Before the job's first checkpoint on this node:
    estimated from its resident memory at ESTIMATE_BYTES_PER_S (said so);
  - its partition's interruptions per node-hour in Slurm's accounting (stasis.slurm.
    interruptions, read every few minutes), for a job of one node (stasis keeps opted-in jobs
    to one node);
within `interval_min_s` and `interval_max_s`, re-estimated at every ask. The state is the
daemon's memory only: a daemon restarted learns it again at the job's next ask (its cost at its
next checkpoint).
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone
from typing import Any

from stasis import wire
from stasis.config import Settings
from stasis.daemon.activity import Activity
from stasis.daemon.users import Caller
from stasis.interval import choose, mtbi_s
from stasis.slurm.interruptions import RateCache

# A first guess at what a dump costs before one was measured: ~4 s per GB on this project's
# machines (notes/slurm.md), i.e. 250 MB/s.
ESTIMATE_BYTES_PER_S = 250e6


class Intervals:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.rates = RateCache()
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._jobs: dict[str, dict[str, Any]] = {}
        self._costs: dict[str, float] = {}  # Slurm job id -> frozen seconds of its last dump

    def heard(self, activity: Activity) -> None:
        """A checkpoint published on this node (stasis.daemon.activity): its frozen time is
        its job's cost of one checkpoint."""
        if activity.kind != "checkpoint" or activity.frozen_s <= 0:
            return
        with self._lock:
            if activity.job in self._jobs:
                self._costs[activity.job] = activity.frozen_s

    def ask(
        self,
        job_id: str,
        requested: str,
        reg: dict[str, Any],
        partition: str | None,
        rss_bytes: int,
    ) -> dict[str, Any]:
        """The interval job `job_id` (registration `reg`) waits before its next periodic
        checkpoint, and why."""
        node_default = ""
        if requested == "default":
            node_default = f" (this node's default: interval = {self.settings.interval!r})"
            requested = self.settings.interval
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        entry: dict[str, Any] = {
            "slurm_job": job_id,
            "user": reg["user"],
            "uid": reg["uid"],
            "label": reg["label"],
            "partition": partition or "",
            "requested": requested,
            "at": now,
        }
        if not requested:
            entry.update(
                _not_auto(
                    0.0, "none: the job set no STASIS_INTERVAL and this node's `interval` is none"
                )
            )
            with self._lock:  # not listed: it has no interval
                self._jobs.pop(job_id, None)
            return entry
        if requested != "auto":
            seconds = float(requested)
            entry.update(
                _not_auto(
                    seconds,
                    f"the node's default: {requested} s{node_default}"
                    if node_default
                    else f"asked: STASIS_INTERVAL={requested}",
                )
            )
            return self._keep(job_id, entry)
        with self._lock:
            measured = self._costs.get(job_id)
        cost = measured if measured is not None else rss_bytes / ESTIMATE_BYTES_PER_S
        rate, error = self._rate(partition or "")
        mtbi = mtbi_s(rate.rate_per_node_hour) if rate is not None else None
        choice = choose(cost, mtbi, self.settings.interval_min_s, self.settings.interval_max_s)
        why = choice.why()
        if measured is None:
            why += f" (cost estimated from its {rss_bytes / 2**20:.0f} MiB resident memory)"
        if rate is None:
            why += f" (no interruption rate: {error})"
        elif rate.interruptions:
            why += (
                f"; partition {rate.partition}: {rate.interruptions} interruption(s) in "
                f"{rate.node_hours:.2f} node-hours since {rate.since}"
            )
        entry.update(
            interval_s=choice.interval_s,
            why="auto" + node_default + ": " + why,
            cost_s=choice.cost_s,
            cost_measured=measured is not None,
            mtbi_s=choice.mtbi_s,
            raw_s=choice.raw_s,
            bound=choice.bound,
            rate=rate.as_dict() if rate is not None else None,
        )
        return self._keep(job_id, entry)

    def _rate(self, partition: str) -> tuple[Any, str]:
        rate, error = self.rates.get(partition)
        if rate is None:
            # Never read (the daemon just started): read now rather than answer the ceiling for
            # want of a minute; one read at a time, and nobody waits behind a slow one.
            if self._read_lock.acquire(blocking=False):
                try:
                    rate, error = self.rates.get(partition)
                    if rate is None and error == "not read yet":
                        self.rates.refresh()
                        rate, error = self.rates.get(partition)
                finally:
                    self._read_lock.release()
        return rate, error

    def _keep(self, job_id: str, entry: dict[str, Any]) -> dict[str, Any]:
        entry["asked"] = time.time()
        with self._lock:
            self._jobs[job_id] = entry
        return entry

    def forget_except(self, live: set[str]) -> None:
        """Jobs no longer running here are forgotten (the daemon's sweep)."""
        with self._lock:
            for job in set(self._jobs) - live:
                del self._jobs[job]
                self._costs.pop(job, None)

    def listing(self, caller: Caller) -> list[dict[str, Any]]:
        with self._lock:
            found = [dict(e) for e in self._jobs.values()]
        return sorted(
            (e for e in found if caller.is_root or e["uid"] == caller.uid),
            key=lambda e: e["slurm_job"],
        )


def job_interval(entry: dict[str, Any]) -> wire.JobInterval:
    """One job's entry of the listing as the core's GET /intervals has it (`stasis ps`)."""
    rate = entry.get("rate")
    return wire.JobInterval(
        job=entry["slurm_job"],
        kind="slurm",
        label=entry["label"],
        user=entry["user"],
        requested=entry["requested"],
        interval_s=entry["interval_s"],
        why=entry["why"],
        cost_s=entry["cost_s"],
        cost_measured=entry["cost_measured"],
        mtbi_s=entry["mtbi_s"],
        raw_s=entry["raw_s"],
        bound=entry["bound"],
        rate_per_hour=rate.get("rate_per_node_hour") if isinstance(rate, dict) else None,
    )


def _not_auto(interval_s: float, why: str) -> dict[str, Any]:
    """An interval that auto did not choose (none, or the seconds asked): no cost, rate or
    bound to show."""
    return {
        "interval_s": interval_s,
        "why": why,
        "cost_s": None,
        "cost_measured": False,
        "mtbi_s": None,
        "raw_s": None,
        "bound": "",
        "rate": None,
    }
