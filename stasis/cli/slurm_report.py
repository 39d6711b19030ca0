"""`stasis slurm report`: what wall-time limits, over-requests and preemptions cost, from
Slurm's accounting (sacct)."""

from __future__ import annotations

from typing import Any


def add_report(sub: Any) -> None:
    """`stasis slurm report ...` under `stasis slurm`."""
