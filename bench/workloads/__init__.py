"""Workload programs the suite runs as jobs. They are scripts, not modules: they run under the
job's python with only the standard library (and numpy when it is there)."""

from __future__ import annotations

from pathlib import Path

MEMHOLD = Path(__file__).resolve().parent / "memhold.py"
KINDS = ("random", "float32", "zero")
