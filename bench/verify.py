"""`python -m bench.verify`: what `stasis verify` costs per GiB of checkpoint, against a plain
`stasis restore` of the same checkpoint, in the same run, on the same daemon.

A job holds SIZE MiB of random memory (bench/workloads/memhold.py); one checkpoint of it
(`dump --leave-running`) is verified and restored RUNS times each, alternating which goes first;
each restored job is killed before the next step. Timed: the wall time of the `stasis` command a
user types (CLI start-up included). Verify fetches and checks the images as a restore does, then
restores them in a sandbox (stopped, no network) and removes the tree; a restore leaves the job
running. Results: bench/results/<stamp>-verify.{json,md} (not committed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.stasis_driver import StasisDaemon

RESULTS = Path(__file__).resolve().parent / "results"
MEMHOLD = Path(__file__).resolve().parent / "workloads" / "memhold.py"
GIB = 1 << 30


def _wait_ready(log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and "ready" in log.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the job did not fill its memory within {timeout_s:g} s (see {log})")


def _one_size(d: StasisDaemon, work: Path, mib: int, runs: int) -> dict[str, Any]:
    log = work / f"memhold-{mib}.log"
    # Its working directory outside /tmp: a sandbox's /tmp is empty, as a fresh node's is.
    job = d.timed_json(
        "run",
        "--json",
        "--cwd",
        "/",
        "--log",
        str(log),
        "--",
        "python3",
        str(MEMHOLD),
        "random",
        str(mib << 20),
    ).answer
    _wait_ready(log)
    cp = d.dump(job["job"], ("--leave-running",)).answer
    d.kill(job["job"])
    checkpoint, size = cp["checkpoint"], int(cp["size_bytes"])
    verify_s: list[float] = []
    restore_s: list[float] = []
    for i in range(runs):
        order = ("verify", "restore") if i % 2 == 0 else ("restore", "verify")
        for step in order:
            if step == "verify":
                timed = d.timed_json("verify", checkpoint, "--json")
                if not timed.answer["ok"]:
                    raise RuntimeError(f"verify failed: {timed.answer['reason']}")
                verify_s.append(timed.wall_s)
            else:
                timed = d.restore(checkpoint, ())
                restore_s.append(timed.wall_s)
                d.kill(timed.answer["job"])
    d.remove_checkpoint(checkpoint)
    verify_med, restore_med = statistics.median(verify_s), statistics.median(restore_s)
    return {
        "size_mib": mib,
        "image_bytes": size,
        "runs": runs,
        "verify_s": verify_s,
        "restore_s": restore_s,
        "verify_median_s": verify_med,
        "restore_median_s": restore_med,
        "verify_s_per_gib": verify_med / (size / GIB),
        "restore_s_per_gib": restore_med / (size / GIB),
        "ratio": verify_med / restore_med,
    }


def run(sizes: list[int], runs: int, out: Path) -> Path:
    work = Path(tempfile.mkdtemp(prefix="stasis-bench-verify-"))
    d = StasisDaemon(work / "daemon", work / "store")
    d.start()
    rows = []
    try:
        for mib in sizes:
            rows.append(_one_size(d, work, mib, runs))
            r = rows[-1]
            print(
                f"{mib} MiB: verify {r['verify_median_s']:.3f} s, restore "
                f"{r['restore_median_s']:.3f} s (x{r['ratio']:.2f})",
                file=sys.stderr,
            )
    finally:
        d.stop()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stamp}-verify.json").write_text(json.dumps({"rows": rows}, indent=2))
    md = out / f"{stamp}-verify.md"
    md.write_text(_report(rows))
    return md


def _report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# stasis verify against stasis restore of the same checkpoint "
        "(wall time of the command, median of runs)",
        "",
        "| memory | images | runs | verify s | restore s | verify s/GiB | restore s/GiB "
        "| verify / restore |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size_mib']} MiB | {r['image_bytes'] / GIB:.2f} GiB | {r['runs']} | "
            f"{r['verify_median_s']:.3f} | {r['restore_median_s']:.3f} | "
            f"{r['verify_s_per_gib']:.2f} | {r['restore_s_per_gib']:.2f} | "
            f"{r['ratio']:.2f} |"
        )
    if len(rows) >= 2:
        # What one more GiB costs, beyond the fixed part (CLI, CRIU start, the sandbox's set-up).
        small, large = rows[0], rows[-1]
        gib = (large["image_bytes"] - small["image_bytes"]) / GIB
        if gib > 0:
            per_v = (large["verify_median_s"] - small["verify_median_s"]) / gib
            per_r = (large["restore_median_s"] - small["restore_median_s"]) / gib
            lines += [
                "",
                f"Marginal cost between {small['size_mib']} and {large['size_mib']} "
                f"MiB: verify {per_v:.2f} s/GiB, restore {per_r:.2f} s/GiB"
                f"{f' (x{per_v / per_r:.2f})' if per_r > 0 else ''}.",
            ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.verify", description=__doc__)
    p.add_argument("--sizes", default="256,1024", help="MiB of job memory, comma-separated")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    md = run([int(s) for s in args.sizes.split(",")], args.runs, args.out)
    print(md.read_text())
    print(f"results: {md} and {md.with_suffix('.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
