"""The control plane's Prometheus metrics (text exposition format 0.0.4), from its database:
nodes by state, live jobs, commands by kind and state, checkpoints taken through it and their
bytes."""

from __future__ import annotations

from collections import Counter
from typing import Any

from stasis.controlplane.registry import Principal, Registry


def _labels(**values: str) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in values.items()) + "}"


def render(registry: Registry, by: Principal, lost_after_s: float) -> str:
    by.admin_only()
    nodes = registry.list_nodes(by, lost_after_s)
    jobs = registry.list_jobs(by)
    commands = registry.list_commands(by)
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: dict[str, Any]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{name}{labels} {value}" for labels, value in sorted(samples.items()))

    metric("stasis_nodes", "gauge", "Nodes by cluster and state.",
           {_labels(cluster=c, state=s): n for (c, s), n in
            Counter((n["cluster"], n["state"]) for n in nodes).items()})
    metric("stasis_jobs", "gauge", "Live jobs the nodes report, by cluster and node.",
           {_labels(cluster=c, node=n): k for (c, n), k in
            Counter((j["cluster"], j["node"]) for j in jobs).items()})
    metric("stasis_commands", "gauge", "Commands sent to nodes, by kind and state.",
           {_labels(kind=k, state=s): n for (k, s), n in
            Counter((c["kind"], c["state"]) for c in commands).items()})
    done = [c for c in commands if c["kind"] == "checkpoint" and c["state"] == "done"]
    metric("stasis_checkpoints_total", "counter", "Checkpoints taken through the control plane.",
           {"": len(done)})
    metric("stasis_checkpoint_bytes_total", "counter", "Their bytes.",
           {"": sum(int((c["result"] or {}).get("size_bytes") or 0) for c in done)})
    metric("stasis_command_failures_total", "counter", "Commands that failed on their node.",
           {"": sum(1 for c in commands if c["state"] == "failed")})
    return "\n".join(out) + "\n"
