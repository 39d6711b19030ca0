"""One run of one case: the raw copy, the plain CRIU command line and stasis, on fresh workloads.

A case is (size, kind, destination, mode). Each method gets its own identical workload, started
the way it would be in real life (stasis: `stasis run`; CRIU: unshare + setsid + tini), and is
measured from a clean page cache state (`sync` before every timed step, never inside one).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import criu_cli, procs, raw
from bench.dest import Destination, clear_dir
from bench.modes import Mode
from bench.procs import BenchError, LogTail
from bench.stasis_driver import StasisDaemon
from bench.stats import DumpStats, RestoreStats, read_dump_stats, read_restore_stats
from bench.workloads import MEMHOLD

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Case:
    size_bytes: int
    kind: str
    dest: str
    mode: Mode

    def key(self) -> dict[str, Any]:
        return {
            "size_bytes": self.size_bytes,
            "kind": self.kind,
            "dest": self.dest,
            "mode": self.mode.name,
        }

    def ready_timeout_s(self) -> float:
        # Filling runs at ~0.3 GB/s at worst (float32 on a busy VM).
        return 60 + 8 * self.size_bytes / (1 << 30) * 4


def workload_command(case: Case) -> list[str]:
    return [sys.executable, "-u", str(MEMHOLD), case.kind, str(case.size_bytes)]


def dir_bytes(path: Path) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))


def _fresh(path: Path) -> Path:
    path.unlink(missing_ok=True)
    return path


@dataclass(frozen=True)
class Ready:
    digest: str
    hash_s: float  # digest time with all memory resident


def _ready(tail: LogTail, case: Case) -> Ready:
    line, _ = tail.wait_line("ready ", case.ready_timeout_s())
    _, digest, took = line.split()
    return Ready(digest, float(took))


def _memory_back(
    pid: int, tail: LogTail, ready: Ready, restore_start: float, timeout_s: float
) -> tuple[str, float]:
    """Ask the restored workload for its digest: (digest, seconds from restore start until all
    memory was back). Hashing touches every page, so with lazy pages the answer also marks the
    moment the last page arrived; the hashing itself (as timed before the dump) is subtracted."""
    os.kill(pid, signal.SIGUSR1)
    try:
        line, seen = tail.wait_line("digest ", timeout_s)
    except BenchError as e:
        raise BenchError(f"{e}; restored tree: {_tree_state(pid)}") from e
    return line.split()[1], seen - restore_start - ready.hash_s


def _tree_state(pid: int) -> str:
    """State and kernel wait channel of `pid` and its children, to tell a hang from a death."""
    out = []
    for p in [pid, *_children(pid)]:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = Path(f"/proc/{p}/wchan").read_text()
        except OSError:
            state, wchan = "gone", ""
        out.append(f"{p}:{state}:{wchan}")
    return " ".join(out)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _figures(
    dump_s: float, st: DumpStats, image_bytes: int, restore_s: float, rst: RestoreStats | None
) -> dict[str, Any]:
    written = st.pages_written * PAGE
    return {
        "dump_s": dump_s,
        "frozen_s": st.frozen_s,
        "freezing_s": st.freezing_s,
        "memdump_s": st.memdump_s,
        "memwrite_s": st.memwrite_s,
        "pages_written": st.pages_written,
        "pages_lazy": st.pages_lazy,
        "bytes_written": written,
        "image_bytes": image_bytes,
        "dump_gbps": written / dump_s / 1e9 if dump_s > 0 else None,
        "restore_s": restore_s,
        "criu_restore_time_s": rst.restore_s if rst else None,
        "pages_restored": rst.pages_restored if rst else None,
    }


def _finish_restore(
    fig: dict[str, Any],
    lazy: bool,
    pid: int,
    tail: LogTail,
    ready: Ready,
    restore_start: float,
    verify: bool,
    case: Case,
) -> None:
    """`lazy`: the restore returned before all memory was back (asked for, and not fallen back)."""
    fig["memory_s"] = fig["restore_s"]  # a full restore returns with all memory back
    fig["verified"] = None
    if verify or lazy:
        digest, back_s = _memory_back(pid, tail, ready, restore_start, case.ready_timeout_s())
        if lazy:
            fig["memory_s"] = max(back_s, fig["restore_s"])
        fig["verified"] = digest == ready.digest
        if not fig["verified"]:
            raise BenchError(f"restored memory differs: digest {digest}, expected {ready.digest}")


def _stored_bytes(dest: Destination, checkpoint: str) -> int:
    fs = dest.filesystem()
    return sum(
        int(e["size"]) for e in fs.ls(f"{dest.url}/{checkpoint}".removeprefix("s3://"), detail=True)
    )


def measure_criu(case: Case, dest: Destination, work: Path, verify: bool) -> dict[str, Any]:
    images = dest.scratch / "criu-images"
    images.mkdir()
    cwork = work / "criu-work"
    cwork.mkdir(exist_ok=True)
    log = _fresh(work / "criu-workload.log")
    ns = procs.start_namespaced(workload_command(case), log, work)
    restored: int | None = None
    original_gone = False
    try:
        tail = LogTail(log)
        ready = _ready(tail, case)
        _fresh(cwork / "stats-dump")
        os.sync()
        d = criu_cli.dump(ns.init_pid, images, cwork, case.mode.leave_running)
        upload_s = 0.0
        if dest.s3 is not None:  # what a user without stasis does next: upload the images
            fs, started = dest.filesystem(), time.monotonic()
            fs.put(str(images) + "/", f"{dest.bucket}/criu-images/", recursive=True)
            upload_s = time.monotonic() - started
        # criu leaves its images in the page cache; stasis publishes only once they are on disk.
        # What it takes a user to get there too (sync flushes this run's images, little else).
        synced = time.monotonic()
        os.sync()
        sync_s = time.monotonic() - synced
        st = read_dump_stats(cwork / "stats-dump")
        procs.kill_tree(ns.init_pid)  # a no-op unless the dump left it running
        ns.unshare.wait(timeout=30)
        original_gone = True
        image_bytes = dir_bytes(images)
        _fresh(cwork / "stats-restore")
        os.sync()
        start = time.monotonic()
        download_s = 0.0
        if dest.s3 is not None:  # and before restoring: download them again
            clear_dir(images)
            fs = dest.filesystem()
            fs.get(f"{dest.bucket}/criu-images/", str(images) + "/", recursive=True)
            download_s = time.monotonic() - start
        r = criu_cli.restore(images, cwork)
        assert r.pid is not None
        restored = r.pid
        rst = (
            read_restore_stats(cwork / "stats-restore")
            if (cwork / "stats-restore").exists()
            else None
        )
        fig = _figures(d.wall_s, st, image_bytes, r.wall_s, rst)
        fig["dump_sync_s"] = d.wall_s + sync_s
        if dest.s3 is not None:
            fig["dump_upload_s"] = d.wall_s + upload_s
            fig["download_restore_s"] = download_s + r.wall_s
            dest.filesystem().rm(f"{dest.bucket}/criu-images", recursive=True)
        _finish_restore(fig, False, restored, tail, ready, start, verify, case)
        return fig
    finally:
        if restored is not None:
            procs.kill_tree(restored)
        if not original_gone:
            procs.kill_tree(ns.init_pid)
        if ns.unshare.poll() is None:
            ns.unshare.kill()
            ns.unshare.wait()
        clear_dir(dest.scratch)


def measure_stasis(
    case: Case, daemon: StasisDaemon, work: Path, verify: bool, dest: Destination | None = None
) -> dict[str, Any]:
    log = _fresh(work / "stasis-workload.log")
    job = daemon.run(workload_command(case), log)["job"]
    jobs = [job]
    checkpoint: str | None = None
    try:
        tail = LogTail(log)
        ready = _ready(tail, case)
        _fresh(daemon.criu_work / "stats-dump")
        os.sync()
        d = daemon.dump(job, case.mode.dump_args)
        checkpoint = d.answer["checkpoint"]
        st = read_dump_stats(daemon.criu_work / "stats-dump")
        if case.mode.leave_running:
            daemon.kill(job)
        image_bytes = (
            _stored_bytes(dest, str(checkpoint))
            if dest is not None and dest.s3
            else dir_bytes(daemon.store_root / str(checkpoint))
        )
        _fresh(daemon.criu_work / "stats-restore")
        os.sync()
        start = time.monotonic()
        r = daemon.restore(str(checkpoint), case.mode.restore_args)
        jobs.append(r.answer["job"])
        stats_restore = daemon.criu_work / "stats-restore"
        rst = read_restore_stats(stats_restore) if stats_restore.exists() else None
        fig = _figures(d.wall_s, st, image_bytes, r.wall_s, rst)
        fig["daemon_dump_s"] = d.answer.get("duration_s")
        fig["daemon_restore_s"] = r.answer.get("duration_s")
        # The same calls without the CLI: what a scheduler plugin calling the API waits for.
        fig["api_dump_s"] = d.answer.get("elapsed_s")
        fig["api_restore_s"] = r.answer.get("elapsed_s")
        fig["checkpoint_size_bytes"] = d.answer.get("size_bytes")
        # Whatever else stasis reports (staging, fallbacks, ...) is kept for the record.
        fig["dump_answer"], fig["restore_answer"] = d.answer, r.answer
        # The daemon may restore lazily by default, or fall back to a full restore: trust it.
        lazy = bool(r.answer.get("lazy", case.mode.lazy))
        fig["lazy_used"] = lazy
        _finish_restore(fig, lazy, int(r.answer["pid"]), tail, ready, start, verify, case)
        fig["cli_floor_s"] = daemon.cli_floor_s()
        return fig
    finally:
        for j in jobs:
            daemon.kill(j)
        if checkpoint:
            daemon.remove_checkpoint(checkpoint)
        if daemon.criu_work.exists():
            clear_dir(daemon.criu_work)  # verbose CRIU logs add up over a suite


def run_once(
    case: Case,
    dest: Destination,
    daemon: StasisDaemon,
    work: Path,
    index: int,
    verify: bool,
    baseline: StasisDaemon | None = None,
) -> dict[str, Any]:
    """All methods once (`baseline`: a daemon of the baseline commit, a store of its own). The
    order turns run by run, so that drift hits all alike."""
    result: dict[str, Any] = {"case": case.key(), "run": index}
    try:
        r = (
            raw.s3_baseline(dest.filesystem(), dest.bucket, case.size_bytes)
            if dest.s3 is not None
            else raw.copy_baseline(dest.scratch, case.size_bytes)
        )
        result["raw"] = {
            **asdict(r),
            "write_gbps": r.size_bytes / r.write_s / 1e9,
            "read_gbps": r.size_bytes / r.read_s / 1e9,
        }
        methods = ["criu", "stasis"] + (["baseline"] if baseline is not None else [])
        turn = index % len(methods)
        order = (
            methods[turn:] + methods[:turn]
            if baseline is not None
            else (("criu", "stasis") if index % 2 == 0 else ("stasis", "criu"))
        )
        for method in order:
            if method == "criu":
                result["criu"] = measure_criu(case, dest, work, verify)
            elif method == "baseline":
                assert baseline is not None
                result["baseline"] = measure_stasis(case, baseline, work, verify, dest)
            else:
                result["stasis"] = measure_stasis(case, daemon, work, verify, dest)
    except (BenchError, OSError, ValueError, KeyError) as e:
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        clear_dir(dest.scratch)
        procs.reap_orphans()
    return result
