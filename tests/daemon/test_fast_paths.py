"""Fast paths: leave-running dumps staged in node memory, and `--compress auto`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

from tests.conftest import Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_restore_state import workload_pid


def _digest(d: Daemon, job: str) -> list[str]:
    return re.findall(r"^digest (\w+)$", d.log_of(job), re.M)


def test_leave_running_dump_is_staged_in_memory(make_daemon: MakeDaemon, world_tmp: Path) -> None:
    stage = world_tmp / "stage-ok"
    d: Daemon = make_daemon(env={"STASIS_STAGE_DIR": str(stage)})
    job = d.run(*workload("memhold.py", 32))
    wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
    cp = d.json("dump", "--leave-running", job["job"])
    assert cp["staged"] is True
    assert list(stage.iterdir()) == []  # moved to the store, nothing left in memory
    assert d.job(job["job"])["state"] == "running"
    d.cli("kill", job["job"])
    restored = d.json("restore", cp["checkpoint"])
    os.kill(workload_pid(restored["pid"]), signal.SIGUSR1)
    wait_for(lambda: len(_digest(d, restored["job"])) == 2, what="digest")
    assert len(set(_digest(d, restored["job"]))) == 1
    # A dump that stops the job is never staged: it goes straight to the store.
    cp2 = d.json("dump", restored["job"])
    assert cp2["staged"] is False


def test_staging_falls_back_when_memory_is_short(make_daemon: MakeDaemon, world_tmp: Path) -> None:
    stage = world_tmp / "stage-small"
    stage.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=700", "tmpfs", str(stage)], check=True
    )
    try:
        d: Daemon = make_daemon(env={"STASIS_STAGE_DIR": str(stage)})
        job = d.run(*workload("memhold.py", 32))
        wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
        result = d.cli("dump", "--leave-running", job["job"])
        # Said, not silent: in text mode on stderr, why the job stayed frozen longer.
        assert re.search(
            r"^note: not staged in memory \(the stage directory .* has \d+ MiB "
            r"free, the dump needs about \d+ MiB\)",
            result.stderr,
            re.M,
        ), result.stderr
        checkpoint = re.search(r"^checkpoint (\S+) \(", result.stdout, re.M)
        assert checkpoint is not None
        cp = next(c for c in d.json("checkpoints") if c["id"] == checkpoint[1])
        assert cp["size_bytes"] >= 32 << 20
        assert list(stage.iterdir()) == []  # nothing of it was staged
        d.cli("kill", job["job"])
        restored = d.json("restore", cp["id"])
        os.kill(workload_pid(restored["pid"]), signal.SIGUSR1)
        wait_for(lambda: len(_digest(d, restored["job"])) == 2, what="digest")
        assert len(set(_digest(d, restored["job"]))) == 1
        d.cli("kill", restored["job"])
    finally:
        subprocess.run(["umount", str(stage)], check=True)


def test_compress_auto_picks_by_content(daemon: Daemon) -> None:
    zeros = daemon.run(*workload("zeros.py", 64))
    noise = daemon.run(*workload("memhold.py", 32))
    wait_for(lambda: "ready" in daemon.log_of(zeros["job"]), what="zeros ready")
    wait_for(lambda: "ready" in daemon.log_of(noise["job"]), what="noise ready")
    z = daemon.json("dump", "--compress", "auto", zeros["job"])
    n = daemon.json("dump", "--compress", "auto", noise["job"])
    assert z["notes"] == []
    # Asked to compress, stored as is: the answer says so and why.
    assert n["notes"] == [
        "--compress auto stored the checkpoint uncompressed: a sample of its "
        "memory did not shrink to half"
    ]
    listed = {c["id"]: c for c in daemon.json("checkpoints")}
    assert listed[z["checkpoint"]]["compression"] == "zstd"
    assert listed[z["checkpoint"]]["stored_size_bytes"] * 5 <= z["size_bytes"]
    assert listed[n["checkpoint"]]["compression"] == "none"
    restored = daemon.json("restore", z["checkpoint"])
    wait_for(lambda: daemon.job(restored["job"])["state"] == "restored", what="restored")
    daemon.cli("kill", restored["job"])


def test_lazy_restore_runs_before_memory_is_back(daemon: Daemon) -> None:
    job = daemon.run(*workload("memhold.py", 64))
    wait_for(lambda: "ready" in daemon.log_of(job["job"]), what="ready")
    cp = daemon.json("dump", job["job"])
    restored = daemon.json("restore", "--lazy", cp["checkpoint"])
    assert restored["lazy"] is True and restored["notes"] == []
    os.kill(workload_pid(restored["pid"]), signal.SIGUSR1)  # touches every page: all come back
    wait_for(lambda: len(_digest(daemon, restored["job"])) == 2, what="digest")
    assert len(set(_digest(daemon, restored["job"]))) == 1
    memory = Path(daemon.state_dir / "jobs" / restored["job"] / "memory.json")
    wait_for(memory.exists, what="lazy-pages done")
    daemon.cli("kill", restored["job"])


def test_lazy_restore_of_a_user_job_and_of_a_compressed_one(daemon: Daemon) -> None:
    job = daemon.run(*workload("memhold.py", 16), user="stasis-test")
    wait_for(lambda: "ready" in daemon.log_of(job["job"]), what="ready")
    cp = daemon.json("dump", "--leave-running", job["job"])
    zcp = daemon.json("dump", "--compress", "zstd", job["job"])
    lazy = daemon.json("restore", "--lazy", cp["checkpoint"], user="stasis-test")
    assert lazy["lazy"] is True
    # A compressed checkpoint restores lazily too: the daemon serves its pages to lazy-pages,
    # decompressing each chunk as it is asked for (and verifying it).
    served = daemon.json("restore", "--lazy", zcp["checkpoint"])
    assert served["lazy"] is True and served["notes"] == []
    full: dict[str, Any] = served
    for r in (lazy, full):
        os.kill(workload_pid(r["pid"]), signal.SIGUSR1)
    # Both fault their 16 MiB back in as they hash it, through lazy-pages, which a loaded
    # machine (seen: three suites at once) can make take well over 15 s.
    wait_for(lambda: len(_digest(daemon, full["job"])) == 3, 60, "digests")
    assert len(set(_digest(daemon, full["job"]))) == 1
    for r in (lazy, full):
        daemon.cli("kill", r["job"])


def test_incremental_falls_back_to_full_without_soft_dirty(daemon: Daemon) -> None:
    job = daemon.run(*workload("memhold.py", 8))
    wait_for(lambda: "ready" in daemon.log_of(job["job"]), what="ready")
    result = daemon.cli("dump", "--incremental", "--leave-running", "--json", job["job"])
    cp = __import__("json").loads(result.stdout)
    assert cp["notes"] == [
        "incremental dump not possible: this kernel does not track dirty "
        "memory (no soft-dirty); took a full dump"
    ]
    assert f"note: {cp['notes'][0]}\n" in result.stderr
    assert cp["size_bytes"] >= 8 << 20  # a full, restorable dump
    daemon.cli("kill", job["job"])
    restored = daemon.json("restore", cp["checkpoint"])
    os.kill(workload_pid(restored["pid"]), signal.SIGUSR1)
    wait_for(lambda: len(_digest(daemon, restored["job"])) == 2, what="digest")
    assert len(set(_digest(daemon, restored["job"]))) == 1
    daemon.cli("kill", restored["job"])


def test_lazy_restore_of_corrupt_pages_is_killed(daemon: Daemon) -> None:
    job = daemon.run(*workload("memhold.py", 16))
    wait_for(lambda: "ready" in daemon.log_of(job["job"]), what="ready")
    cp = daemon.json("dump", job["job"])
    pages = max(
        (Path(daemon.store) / cp["checkpoint"]).glob("pages-*.img"), key=lambda p: p.stat().st_size
    )
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(data)
    # The small images gate the resume; the pages are hashed just after, and the job dies.
    restored = daemon.json("restore", "--lazy", cp["checkpoint"])
    wait_for(lambda: daemon.job(restored["job"])["state"] == "failed", what="killed")
    killed = daemon.state_dir / "jobs" / restored["job"] / "killed.json"
    assert "fails its checksum" in killed.read_text()
    # A full restore refuses it outright.
    result = daemon.cli("restore", cp["checkpoint"], check=False)
    assert result.returncode == 1 and "corrupt" in result.stderr


def test_a_restarted_daemon_clears_what_unfinished_dumps_left(
    make_daemon: MakeDaemon, world_tmp: Path
) -> None:
    stage = world_tmp / "stage-leftovers"
    d: Daemon = make_daemon(env={"STASIS_STAGE_DIR": str(stage)})
    job = d.run(*workload("counter.py"))
    cp = d.json("dump", "--leave-running", job["job"])
    d.stop()
    # What a daemon killed mid-dump leaves: images in node memory, a store staging directory.
    dead_id = "20261130T000000Z-dead00"
    (stage / dead_id).mkdir()
    (stage / dead_id / "pages-1.img").write_bytes(b"x" * 8192)
    (stage / "not-ours").write_text("keep")
    staged = Path(d.store) / ".staging" / dead_id
    staged.mkdir(parents=True)
    (staged / "pages-1.img").write_bytes(b"y" * 8192)
    old = 1_000_000_000
    for p in (staged / "pages-1.img", staged):
        os.utime(p, (old, old))
    d.start()
    assert not (stage / dead_id).exists() and not staged.exists()
    assert (stage / "not-ours").read_text() == "keep"
    # The published checkpoint and the job are untouched.
    assert [c["id"] for c in d.json("checkpoints")] == [cp["checkpoint"]]
    assert d.job(job["job"])["state"] == "running"
    assert "removed staging/" + dead_id in (d.root / "daemon.log").read_text()
