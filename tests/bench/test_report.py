"""bench.report: medians, ratios and the issue's targets from raw runs (no CRIU needed)."""

from __future__ import annotations

from typing import Any

from bench.report import markdown, summarise, targets

GiB = 1 << 30


def _run(
    mode: str,
    dest: str,
    stasis_dump: float,
    criu_dump: float,
    frozen: float = 0.5,
    image: int = GiB,
    kind: str = "random",
    size: int = GiB,
    api_dump: float | None = None,
) -> dict[str, Any]:
    method = {
        "dump_s": stasis_dump,
        "frozen_s": frozen,
        "restore_s": 1.0,
        "memory_s": 1.0,
        "image_bytes": image,
        "verified": True,
    }
    stasis = {**method, "api_dump_s": stasis_dump if api_dump is None else api_dump}
    return {
        "case": {"size_bytes": size, "kind": kind, "dest": dest, "mode": mode},
        "run": 0,
        "raw": {"write_s": 0.5, "read_s": 0.5},
        "stasis": stasis,
        "criu": {**method, "dump_s": criu_dump},
    }


def test_medians_and_ratios() -> None:
    runs = [_run("default", "disk", d, 1.0) for d in (1.0, 3.0, 2.0)]
    runs.append({**_run("default", "disk", 9.0, 1.0), "error": "BenchError: boom"})
    [s] = summarise(runs)
    assert s["figures"]["stasis.dump_s"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert s["ratios"]["dump_s stasis/criu"] == 2.0
    assert s["ratios"]["dump_s stasis/raw"] == 4.0
    assert s["errors"] == ["BenchError: boom"] and s["runs_ok"] == 3 and s["verified"] is True


def test_targets() -> None:
    runs = [
        _run("default", "disk", 1.04, 1.0),  # within 5%
        _run("default", "tmpfs", 0.30, 0.20, api_dump=0.23),  # 100 ms over; API 30 ms: met
        _run("leave-running", "disk", 1.0, 1.0, frozen=0.6),
        _run("leave-running", "tmpfs", 1.0, 1.0, frozen=0.5),
        _run("default", "disk", 1.0, 1.0, kind="zero", image=GiB),
        _run("auto", "disk", 1.0, 1.0, kind="zero", image=GiB // 10),
    ]
    found = targets(summarise(runs))
    by = {
        (
            t["target"],
            t.get("case", {}).get("dest"),
            t.get("case", {}).get("kind"),
            t.get("case", {}).get("mode"),
        ): t["met"]
        for t in found
    }
    within = "dump_s ({}) within 5% or 50 ms of criu CLI"
    assert by[(within.format("command"), "disk", "random", "default")] is True
    assert by[(within.format("command"), "tmpfs", "random", "default")] is False
    assert by[(within.format("API"), "tmpfs", "random", "default")] is True
    assert by[("leave-running 1 GiB frozen time disk <= 1.2x tmpfs", None, "random", None)] is True
    assert (
        by[("compression auto: mostly-zero 1 GiB image >= 5x smaller", "disk", "zero", "auto")]
        is True
    )
    assert by[("lazy restore of 4 GiB runs again in < 0.3 s", None, None, None)] is None
    assert by[("encryption: 1 GiB dump and restore <= 1.10x unencrypted", None, None, None)] is None


def test_encryption_target() -> None:
    runs = [
        _run("default", "disk", 2.0, 2.0),
        _run("encrypt", "disk", 2.1, 2.0),
        _run("default", "tmpfs", 1.0, 1.0),
        _run("encrypt", "tmpfs", 1.2, 1.0),
    ]
    found = {
        (t["target"], t["case"]["dest"]): t
        for t in targets(summarise(runs))
        if t["target"].startswith("encryption")
    }
    assert found[("encryption: 1 GiB dump_s <= 1.10x unencrypted", "disk")]["met"] is True
    assert found[("encryption: 1 GiB dump_s <= 1.10x unencrypted", "tmpfs")]["met"] is False
    assert found[("encryption: 1 GiB restore_s <= 1.10x unencrypted", "disk")]["ratio"] == 1.0


def test_markdown_has_a_row_per_case() -> None:
    summary = summarise([_run("default", "disk", 1.0, 1.0)])
    doc = {
        "started": "now",
        "host": {
            "kernel": "k",
            "cpus": 2,
            "mem_total_bytes": GiB,
            "criu": "criu 4.2.1",
            "stasis_commit": "abc",
        },
        "args": {"runs": 1},
        "summary": summary,
        "targets": targets(summary),
        "skipped": [],
    }
    text = markdown(doc)
    assert "| 1 GiB | random | disk | default |" in text
    assert "## Targets (issue 4)" in text
