"""`python -m bench.freeze` end to end, small, so the `make bench` row of issue 30 cannot rot
(real CRIU, a real daemon with its default settings, a real disk writer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.geteuid() != 0, reason="CRIU and tmpfs mounts need root")
def test_freeze_bench_writes_both_loads(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.freeze",
            "--size-mib",
            "32",
            "--runs",
            "1",
            "--writer-lead-s",
            "0.5",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    [result] = tmp_path.glob("*-freeze.json")
    doc = json.loads(result.read_text())
    assert [s["load"] for s in doc["summary"]] == ["quiet", "writer"]
    for s in doc["summary"]:
        assert 0 < s["stasis_median_s"] < 30 and 0 < s["criu_median_s"] < 30
    writer = [r for r in doc["rows"] if r["load"] == "writer" and r["method"] == "stasis"]
    # The daemon saw the writer: the images went to its memory stage, not through the disk.
    assert [r["staged"] for r in writer] == [True], writer
    md = result.with_suffix(".md").read_text()
    assert "| writer | default |" in md and "| quiet | default |" in md
