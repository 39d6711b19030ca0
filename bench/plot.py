"""PNG: time against size for each method, one panel per (figure, destination).

matplotlib is optional (the `bench` extra); without it the PNG is skipped with a hint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GiB = 1 << 30
PANELS = (("dump", (("stasis.dump_s", "stasis dump"), ("stasis.frozen_s", "stasis frozen"),
                    ("criu.dump_s", "criu CLI dump"), ("criu.frozen_s", "criu CLI frozen"),
                    ("raw.write_s", "raw write"))),
          ("restore", (("stasis.restore_s", "stasis restore"),
                       ("stasis.memory_s", "stasis memory back"),
                       ("criu.restore_s", "criu CLI restore"), ("raw.read_s", "raw read"))))


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
    # One kind keeps the panels readable; random memory is the hardest case for every method.
    kind = "random" if "random" in kinds else sorted(kinds)[0]
    summaries = [s for s in summaries if s["case"]["kind"] == kind]
    dests = sorted({s["case"]["dest"] for s in summaries})
    fig, axes = plt.subplots(len(PANELS), len(dests), figsize=(6.5 * len(dests), 9),
                             squeeze=False)
    for row, (title, series) in enumerate(PANELS):
        for col, dest in enumerate(dests):
            ax = axes[row][col]
            for mode in sorted({s["case"]["mode"] for s in summaries if s["case"]["dest"] == dest}):
                points = sorted(((s["case"]["size_bytes"], s) for s in summaries
                                 if s["case"]["dest"] == dest and s["case"]["mode"] == mode),
                                key=lambda p: p[0])
                for name, label in series:
                    figs = [(size / GiB, s["figures"][name]) for size, s in points
                            if name in s["figures"]]
                    if not figs:
                        continue
                    xs = [x for x, _ in figs]
                    med = [f["median"] for _, f in figs]
                    err = [[f["median"] - f["min"] for _, f in figs],
                           [f["max"] - f["median"] for _, f in figs]]
                    ax.errorbar(xs, med, yerr=err, marker="o", capsize=3,
                                label=f"{label} [{mode}]")
            ax.set_title(f"{title} to {dest} ({kind} memory)")
            ax.set_xlabel("workload size (GiB)")
            ax.set_ylabel("seconds")
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[1]:
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
