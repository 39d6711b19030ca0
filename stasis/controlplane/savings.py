"""Node-hours kept against node-hours spent, per cluster (GET /api/v1/savings, the dashboard's
savings page): what restores kept (stasis.controlplane.registry.reports.savings: the work their
checkpoints held) and what checkpointing cost (each checkpoint's frozen time x its job's nodes;
every job counts as one node, as the nodes report single-node jobs), with the interruption
rate each cluster's `every auto` policies use (stasis.controlplane.intervals)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from stasis.controlplane import intervals, wire
from stasis.controlplane.access import Principal
from stasis.controlplane.registry import Registry


def savings_of(registry: Registry, by: Principal) -> wire.Savings:
    """Reports.savings (kept: in all, per cluster, user and day), and: `spent_node_hours`,
    `net_node_hours`, `spent_days` (per day, UTC), `per_cluster` (kept, spent, net and the
    interruption rate of each cluster `by` may see)."""
    saved = registry.reports.savings(by)
    names = {
        cid: name
        for cid, name in registry.access.cluster_names().items()
        if by.kind == "admin" or cid == by.cluster_id
    }
    spent: dict[str, float] = {}
    per_day: dict[str, float] = {}
    for cid, frozen_s, created in registry.reports.frozen(by):
        if cid not in names:
            continue
        hours = float(frozen_s) / 3600  # x 1 node
        spent[names[cid]] = spent.get(names[cid], 0.0) + hours
        day = datetime.fromtimestamp(created, UTC).date().isoformat()
        per_day[day] = per_day.get(day, 0.0) + hours
    kept = {c["cluster"]: float(c["node_hours"]) for c in saved["clusters"]}
    rates = intervals.rates(registry, time.time())
    per_cluster: list[wire.ClusterSavings] = []
    for cid, name in sorted(names.items(), key=lambda kv: kv[1]):
        rate = rates.get(cid, intervals.Rate(0, 0.0))
        k, s = kept.get(name, 0.0), spent.get(name, 0.0)
        per_cluster.append(
            {
                "cluster": name,
                "kept_node_hours": round(k, 4),
                "spent_node_hours": round(s, 6),
                "net_node_hours": round(k - s, 4),
                "interruptions": rate.interruptions,
                "node_hours_seen": rate.node_hours,
                "rate_per_node_hour": rate.per_node_hour,
            }
        )
    total_spent = sum(spent.values())
    return {
        **saved,
        "spent_node_hours": round(total_spent, 6),
        "net_node_hours": round(float(saved["node_hours"]) - total_spent, 4),
        "spent_days": [{"day": k, "node_hours": round(v, 6)} for k, v in sorted(per_day.items())],
        "per_cluster": per_cluster,
    }
