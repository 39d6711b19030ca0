"""Alembic migrations of the control plane's database (run at `controlplane serve` start)."""
