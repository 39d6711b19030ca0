"""`python -m bench.containers`: a container's stop-to-checkpointed and create-to-running-again
through the stasis runtime, against containerd's own checkpoint and restore (`ctr containers
checkpoint --task --rw`, `ctr containers restore --live --rw`: runc and the same CRIU) of the
same container, in the same run, on a private containerd (`stasis-dev local-node`).

The container holds MEMORY MiB of random data in a shell variable (busybox image built here).
stasis: SIGTERM as the kubelet sends it (answered once the checkpoint is published and the
container killed), then `ctr run` of the same spec (answered once the restored task runs).
Baseline: checkpoint, then SIGKILL (what a stop after it costs), then restore. Results:
bench/results/<stamp>-containers.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.e2e.containerd_node import IMAGE, Node

RESULTS = Path(__file__).resolve().parent / "results"
READY = "ready"


def _script(mib: int) -> str:
    # base64 of 3/4 of the size: the variable holds about MEMORY MiB.
    raw = mib * 1024 * 1024 * 3 // 4
    return (
        f"x=$(head -c {raw} /dev/urandom | base64); echo {READY}; i=0; "
        "while :; do i=$((i+1)); echo n=$i; sleep 0.2; done"
    )


def _wait_log(log: Path, text: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        time.sleep(0.02)
    raise RuntimeError(f"{log}: no {text!r} in {timeout_s} s")


def _timed(fn: Any) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def _stasis_run(node: Node, mib: int) -> dict[str, float]:
    label, cid = f"bench-{secrets.token_hex(3)}", f"b-{secrets.token_hex(3)}"
    log = node.run(cid, _script(mib), env={"STASIS_CHECKPOINT": label})
    _wait_log(log, READY)
    time.sleep(0.5)
    stop = _timed(lambda: node.ctr("tasks", "kill", "-s", "SIGTERM", cid, timeout_s=120))
    if node.status(cid) != "STOPPED":
        raise RuntimeError("the container did not stop at its checkpoint")
    node.remove(cid)
    start = time.monotonic()
    log2 = node.run(cid, _script(mib), env={"STASIS_CHECKPOINT": label})
    running = time.monotonic() - start
    _wait_log(log2, "restored from checkpoint", 5)
    node.remove(cid)
    return {"stop_s": stop, "start_s": running}


def _ctr_run(node: Node, mib: int) -> dict[str, float]:
    cid, ref = f"r-{secrets.token_hex(3)}", f"bench/checkpoint:{secrets.token_hex(3)}"
    log = node.run(cid, _script(mib), runtime="io.containerd.runc.v2")
    _wait_log(log, READY)
    time.sleep(0.5)

    def checkpoint_and_kill() -> None:
        r = node.ctr("containers", "checkpoint", "--task", "--rw", cid, ref, timeout_s=300)
        if r.returncode != 0:
            raise RuntimeError(f"ctr containers checkpoint: {r.stderr.strip()}")
        node.ctr("tasks", "kill", "-s", "SIGKILL", cid)

    stop = _timed(checkpoint_and_kill)
    node.remove(cid)

    def restore() -> None:
        r = node.ctr("containers", "restore", "--live", "--rw", cid, ref, timeout_s=300)
        if r.returncode != 0:
            raise RuntimeError(f"ctr containers restore: {r.stderr.strip()}")

    start = _timed(restore)
    node.remove(cid)
    node.ctr("images", "rm", ref)
    return {"stop_s": stop, "start_s": start}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.containers")
    p.add_argument("--memory-mib", type=int, nargs="+", default=[64, 256])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    node = Node(Path(tempfile.mkdtemp(prefix="stasis-bench-node-")))
    node.up()
    rows: list[dict[str, Any]] = []
    try:
        for mib in args.memory_mib:
            runs: dict[str, list[dict[str, float]]] = {"stasis": [], "ctr": []}
            for i in range(args.runs):
                runs["stasis"].append(_stasis_run(node, mib))
                runs["ctr"].append(_ctr_run(node, mib))
                print(
                    f"{mib} MiB run {i}: stasis {runs['stasis'][-1]} ctr {runs['ctr'][-1]}",
                    file=sys.stderr,
                )
            med = {
                who: {k: statistics.median(r[k] for r in rs) for k in ("stop_s", "start_s")}
                for who, rs in runs.items()
            }
            rows.append({"memory_mib": mib, "runs": runs, "median": med})
    finally:
        node.down()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stamp}-containers.json").write_text(json.dumps(rows, indent=2))
    lines = [
        f"# containers: stasis runtime against ctr checkpoint/restore ({stamp})",
        "",
        f"Image {IMAGE}; {args.runs} runs per size; medians in seconds.",
        "",
        "| memory | stasis stop-to-checkpointed | ctr checkpoint + kill | ratio "
        "| stasis create-to-running | ctr restore --live | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s, c = row["median"]["stasis"], row["median"]["ctr"]
        lines.append(
            f"| {row['memory_mib']} MiB | {s['stop_s']:.3f} | {c['stop_s']:.3f} | "
            f"{s['stop_s'] / c['stop_s']:.2f} | {s['start_s']:.3f} | "
            f"{c['start_s']:.3f} | {s['start_s'] / c['start_s']:.2f} |"
        )
    (args.out / f"{stamp}-containers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
