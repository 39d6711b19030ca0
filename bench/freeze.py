"""`python -m bench.freeze`: how long a leave-running dump keeps the job frozen, quiet and while
another process writes to the same disk, against `criu dump --leave-running` to a tmpfs.

A job holds SIZE MiB of random memory (bench/workloads/memhold.py). stasis runs with its default
settings and its default store (<state_dir>/checkpoints, on /); plain CRIU dumps a namespaced copy
of the same workload (unshare + setsid + tini) to a tmpfs mounted for the run. Each load runs RUNS
times each, alternating which goes first. Loads:

    quiet   nothing else runs (`sync` before each dump)
    writer  `dd if=/dev/zero of=<beside the store> bs=1M count=WRITER_MIB conv=notrunc`, started
            WRITER_LEAD_S before the dump and killed after it: the node's dirty pages at the
            kernel's limit, the disk behind, as when other jobs write checkpoints and results

The frozen time is CRIU's own `frozen_time` (its stats-dump image: from the freeze to the resume,
CRIU's post-dump hook included) for both; the wall time of the command is kept beside it. Target
(issue 30): stasis' median within 1.2x of criu's under the writer. Results:
bench/results/<stamp>-freeze.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import criu_cli, procs
from bench.dest import available_bytes, clear_dir
from bench.procs import BenchError, LogTail
from bench.stasis_driver import StasisDaemon
from bench.stats import read_dump_stats
from bench.workloads import MEMHOLD

RESULTS = Path(__file__).resolve().parent / "results"
LOADS = ("quiet", "writer")
TARGET = 1.2


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Dirty", "Writeback", "MemAvailable"):
            out[key] = int(rest.split()[0]) << 10
    return out


class Writer:
    """The concurrent disk writer: dd into a file on the store's filesystem."""

    def __init__(self, path: Path, mib: int) -> None:
        self.path, self.mib = path, mib
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, lead_s: float) -> None:
        # A fresh file each time: rewriting pages still dirty in the cache would not wait.
        self.path.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [
                "dd",
                "if=/dev/zero",
                f"of={self.path}",
                "bs=1M",
                f"count={self.mib}",
                "conv=notrunc",
                "status=none",
            ],
            stdin=subprocess.DEVNULL,
        )
        time.sleep(lead_s)
        if self.proc.poll() is not None:
            raise BenchError(f"the disk writer ended within {lead_s:g} s: raise --writer-mib")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None
        # Its dirty pages go with it (not written back into the next measurement).
        self.path.unlink(missing_ok=True)


def _ready(log: Path, mib: int) -> None:
    LogTail(log).wait_line("ready ", 60 + 32 * mib / 1024)


def _stasis_once(
    d: StasisDaemon, work: Path, mib: int, load: Writer | None, lead_s: float
) -> dict[str, Any]:
    log = work / "stasis-workload.log"
    log.unlink(missing_ok=True)
    job = d.run([sys.executable, "-u", str(MEMHOLD), "random", str(mib << 20)], log)["job"]
    checkpoint = None
    try:
        _ready(log, mib)
        stats = d.criu_work / "stats-dump"
        stats.unlink(missing_ok=True)
        os.sync()
        if load:
            load.start(lead_s)
        before = _meminfo()
        try:
            timed = d.dump(job, ("--leave-running",))
        finally:
            if load:
                load.stop()
        checkpoint = timed.answer["checkpoint"]
        st = read_dump_stats(stats)
        return {
            "frozen_s": st.frozen_s,
            "freezing_s": st.freezing_s,
            "memdump_s": st.memdump_s,
            "memwrite_s": st.memwrite_s,
            "wall_s": timed.wall_s,
            "criu_s": timed.answer.get("duration_s"),
            "staged": timed.answer.get("staged"),
            "notes": timed.answer.get("notes", []),
            "meminfo_before": before,
        }
    finally:
        d.kill(job)
        if checkpoint:
            d.remove_checkpoint(checkpoint)
        if d.criu_work.exists():
            clear_dir(d.criu_work)


