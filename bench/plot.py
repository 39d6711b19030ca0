"""PNG: time against size for each method, one panel per (dump|restore, destination).

The default mode's three methods, plus the fast paths where measured (leave-running frozen time,
lazy restore). One kind (random, the hardest for every method) keeps the panels readable.
matplotlib is optional (the `bench` extra); without it the PNG is skipped with a hint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GiB = 1 << 30
# (figure, mode, label, style)
PANELS = (
    (
        "dump",
        (
            ("raw.write_s", "default", "raw write", "k:"),
            ("criu.dump_s", "default", "criu CLI dump", "C0-"),
            ("criu.frozen_s", "default", "criu CLI frozen", "C0--"),
            ("stasis.dump_s", "default", "stasis dump", "C1-"),
            ("stasis.frozen_s", "default", "stasis frozen", "C1--"),
            ("stasis.dump_s", "leave-running", "stasis dump, leave-running", "C2-"),
            ("stasis.frozen_s", "leave-running", "stasis frozen, leave-running", "C2--"),
            ("stasis.dump_s", "auto", "stasis dump, compress auto", "C4-"),
        ),
    ),
    (
        "restore",
        (
            ("raw.read_s", "default", "raw read", "k:"),
            ("criu.restore_s", "default", "criu CLI restore", "C0-"),
            ("stasis.restore_s", "default", "stasis restore", "C1-"),
            ("stasis.restore_s", "lazy", "stasis lazy: runs again", "C3-"),
            ("stasis.memory_s", "lazy", "stasis lazy: memory back", "C3--"),
            ("stasis.restore_s", "auto", "stasis restore, compress auto", "C4-"),
        ),
    ),
)


def plot(summaries: list[dict[str, Any]], path: Path) -> str | None:
    """Write the PNG; return why not when it cannot be drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: .venv/bin/pip install matplotlib==3.9.2"
    kinds = {s["case"]["kind"] for s in summaries}
    if not kinds:
        return "nothing measured"
    kind = "random" if "random" in kinds else sorted(kinds)[0]
    summaries = [s for s in summaries if s["case"]["kind"] == kind]
    dests = sorted({s["case"]["dest"] for s in summaries})
    fig, axes = plt.subplots(len(PANELS), len(dests), figsize=(6.5 * len(dests), 9), squeeze=False)
    for row, (title, series) in enumerate(PANELS):
        for col, dest in enumerate(dests):
            ax = axes[row][col]
            for name, mode, label, style in series:
                points = sorted(
                    (
                        (s["case"]["size_bytes"], s["figures"][name])
                        for s in summaries
                        if s["case"]["dest"] == dest
                        and s["case"]["mode"] == mode
                        and name in s["figures"]
                    ),
                    key=lambda p: p[0],
                )
                if not points:
                    continue
                xs = [size / GiB for size, _ in points]
                med = [f["median"] for _, f in points]
                err = [
                    [f["median"] - f["min"] for _, f in points],
                    [f["max"] - f["median"] for _, f in points],
                ]
                ax.errorbar(xs, med, yerr=err, fmt=style, marker="o", capsize=3, label=label)
            ax.set_title(f"{title} to {dest} ({kind} memory; median, min-max)")
            ax.set_xlabel("workload size (GiB)")
            ax.set_ylabel("seconds")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[1]:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
