"""A Slurm job on several nodes, listed as one job (`stasis controlplane jobs`, the dashboard's
Jobs page): its batch node reports the Slurm job (kind "slurm", its Slurm job id), and every node
it runs on reports its parts there, daemon jobs labelled `slurm-<job>-part-<key>`
(stasis.slurm.partnames). The rows of one cluster's Slurm job become one row, with its parts per
node. Each node's own rows stay as they are reported (commands, drains and policies read those:
stasis.controlplane.nodes.list_jobs); only what is shown is grouped."""

from __future__ import annotations

import re
from typing import cast

from stasis.controlplane import wire

# The labels of stasis.slurm.partnames (part_label): the layers keep the control plane from
# importing stasis.slurm, so the pattern is said again here (a test holds the two together).
PART_LABEL = re.compile(r"slurm-([0-9]+)-part-([0-9a-f]{8})")


def part_of(job: wire.Job) -> tuple[str, str] | None:
    """(Slurm job, part key) of a node's daemon job that is a part of a Slurm job; None for any
    other job."""
    if job.get("kind", "daemon") != "daemon":
        return None
    m = PART_LABEL.fullmatch(job.get("label") or "")
    return (m.group(1), m.group(2)) if m else None


def grouped(jobs: list[wire.Job]) -> list[wire.Job]:
    """`jobs` (as stasis.controlplane.nodes.list_jobs lists them, one row per node's job) with
    each Slurm job's parts folded into the row of the Slurm job, or, while no node reports the
    Slurm job itself (its batch node is not under stasis, or has not reported yet), into a row
    of their own with `batch_node` None. Other rows are kept as they are, in their order."""
    parts: dict[tuple[str, str], list[tuple[str, wire.Job]]] = {}
    rest: list[wire.Job] = []
    for j in jobs:
        of = part_of(j)
        if of is None:
            rest.append(j)
        else:
            parts.setdefault((j["cluster_id"], of[0]), []).append((of[1], j))
    out: list[wire.Job] = []
    for j in rest:
        found = parts.pop((j["cluster_id"], j["job"]), None) if j.get("kind") == "slurm" else None
        out.append(_whole(j, found) if found else j)
    out += [_headless(slurm_job, found) for (_, slurm_job), found in parts.items()]
    return out


def _parts(found: list[tuple[str, wire.Job]]) -> list[wire.JobPart]:
    return sorted(
        (
            wire.JobPart(
                node=j["node"],
                job=j["job"],
                key=key,
                label=j.get("label") or "",
                state=j["state"],
                rss_bytes=j.get("rss_bytes", 0),
            )
            for key, j in found
        ),
        key=lambda p: (p["node"], p["key"], p["job"]),
    )


def _whole(head: wire.Job, found: list[tuple[str, wire.Job]]) -> wire.Job:
    shown = _parts(found)
    row = cast(wire.Job, dict(head))
    row["parts"] = shown
    row["nodes"] = sorted({head["node"], *(p["node"] for p in shown)})
    row["batch_node"] = head["node"]
    # Its memory: the batch tree's and every part's (a part runs under its node's daemon,
    # outside the batch tree: nothing counted twice).
    row["rss_bytes"] = head.get("rss_bytes", 0) + sum(p["rss_bytes"] for p in shown)
    return row


def _headless(slurm_job: str, found: list[tuple[str, wire.Job]]) -> wire.Job:
    shown = _parts(found)
    first = next(j for _, j in found if j["node"] == shown[0]["node"])
    states = {p["state"] for p in shown}
    return wire.Job(
        job=slurm_job,
        label=None,
        user=first.get("user"),
        state="running" if "running" in states else shown[0]["state"],
        restored_from=None,
        started=min((j.get("started") or "" for _, j in found), default="") or None,
        kind="slurm",
        partition=None,
        rss_bytes=sum(p["rss_bytes"] for p in shown),
        node=shown[0]["node"],
        cluster=first["cluster"],
        cluster_id=first["cluster_id"],
        # A checkpoint of the whole job is the batch node's to report: none known here.
        last_checkpoint=None,
        last_checkpoint_age_s=None,
        last_checkpoint_verified=None,
        parts=shown,
        nodes=sorted({p["node"] for p in shown}),
        batch_node=None,
    )


__all__ = ["PART_LABEL", "grouped", "part_of"]
