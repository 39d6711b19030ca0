"""What the control plane measures for a policy's `every auto`: each job's checkpoint cost and
its cluster's interruption rate, and the interval stasis.interval.choose makes of them (the
same function a node uses for `STASIS_INTERVAL=auto`).

    cost   the mean frozen time (seconds the job stood still) of the newest `COST_SAMPLES`
           checkpoints of the job's (cluster, user, label), as its nodes reported them; none
           yet: 0, which gives the floor, so that the first checkpoint measures it
    rate   per cluster, interruptions per node-hour over the last `WINDOW_S` (30 days) in the
           control plane's own tables: nodes found lost (`node-lost` events), drains it sent
           (`drain` commands), and checkpoints that stopped a job for a preemption or a
           requeue (their reason says so); over the node-hours its nodes were there (since
           they joined, or the window's start, until now or until they were found lost).
           Every job counts as one node (the nodes report single-node jobs): its mean time
           between interruptions is 1 / rate. No interruption in the window: no rate, the
           ceiling (stasis.interval)
    bounds the control plane's floor (`controlplane_min_interval_s`, `serve --min-interval`)
           and ceiling (`controlplane_max_interval_s`, `serve --max-interval`)

Both are read again at every look, so the interval follows them as they change. Pure reads,
through the public methods of the repositories that hold them (nodes, events, commands,
reports): the policies (stasis.controlplane.policies) decide what is due.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from stasis import interval
from stasis.controlplane import events as event_log
from stasis.controlplane.registry import Registry

WINDOW_S = 30 * 86400
COST_SAMPLES = 5
# What a stopping checkpoint's reason says when a scheduler took the job's node.
_INTERRUPTED = ("preempt", "requeue")


@dataclass(frozen=True)
class Bounds:
    floor_s: float
    ceiling_s: float


@dataclass(frozen=True)
class Rate:
    """A cluster's interruptions over the node-hours of its nodes in the window."""

    interruptions: int
    node_hours: float

    @property
    def per_node_hour(self) -> float:
        return self.interruptions / self.node_hours if self.node_hours > 0 else 0.0


def _ts(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        return datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return None


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds")


def rates(registry: Registry, now: float) -> dict[str, Rate]:
    """Each cluster's interruption rate (by cluster id) over the last WINDOW_S."""
    start = now - WINDOW_S
    count: dict[str, int] = {}
    hours: dict[str, float] = {}
    for cluster_id, registered, lost_since in registry.nodes.spans():
        begun = max(_ts(registered) or now, start)
        ended = float(lost_since) if lost_since else now
        hours[cluster_id] = hours.get(cluster_id, 0.0) + max(0.0, ended - begun) / 3600
    for lost_in in event_log.clusters_of(registry.db, "node-lost", _iso(start)):
        if lost_in:
            count[lost_in] = count.get(lost_in, 0) + 1
    for cluster_id, _, _, _ in registry.commands.created_since("drain", _iso(start)):
        count[cluster_id] = count.get(cluster_id, 0) + 1
    for cluster_id, reason in registry.reports.stopped_since(start):
        if any(word in reason.lower() for word in _INTERRUPTED):
            count[cluster_id] = count.get(cluster_id, 0) + 1
    return {c: Rate(count.get(c, 0), hours.get(c, 0.0)) for c in sorted(set(count) | set(hours))}


def costs(registry: Registry, now: float) -> dict[tuple[str, str, str], tuple[float, int]]:
    """(cluster id, user, label) -> (mean frozen seconds of its newest COST_SAMPLES
    checkpoints in the window, how many were averaged)."""
    seen: dict[tuple[str, str, str], list[float]] = {}
    for cluster_id, user, label, frozen_s in registry.reports.frozen_since(now - WINDOW_S):
        kept = seen.setdefault((cluster_id, user, label), [])
        if len(kept) < COST_SAMPLES:
            kept.append(float(frozen_s))
    return {k: (sum(v) / len(v), len(v)) for k, v in seen.items()}


def last_commands(
    registry: Registry, policy: str, since: float
) -> dict[tuple[str, str, str], float]:
    """(cluster id, node, job) -> when the newest checkpoint command of `policy` for it was
    queued (since `since`): a checkpoint queued counts from then, before its report comes."""
    out: dict[tuple[str, str, str], float] = {}
    for cluster_id, node, args, created in registry.commands.created_since(
        "checkpoint", _iso(since)
    ):
        at = _ts(created)
        if args.get("policy") == policy and at is not None:
            out[(cluster_id, node, str(args.get("job")))] = at
    return out


def for_job(
    job: Mapping[str, Any],
    cluster_rates: dict[str, Rate],
    job_costs: dict[tuple[str, str, str], tuple[float, int]],
    bounds: Bounds,
    policy: str,
) -> dict[str, Any]:
    """The interval of a job an `every auto` policy picked, and why (what the API's and the
    dashboard's job rows carry as `interval`)."""
    rate = cluster_rates.get(job["cluster_id"], Rate(0, 0.0))
    cost, samples = job_costs.get(
        (job["cluster_id"], str(job.get("user")), str(job.get("label"))), (0.0, 0)
    )
    per_hour = rate.per_node_hour
    choice = interval.choose(cost, interval.mtbi_s(per_hour), bounds.floor_s, bounds.ceiling_s)
    why = choice.why()
    if not samples:
        why = f"no checkpoint measured yet (cost taken as 0): {why}"
    return {
        "source": f"policy {policy} (every auto)",
        "policy": policy,
        "interval_s": choice.interval_s,
        "cost_s": cost,
        "cost_samples": samples,
        "mtbi_s": choice.mtbi_s,
        "raw_s": choice.raw_s,
        "bound": choice.bound,
        "rate_per_node_hour": per_hour,
        "interruptions": rate.interruptions,
        "node_hours": rate.node_hours,
        "floor_s": bounds.floor_s,
        "ceiling_s": bounds.ceiling_s,
        "why": f"policy {policy} (every auto): {why}; {rate.interruptions} interruption(s) "
        f"in {rate.node_hours:.3g} node-hours (30 days)",
    }
