"""STASIS_FRESH as the Slurm task helper reads it (stasis.slurm.taskinit): the same values, with
the same meaning, as a container's (stasis.config.fresh_if_unreachable); an unknown value is one
warning line in the job's output, and ignored."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stasis.config import fresh_if_unreachable


def _said(fresh: str) -> list[str]:
    """The lines the helper has the job's output say about STASIS_FRESH."""
    # A job id Slurm cannot have: the helper says why it does not protect the job, and exits.
    r = subprocess.run(
        [
            sys.executable,
            "-I",
            "-m",
            "stasis.slurm.taskinit",
            "--job-id",
            "x/y",
            "--uid",
            "0",
            "--gid",
            "0",
            "--fresh",
            fresh,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"STASIS_CONFIG": "/dev/null", "PATH": "/usr/bin:/bin"},
    )
    messages: list[str] = json.loads(r.stdout)["messages"]
    return [m for m in messages if "STASIS_FRESH" in m]


@pytest.mark.parametrize("value", ["1", "if-unreachable", "0", ""])
def test_known_values_say_nothing(value: str) -> None:
    assert _said(value) == []


def test_an_unknown_value_is_one_warning_and_ignored() -> None:
    said = _said("always")  # the container runtime's former 'always fresh': no value now
    assert len(said) == 1 and said[0].startswith("stasis: warning: STASIS_FRESH='always'"), said
    assert "ignored" in said[0]
    assert fresh_if_unreachable("always")[0] is False
    assert fresh_if_unreachable("if-unreachable") == fresh_if_unreachable("1") == (True, None)