def _criu_once(
    tmpfs: Path, work: Path, mib: int, load: Writer | None, lead_s: float
) -> dict[str, Any]:
    images, cwork = tmpfs / "images", work / "criu-work"
    for p in (images, cwork):
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir()
    log = work / "criu-workload.log"
    log.unlink(missing_ok=True)
    ns = procs.start_namespaced(
        [sys.executable, "-u", str(MEMHOLD), "random", str(mib << 20)], log, work
    )
    try:
        _ready(log, mib)
        os.sync()
        if load:
            load.start(lead_s)
        before = _meminfo()
        try:
            d = criu_cli.dump(ns.init_pid, images, cwork, leave_running=True)
        finally:
            if load:
                load.stop()
        st = read_dump_stats(cwork / "stats-dump")
        return {
            "frozen_s": st.frozen_s,
            "freezing_s": st.freezing_s,
            "memdump_s": st.memdump_s,
            "memwrite_s": st.memwrite_s,
            "wall_s": d.wall_s,
            "meminfo_before": before,
        }
    finally:
        procs.kill_tree(ns.init_pid)
        if ns.unshare.poll() is None:
            ns.unshare.kill()
        ns.unshare.wait()
        shutil.rmtree(images, ignore_errors=True)


def run(
    mib: int,
    runs: int,
    loads: list[str],
    writer_mib: int,
    lead_s: float,
    out: Path,
    compare: bool = False,
) -> Path:
    need = 3 * (mib << 20) + (2 << 30)
    if available_bytes() < need:
        raise BenchError(f"{mib} MiB needs about {need >> 20} MiB of memory available")
    procs.become_subreaper()
    # On / beside the daemon's default store: the writer shares its disk.
    work = Path(tempfile.mkdtemp(prefix="stasis-bench-freeze-", dir="/var/tmp"))
    tmpfs = work / "tmpfs"
    tmpfs.mkdir()
    subprocess.run(
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size={mib * 3 + 64}m,mode=0700",
            "stasis-bench-freeze",
            str(tmpfs),
        ],
        check=True,
    )
    # Default settings: nothing of the caller's STASIS_* but what the driver sets itself.
    env = {k: v for k, v in os.environ.items() if k.startswith("STASIS_")}
    for k in env:
        os.environ.pop(k)
    daemons = {"stasis": StasisDaemon(work / "daemon", None)}
    if compare:
        # The two fixed choices the default picks between: never staged (the store's page
        # cache), always staged (a tmpfs of its own).
        daemons["stasis-disk"] = StasisDaemon(
            work / "daemon-disk", None, env={"STASIS_STAGE_DIR": ""}
        )
        daemons["stasis-memory"] = StasisDaemon(
            work / "daemon-memory", None, env={"STASIS_STAGE_DIR": str(tmpfs / "stage")}
        )
    methods = [*daemons, "criu"]
    writer = Writer(work / "disk-writer.bin", writer_mib)
    rows: list[dict[str, Any]] = []
    try:
        for d in daemons.values():
            d.start()
        for load in loads:
            w = writer if load == "writer" else None
            for i in range(runs):
                # Each method first in turn: none always meets the machine warmer or colder.
                order = methods[i % len(methods) :] + methods[: i % len(methods)]
                for method in order:
                    r = (
                        _criu_once(tmpfs, work, mib, w, lead_s)
                        if method == "criu"
                        else _stasis_once(daemons[method], work, mib, w, lead_s)
                    )
                    rows.append({"load": load, "run": i, "method": method, **r})
                    print(
                        f"{load} run {i} {method}: frozen {r['frozen_s']:.3f} s (memdump "
                        f"{r['memdump_s']:.3f}, memwrite {r['memwrite_s']:.3f})"
                        + (f" (staged {r['staged']})" if "staged" in r else ""),
                        file=sys.stderr,
                    )
                    procs.reap_orphans()
    finally:
        writer.stop()
        for d in daemons.values():
            d.stop()
        subprocess.run(["umount", str(tmpfs)], check=False)
        shutil.rmtree(work, ignore_errors=True)
        os.environ.update(env)
    summary = _summary(rows, loads, [m for m in methods if m != "criu"])
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "size_mib": mib,
        "runs": runs,
        "writer_mib": writer_mib,
        "writer_lead_s": lead_s,
        "dirty": {
            k: Path(f"/proc/sys/vm/{k}").read_text().strip()
            for k in (
                "dirty_ratio",
                "dirty_background_ratio",
                "dirty_bytes",
                "dirty_background_bytes",
            )
        },
        "target": TARGET,
    }
    (out / f"{stamp}-freeze.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=2)
    )
    md = out / f"{stamp}-freeze.md"
    md.write_text(_report(meta, summary))
    return md


