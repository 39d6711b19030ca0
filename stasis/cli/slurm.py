"""`stasis slurm ...`: the Slurm integration's commands (install, uninstall, local-cluster)."""

from __future__ import annotations

import click


@click.group()
def slurm() -> None:
    """Slurm integration: plugin installer and a throwaway local cluster."""
