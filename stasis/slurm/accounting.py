"""Slurm accounting for the local cluster: a private MariaDB and slurmdbd (`local-cluster up
--accounting`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stasis.slurm.cluster import Layout


def start(lay: "Layout", started: dict[str, int]) -> str:
    """Start MariaDB and slurmdbd under `lay.root` (their pids go into `started`, by name);
    returns the slurm.conf lines that make slurmctld use them."""
    raise NotImplementedError("local-cluster --accounting is not built yet")
