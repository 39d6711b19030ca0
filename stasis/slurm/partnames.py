"""How a part of a Slurm job on several nodes is named (stasis.slurm.parts): its daemon job's label
`slurm-<job>-part-<key>`, the key (8 hex digits) new at each start by the launch agent and kept
by every restore of it, on whichever node. Stdlib only: the agent (stasis.slurm.rsh) imports it."""

from __future__ import annotations

import re

PART_KEY_PATTERN = r"^[0-9a-f]{8}$"
RSH_NAME = "stasis-rsh"  # the launch agent, in the steps' directory beside our srun
_LABEL = re.compile(r"slurm-([0-9]+)-part-([0-9a-f]{8})")


def part_label(slurm_job: str, key: str) -> str:
    """The label of Slurm job `slurm_job`'s part `key` (what ties a daemon job to it)."""
    return f"slurm-{slurm_job}-part-{key}"


def part_of(label: str) -> tuple[str, str] | None:
    """(Slurm job, part key) of a part's label; None for any other label."""
    m = _LABEL.fullmatch(label)
    return (m.group(1), m.group(2)) if m else None


__all__ = ["PART_KEY_PATTERN", "RSH_NAME", "part_label", "part_of"]