def _summary(
    rows: list[dict[str, Any]], loads: list[str], methods: list[str]
) -> list[dict[str, Any]]:
    out = []
    for load in loads:
        c = [r["frozen_s"] for r in rows if r["load"] == load and r["method"] == "criu"]
        for method in methods:
            mine = [r for r in rows if r["load"] == load and r["method"] == method]
            s = [r["frozen_s"] for r in mine]
            ratio = statistics.median(s) / statistics.median(c)
            out.append(
                {
                    "load": load,
                    "method": method,
                    "stasis_s": s,
                    "criu_s": c,
                    "staged": [r["staged"] for r in mine],
                    "stasis_median_s": statistics.median(s),
                    "criu_median_s": statistics.median(c),
                    "ratio": ratio,
                    # The target is the default's; the others are there to compare.
                    "met": ratio <= TARGET if load == "writer" and method == "stasis" else None,
                }
            )
    return out


def _report(meta: dict[str, Any], summary: list[dict[str, Any]]) -> str:
    lines = [
        f"# Frozen time of a leave-running dump of {meta['size_mib']} MiB of random memory: "
        "stasis (default settings, disk store) against `criu dump --leave-running` to tmpfs",
        "",
        f"Medians of {meta['runs']} runs each, alternating; CRIU's own frozen_time. "
        f"writer: dd of {meta['writer_mib']} MiB to the store's filesystem, started "
        f"{meta['writer_lead_s']:g} s before the dump. Target: stasis within "
        f"{meta['target']:g}x of criu under the writer.",
        "",
        "| load | stasis | stasis s (min-max) | criu s (min-max) | stasis / criu "
        "| staged in memory | target |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for r in summary:
        s, c = r["stasis_s"], r["criu_s"]
        met = "" if r["met"] is None else ("met" if r["met"] else "NOT met")
        settings = {
            "stasis": "default",
            "stasis-disk": "stage_dir = \"\" (never staged)",
            "stasis-memory": "stage_dir = a tmpfs (always staged)",
        }[r["method"]]
        lines.append(
            f"| {r['load']} | {settings} | {r['stasis_median_s']:.3f} "
            f"({min(s):.3f}-{max(s):.3f}) | "
            f"{r['criu_median_s']:.3f} ({min(c):.3f}-{max(c):.3f}) | "
            f"{r['ratio']:.2f} | {sum(bool(x) for x in r['staged'])}/{len(s)} | "
            f"{met} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.freeze",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--loads", default=",".join(LOADS))
    p.add_argument(
        "--writer-mib",
        type=int,
        default=6144,
        help="MiB the disk writer writes (it is killed once the dump is done)",
    )
    p.add_argument("--writer-lead-s", type=float, default=2.0)
    p.add_argument(
        "--compare-staging",
        action="store_true",
        help="also measure daemons that never and that always stage in memory",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    md = run(
        args.size_mib,
        args.runs,
        args.loads.split(","),
        args.writer_mib,
        args.writer_lead_s,
        args.out,
        args.compare_staging,
    )
    print(md.read_text())
    print(f"results: {md} and {md.with_suffix('.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
