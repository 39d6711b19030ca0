"""`auto` checkpoint intervals of containers (`STASIS_INTERVAL=auto`, `stasis.dev/interval: auto`).

Young/Daly's interval (stasis.interval) from
  - the container's cost of one checkpoint: the seconds its last checkpoint on this node held it
    paused (runc's dump and the capture of its writable layer; the upload after the resume costs
    it nothing). Before its first checkpoint here: estimated from its processes' resident memory
    at ESTIMATE_BYTES_PER_S (said so);
  - the interruption rate the site sets, `k8s_interruption_rate_per_hour` (evictions,
    preemptions, node drains and failures per pod-hour on its clusters): a pod's interruptions
    come from the scheduler, the autoscaler and the node's admins, none of which one node can
    count (a deleted pod does not say why; its replacement comes up on another node), so the
    rate is the site's, as its own records measure it. 0 (no rate): the ceiling;
within max(`interval_min_s`, `k8s_min_interval_s`) and `interval_max_s`, re-estimated each time
it is asked (every second, by the daemon's interval task). The measured costs are the daemon's
memory only: a daemon restarted estimates again until the container's next checkpoint.

A container that asks for no interval (no STASIS_INTERVAL, no stasis.dev/interval) gets the
node's `interval` setting (`container_interval`): none (the default), seconds, or `auto`;
STASIS_INTERVAL=off (or 0) asks for none whatever the node's default.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from stasis import wire
from stasis.config import Settings
from stasis.daemon.activity import Activity
from stasis.interval import Choice, choose, mtbi_s
from stasis.k8s.runc import Bundle

# A first guess at what a dump costs before one was measured: ~4 s per GB on this project's
# machines (notes/slurm.md), i.e. 250 MB/s (the Slurm integration's guess too).
ESTIMATE_BYTES_PER_S = 250e6

# What a container's row holds in `interval_s` when it asked for `auto`.
AUTO = -1
# A container's resident memory (its cost's estimate before a measured one) is read this
# seldom: the daemon asks for every auto container's interval every second.
_RSS_TTL_S = 30.0


def container_interval(bundle: Bundle, node_default: str) -> int:
    """The interval a container's own environment gives it (seconds, AUTO, 0: none), the
    node's `interval` setting (`node_default`: "", "auto" or seconds) where it asks for none."""
    if bundle.interval_auto:
        return AUTO
    if not bundle.interval_default:
        return bundle.interval_s
    if node_default == "auto":
        return AUTO
    return max(1, round(float(node_default))) if node_default else 0


class AutoIntervals:
    """Measured costs of the containers' checkpoints, and the interval `auto` gives each."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._costs: dict[str, float] = {}  # container id -> frozen seconds of its last dump
        self._rss: dict[str, tuple[float, int]] = {}  # container id -> (when read, bytes)

    def heard(self, activity: Activity) -> None:
        """A checkpoint published on this node (stasis.daemon.activity): its frozen time is
        its container's cost of one checkpoint."""
        if activity.kind != "checkpoint" or activity.frozen_s <= 0:
            return
        with self._lock:
            self._costs[activity.job] = activity.frozen_s

    def forget(self, container_id: str) -> None:
        with self._lock:
            self._costs.pop(container_id, None)
            self._rss.pop(container_id, None)

    @property
    def floor_s(self) -> float:
        return max(self.settings.interval_min_s, float(self.settings.k8s_min_interval_s))

    @property
    def rate_per_hour(self) -> float:
        return max(0.0, self.settings.k8s_interruption_rate_per_hour)

    def choice(self, container_id: str, rss_of: Callable[[], int]) -> tuple[Choice, int | None]:
        """Container `container_id`'s interval, and the resident memory its cost was estimated
        from (None: its cost was measured)."""
        with self._lock:
            measured = self._costs.get(container_id)
        rss: int | None = None
        if measured is None:
            rss = self._resident(container_id, rss_of)
        cost = measured if measured is not None else (rss or 0) / ESTIMATE_BYTES_PER_S
        mtbi = mtbi_s(self.rate_per_hour)
        return choose(cost, mtbi, self.floor_s, self.settings.interval_max_s), rss

    def _resident(self, container_id: str, rss_of: Callable[[], int]) -> int:
        now = time.monotonic()
        with self._lock:
            kept = self._rss.get(container_id)
        if kept is not None and now - kept[0] < _RSS_TTL_S:
            return kept[1]
        rss = rss_of()
        with self._lock:
            self._rss[container_id] = (now, rss)
        return rss

    def job_interval(self, row: dict[str, Any], rss_of: Callable[[], int]) -> wire.JobInterval:
        """A registered container's interval as GET /intervals has it (`stasis ps`)."""
        cid, label, user = row["container_id"], row["label"], f"k8s:{row['namespace']}"
        if row["interval_s"] != AUTO:
            return wire.JobInterval(
                job=cid,
                kind="container",
                label=label,
                user=user,
                requested=str(row["interval_s"]),
                interval_s=float(row["interval_s"]),
                why=(
                    f"asked: {row['interval_s']} s (STASIS_INTERVAL, the pod's "
                    "stasis.dev/interval, else this node's default `interval`; never below "
                    f"this node's k8s_min_interval_s, {self.settings.k8s_min_interval_s} s)"
                ),
                cost_s=None,
                cost_measured=False,
                mtbi_s=None,
                raw_s=None,
                bound="",
                rate_per_hour=None,
            )
        choice, rss = self.choice(cid, rss_of)
        why = "auto: " + choice.why()
        if rss is not None:
            why += f" (cost estimated from its {rss / 2**20:.0f} MiB resident memory)"
        why += (
            f"; k8s_interruption_rate_per_hour {self.rate_per_hour:g}"
            if self.rate_per_hour > 0
            else "; no interruption rate set (k8s_interruption_rate_per_hour is 0)"
        )
        return wire.JobInterval(
            job=cid,
            kind="container",
            label=label,
            user=user,
            requested="auto",
            interval_s=choice.interval_s,
            why=why,
            cost_s=choice.cost_s,
            cost_measured=rss is None,
            mtbi_s=choice.mtbi_s,
            raw_s=choice.raw_s,
            bound=choice.bound,
            rate_per_hour=self.rate_per_hour,
        )
