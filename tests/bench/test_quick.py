"""`python -m bench.run --quick` end to end, so the suite cannot rot (real CRIU, real daemon)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


@pytest.mark.skipif(os.geteuid() != 0, reason="CRIU and tmpfs mounts need root")
def test_quick_mode_writes_sane_results(tmp_path: Path) -> None:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    assert took < 60, f"--quick took {took:.0f} s"
    [result] = tmp_path.glob("*.json")
    assert result.with_suffix(".md").exists()
    doc = json.loads(result.read_text())
    [run] = doc["runs"]
    assert "error" not in run, run.get("error")
    size = run["case"]["size_bytes"]
    assert size == 256 * MiB
    for method in ("stasis", "criu"):
        fig = run[method]
        for name in ("dump_s", "frozen_s", "restore_s", "memory_s"):
            assert 0 < fig[name] < 60, (method, name, fig[name])
        assert fig["frozen_s"] <= fig["dump_s"]
        assert fig["bytes_written"] >= size
        assert fig["image_bytes"] >= size
        assert fig["verified"] is True
    assert run["raw"]["write_s"] > 0 and run["raw"]["read_s"] > 0
    [summary] = doc["summary"]
    assert summary["verified"] is True
    assert summary["ratios"]["dump_s stasis/criu"] > 0
    if doc.get("plot"):
        assert (tmp_path / doc["plot"]).stat().st_size > 0
    assert "| 256 MiB | random | tmpfs | default |" in result.with_suffix(".md").read_text()
