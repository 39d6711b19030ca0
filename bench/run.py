"""`python -m bench.run`: run the suite, write bench/results/<timestamp>.{json,md,png}.

    python -m bench.run [--quick] [--sizes 256M,1G] [--kinds random,float32,zero]
                        [--dest tmpfs,disk] [--runs 3] [--modes default,leave-running] [--out DIR]
    python -m bench.run --slurm      end-to-end work lost per preemption (needs the local cluster)

Needs root (CRIU, tmpfs mounts). Cases run one at a time and clean up after themselves; a size
that does not fit in free memory is skipped and listed as such, never squeezed in.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import procs, report, slurm_e2e
from bench.case import Case, run_once
from bench.dest import (
    DESTS,
    Destination,
    GiB,
    available_bytes,
    bytes_needed,
    make_destination,
)
from bench.modes import DEFAULT_MODES, MODES, Mode, parse_modes
from bench.plot import plot
from bench.snapshot import snapshot
from bench.stasis_driver import STASIS, StasisDaemon
from bench.workloads import KINDS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def _list(text: str, known: tuple[str, ...], what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in known]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(bad)}; known: {', '.join(known)}"
        )
    return items


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="256 MiB, random, tmpfs, default mode, one run (the smoke test)",
    )
    p.add_argument("--sizes", default="256M,1G")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--dest", default="tmpfs,disk")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    p.add_argument(
        "--baseline-ref",
        metavar="REF",
        help="also measure this commit's stasis (its own daemon and store), case by "
        "case in the same run, and hold dump/restore/lazy against it (5%%)",
    )
    p.add_argument(
        "--stasis-ref",
        metavar="REF",
        help="measure this commit of stasis (a snapshot) instead of the working tree",
    )
    p.add_argument(
        "--slurm",
        action="store_true",
        help="only the end-to-end Slurm figure (work redone per preemption)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.kinds, args.dest, args.runs, args.modes = (
            "256M",
            "random",
            "tmpfs",
            1,
            "default",
        )
    try:
        args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        args.kind_list = _list(args.kinds, KINDS, "kind")
        args.dest_list = _list(args.dest, DESTS, "destination")
        args.mode_list = parse_modes(args.modes)
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(str(e))
    if args.runs < 1:
        p.error("--runs must be at least 1")
    return args


def host_info(commit: str) -> dict[str, Any]:
    criu = subprocess.run(["/usr/local/sbin/criu", "--version"], capture_output=True, text=True)
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "mem_total_bytes": total,
        "criu": "criu " + (criu.stdout.split()[1] if criu.stdout.split()[1:] else "?"),
        "stasis_commit": commit or "?",
        "python": sys.version.split()[0],
    }


def _help(stasis: str, subcommand: str, cwd: Path) -> str:
    return subprocess.run(
        [stasis, *subcommand.split(), "--help"], capture_output=True, text=True, cwd=cwd
    ).stdout


def unavailable(mode: Mode, stasis: str, cwd: Path) -> str | None:
    """Why stasis cannot run `mode` yet, or None."""
    for subcommand, token in mode.needs:
        if token not in _help(stasis, subcommand, cwd):
            return f"`stasis {subcommand}` has no {token!r} yet"
    return None


def warm_up(size: int) -> None:
    """Touch `size` bytes of fresh memory once, then free it.

    On a VM the first touch of guest memory since boot costs host page faults (seen: a raw read
    4x slower on its first run); paying that here keeps it out of the first measured run.
    """
    size = max(0, min(size, available_bytes() - 3 * GiB))
    if size:
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        block = b"\1" * (1 << 20)
        for off in range(0, size - len(block) + 1, len(block)):
            buf[off : off + len(block)] = block
        buf.close()


def _log(message: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _brief(run: dict[str, Any]) -> str:
    if "error" in run:
        return f"FAILED: {run['error']}"
    s, c, r = run["stasis"], run["criu"], run["raw"]
    return (
        f"dump stasis {s['dump_s']:.3f}s (frozen {s['frozen_s']:.3f}) criu {c['dump_s']:.3f}s "
        f"raw {r['write_s']:.3f}s | restore stasis {s['restore_s']:.3f}s "
        f"criu {c['restore_s']:.3f}s raw {r['read_s']:.3f}s"
    )


def _baseline_daemon(stasis: str, dest: Destination, work_root: Path) -> StasisDaemon | None:
    """A daemon of the baseline commit beside the measured one: same destination, a store of
    its own (neither lists, nor refuses, the other's checkpoints). None where the destination
    is reached by URL (remote, s3): measured against the working tree only."""
    if dest.url is not None:
        _log(f"no baseline on {dest.name}: only tmpfs and disk stores")
        return None
    store = dest.store.parent / "baseline-store" if dest.store is not None else None
    return StasisDaemon(work_root / f"baseline-{dest.name}", store, stasis, None, dest.env)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench: run as root (CRIU and tmpfs mounts need it)", file=sys.stderr)
        return 2
    started = datetime.now(timezone.utc)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    paths = {ext: args.out / f"{stamp}.{ext}" for ext in ("json", "md", "png")}
    work_root = Path(tempfile.mkdtemp(prefix="stasis-bench-", dir="/var/tmp"))
    os.chmod(work_root, 0o755)
    try:
        return _suite(args, started, paths, work_root)
    finally:
        shutil.rmtree(work_root, ignore_errors=True)


def _suite(
    args: argparse.Namespace, started: datetime, paths: dict[str, Path], work_root: Path
) -> int:
    if args.stasis_ref:
        stasis, commit = snapshot(args.stasis_ref, work_root / "snapshot")
    else:
        stasis = STASIS
        commit = (
            subprocess.run(
                ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            + " (working tree)"
        )
    base_stasis = None
    host = host_info(commit)
    if args.baseline_ref:
        base_stasis, host["baseline_commit"] = snapshot(args.baseline_ref, work_root / "baseline")
    document: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "host": host,
        "args": {
            "sizes": args.size_list,
            "kinds": args.kind_list,
            "dests": args.dest_list,
            "modes": [m.name for m in args.mode_list],
            "runs": args.runs,
            "quick": args.quick,
        },
        "modes": {
            m.name: {
                "dump_args": m.dump_args,
                "restore_args": m.restore_args,
                "lazy": m.lazy,
                "help": m.help,
            }
            for m in args.mode_list
        },
        "runs": [],
        "skipped": [],
        "summary": [],
        "targets": [],
    }
    if args.slurm:
        document["slurm"] = slurm_e2e.measure(stasis)
        _log(f"slurm: {json.dumps(document['slurm'])}")
        report.write_json(paths["json"], document)
        paths["md"].write_text(report.markdown(document))
        return 0 if document["slurm"]["available"] else 1

    procs.become_subreaper()
    modes = []
    for mode in args.mode_list:
        why = unavailable(mode, stasis, work_root)
        if why:
            document["skipped"].append({"case": {"mode": mode.name}, "why": why})
            _log(f"mode {mode.name} skipped: {why}")
        else:
            modes.append(mode)
    warm_up(3 * max(args.size_list))
    tmpfs_bytes = 2 * max(args.size_list) + GiB
    work = work_root / "work"
    work.mkdir()
    for dest_name in args.dest_list:
        dest = make_destination(dest_name, work_root, tmpfs_bytes)
        daemon = StasisDaemon(
            work_root / f"daemon-{dest_name}", dest.store, stasis, dest.url, dest.env
        )
        baseline = _baseline_daemon(base_stasis, dest, work_root) if base_stasis else None
        try:
            daemon.start()
            if baseline is not None:
                baseline.start()
            for size in args.size_list:
                for kind in args.kind_list:
                    need, free = bytes_needed(size, dest_name), available_bytes()
                    if free < need:
                        why = (
                            f"needs {need / GiB:.1f} GiB of free memory, "
                            f"{free / GiB:.1f} GiB available"
                        )
                        for mode in modes:
                            key = Case(size, kind, dest_name, mode).key()
                            document["skipped"].append({"case": key, "why": why})
                        _log(f"skip {size}/{kind}/{dest_name}: {why}")
                        continue
                    # Modes take turns run by run: this machine's speed drifts over minutes, and
                    # a mode compared with another (auto against default) must see the same drift.
                    for i in range(args.runs):
                        for mode in modes:
                            case = Case(size, kind, dest_name, mode)
                            run = run_once(
                                case, dest, daemon, work, i, verify=i == 0, baseline=baseline
                            )
                            document["runs"].append(run)
                            _log(f"{case.key()} run {i}: {_brief(run)}")
                        # Partial results survive an interrupted suite.
                        report.write_json(paths["json"], document)
        finally:
            daemon.stop()
            if baseline is not None:
                baseline.stop()
            dest.teardown()
    document["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    document["summary"] = report.summarise(document["runs"])
    document["targets"] = report.targets(document["summary"])
    why_no_plot = plot(document["summary"], paths["png"])
    document["plot"] = paths["png"].name if why_no_plot is None else None
    if why_no_plot:
        _log(f"no plot: {why_no_plot}")
    report.write_json(paths["json"], document)
    paths["md"].write_text(report.markdown(document))
    _log(f"results: {paths['json']} {paths['md']}" + ("" if why_no_plot else f" {paths['png']}"))
    failed = sum(1 for r in document["runs"] if "error" in r)
    return 1 if failed and failed == len(document["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
