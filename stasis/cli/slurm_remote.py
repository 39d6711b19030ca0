"""`stasis slurm drain NODE`: Slurm commands that act on another node of the cluster through
that node's stasis daemon."""

from __future__ import annotations

from typing import Any


def add_remote(sub: Any) -> None:
    """`stasis slurm drain ...` under `stasis slurm`."""
