"""The control plane's Prometheus metrics (text exposition format 0.0.4), from its database:
nodes by state, live jobs, commands by kind and state, checkpoints taken through it and their
bytes; the checkpoints and restores the nodes report (counts, bytes, seconds, frozen seconds)
the verdicts of `stasis verify` on them, and the node-hours of work restores kept (savings)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from stasis.controlplane.access import Principal
from stasis.controlplane.registry import Registry


def _labels(**values: str) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in values.items()) + "}"


def render(registry: Registry, by: Principal, lost_after_s: float) -> str:
    by.admin_only()
    nodes = registry.nodes.list_nodes(by, lost_after_s)
    jobs = registry.nodes.list_jobs(by)
    commands = registry.commands.list_commands(by)
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: dict[str, Any]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{name}{labels} {value}" for labels, value in sorted(samples.items()))

    metric(
        "stasis_nodes",
        "gauge",
        "Nodes by cluster and state.",
        {
            _labels(cluster=c, state=s): n
            for (c, s), n in Counter((n["cluster"], n["state"]) for n in nodes).items()
        },
    )
    metric(
        "stasis_jobs",
        "gauge",
        "Live jobs the nodes report, by cluster and node.",
        {
            _labels(cluster=c, node=n): k
            for (c, n), k in Counter((j["cluster"], j["node"]) for j in jobs).items()
        },
    )
    metric(
        "stasis_commands",
        "gauge",
        "Commands sent to nodes, by kind and state.",
        {
            _labels(kind=k, state=s): n
            for (k, s), n in Counter((c["kind"], c["state"]) for c in commands).items()
        },
    )
    done = [c for c in commands if c["kind"] == "checkpoint" and c["state"] == "done"]
    metric(
        "stasis_checkpoints_total",
        "counter",
        "Checkpoints taken through the control plane.",
        {"": len(done)},
    )
    metric(
        "stasis_checkpoint_bytes_total",
        "counter",
        "Their bytes.",
        {"": sum(int((c["result"] or {}).get("size_bytes") or 0) for c in done)},
    )
    metric(
        "stasis_command_failures_total",
        "counter",
        "Commands that failed on their node.",
        {"": sum(1 for c in commands if c["state"] == "failed")},
    )
    totals = registry.reports.checkpoint_totals()
    metric(
        "stasis_reported_checkpoints_total",
        "counter",
        "Checkpoints the nodes reported, by cluster.",
        {_labels(cluster=t["cluster"]): int(t["count"]) for t in totals},
    )
    metric(
        "stasis_reported_checkpoint_bytes_total",
        "counter",
        "Their image bytes.",
        {_labels(cluster=t["cluster"]): int(t["bytes"]) for t in totals},
    )
    metric(
        "stasis_checkpoint_seconds_total",
        "counter",
        "CRIU's seconds for them.",
        {_labels(cluster=t["cluster"]): round(float(t["seconds"]), 4) for t in totals},
    )
    metric(
        "stasis_checkpoint_frozen_seconds_total",
        "counter",
        "Seconds their jobs stood frozen for them.",
        {_labels(cluster=t["cluster"]): round(float(t["frozen"]), 4) for t in totals},
    )
    metric(
        "stasis_checkpoints_verified",
        "gauge",
        "Live checkpoints the nodes reported, by cluster and verdict of `stasis verify` "
        "(ok, failed, none: not verified).",
        {
            _labels(cluster=t["cluster"], verdict=t["verdict"]): int(t["count"])
            for t in registry.reports.verdict_totals()
        },
    )
    saved = registry.reports.savings(by)
    metric(
        "stasis_restores_total", "counter", "Restores the nodes reported.", {"": saved["restores"]}
    )
    metric(
        "stasis_saved_node_hours_total",
        "counter",
        "Node-hours of work kept by restores instead of reruns, by cluster.",
        {_labels(cluster=c["cluster"]): c["node_hours"] for c in saved["clusters"]},
    )
    return "\n".join(out) + "\n"
