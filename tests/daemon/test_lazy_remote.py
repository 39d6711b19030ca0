"""Lazy restore from a store CRIU cannot read in place (dir::file://: fsspec over a local
directory, the path an object store takes): the job runs again before its memory is back, its
pages come from the daemon's page server, and a page that cannot be had kills it."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

from stasis.engine import proctree
from tests.conftest import Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_restore_state import workload_pid
from tests.s3server import S3Server


def _digests(d: Daemon, job: str) -> list[str]:
    return re.findall(r"^digest (\w+)$", d.log_of(job), re.M)


def _counts(d: Daemon, job: str) -> list[int]:
    return [int(n) for n in re.findall(r"^(\d+)$", d.log_of(job), re.M)]


def test_lazy_restore_from_a_remote_store(make_daemon: MakeDaemon, world_tmp: Path) -> None:
    store = world_tmp / "lazy-remote-store"
    d = make_daemon(store=f"dir::file://{store}")
    job = d.run(*workload("memhold.py", 48))
    counter = d.run(*workload("counter.py", 0.05, 8))
    wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
    wait_for(lambda: len(_counts(d, counter["job"])) > 3, what="counting")
    cp = d.json("dump", job["job"])
    ccp = d.json("dump", counter["job"])
    before = _counts(d, counter["job"])[-1]

    restored = d.json("restore", "--lazy", cp["checkpoint"])
    assert restored["lazy"] is True and restored["notes"] == []
    os.kill(workload_pid(restored["pid"]), signal.SIGUSR1)  # touches every page
    wait_for(lambda: len(_digests(d, restored["job"])) == 2, 60, "digest")
    assert len(set(_digests(d, restored["job"]))) == 1
    memory = d.state_dir / "jobs" / restored["job"] / "memory.json"
    wait_for(memory.exists, 60, "lazy-pages done")
    assert json.loads(memory.read_text())["ok"] is True
    # From the daemon's page server, not from local images.
    lazy_log = d.state_dir / "criu-logs" / f"restore-{restored['job']}" / "lazy-pages.log"
    assert "Opened remote page read" in lazy_log.read_text()
    assert d.job(restored["job"])["state"] == "restored"
    # Nothing of it stays in scratch space once every page is back.
    wait_for(lambda: not list((d.state_dir / "scratch").glob("*-lazy-*")), what="scratch gone")

    # The counter goes on from where it was (the log is appended to: the last value before
    # the dump is followed by the next ones).
    restored_counter = d.json("restore", "--lazy", ccp["checkpoint"])
    assert restored_counter["lazy"] is True
    wait_for(lambda: _counts(d, counter["job"])[-1] > before + 3, what="counting on")
    counts = _counts(d, counter["job"])
    i = counts.index(before)
    assert counts[i + 1] == before + 1
    for r in (restored, restored_counter):
        d.cli("kill", r["job"])


def test_a_page_that_cannot_be_had_kills_the_job(make_daemon: MakeDaemon, world_tmp: Path) -> None:
    store = world_tmp / "lazy-remote-gone"
    # Each answer held back 50 ms: lazy-pages asks for 64 KiB, then 64 KiB more each time up to
    # 4 MiB, so 64 MiB take some 45 answers (over 2 s) to come.
    d = make_daemon(store=f"dir::file://{store}", env={"STASIS_TEST_PAGE_DELAY_MS": "50"})
    job = d.run(*workload("memhold.py", 64))
    wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
    cp = d.json("dump", job["job"])
    restored = d.json("restore", "--lazy", cp["checkpoint"])
    assert restored["lazy"] is True
    # The store loses the pages after the restore started, before they all came.
    for pages in (store / cp["checkpoint"]).glob("pages-*.img"):
        pages.unlink()
    # Its memory touched (SIGUSR1), unless lazy-pages' own fetch in the background met a lost
    # page first and the job is gone already (a fresh Debian 12 root, second run: no workload
    # left to signal). Either way it must be killed, never fed wrong memory.
    held = next(iter(proctree.children(restored["pid"])), None)
    if held is not None:
        try:
            os.kill(held, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    wait_for(lambda: d.job(restored["job"])["state"] in ("exited", "failed"), 60, "killed")
    job_dir = d.state_dir / "jobs" / restored["job"]
    reason = json.loads((job_dir / "killed.json").read_text())["reason"]
    assert "pages-" in reason, reason
    # Never fed wrong memory: it died without printing a digest of what it held.
    assert _digests(d, restored["job"]) == [_digests(d, job["job"])[0]]
    assert d.job(restored["job"])["state"] == "failed"
    assert re.search(
        f"killed lazily restored job {restored['job']} .*: a page could not be had "
        "from the store: .*pages-",
        (d.root / "daemon.log").read_text(),
    )


def test_lazy_restore_from_s3(
    make_daemon: MakeDaemon, s3: S3Server, s3_bucket: str, site_key: Path
) -> None:
    env = {**s3.env(), "STASIS_SITE_KEY": str(site_key)}
    node_a = make_daemon(store=f"s3://{s3_bucket}/site", env=env)
    node_b = make_daemon(store=f"s3://{s3_bucket}/site", env=env)
    job = node_a.run(*workload("memhold.py", 32))
    wait_for(lambda: "ready" in node_a.log_of(job["job"]), what="ready")
    cp = node_a.json("dump", job["job"])
    restored = node_b.json("restore", "--lazy", cp["checkpoint"])
    assert restored["lazy"] is True and restored["notes"] == []
    os.kill(workload_pid(restored["pid"]), signal.SIGUSR1)
    wait_for(lambda: len(_digests(node_b, restored["job"])) == 2, 60, "digest")
    assert len(set(_digests(node_b, restored["job"]))) == 1
    memory = node_b.state_dir / "jobs" / restored["job"] / "memory.json"
    wait_for(memory.exists, 60, "lazy-pages done")
    assert json.loads(memory.read_text())["ok"] is True
    node_b.cli("kill", restored["job"])


def test_a_daemon_killed_mid_lazy_restore_takes_the_job_with_it(
    make_daemon: MakeDaemon, world_tmp: Path
) -> None:
    """The daemon serves a lazy restore's pages: when it dies (kill -9) before all are back, the
    job is killed by its supervisor, which holds the other end of the page server's socket, before
    lazy-pages could let the kernel map zero pages where its memory was."""
    store = world_tmp / "lazy-daemon-killed"
    d = make_daemon(store=f"dir::file://{store}", env={"STASIS_TEST_PAGE_DELAY_MS": "50"})
    job = d.run(*workload("memhold.py", 64))
    wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
    cp = d.json("dump", job["job"])
    original = _digests(d, job["job"])
    restored = d.json("restore", "--lazy", cp["checkpoint"])
    assert restored["lazy"] is True
    root = workload_pid(restored["pid"])
    os.kill(root, signal.SIGUSR1)  # touches every page: over 2 s of answers at 50 ms each
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait()
    d.stop()
    wait_for(lambda: not proctree.alive(root, None), 30, "the job to be killed")
    job_dir = d.state_dir / "jobs" / restored["job"]
    wait_for((job_dir / "killed.json").exists, 30, "killed.json")
    reason = json.loads((job_dir / "killed.json").read_text())["reason"]
    assert "page server went away" in reason, reason
    # Never fed zeros: the log (the original's, which the restored job writes on) holds the
    # original's digest alone, none from the restored job.
    log = (d.state_dir / "logs" / f"{job['job']}.log").read_text()
    assert re.findall(r"^digest (\w+)$", log, re.M) == original
    d.start()
    assert d.job(restored["job"])["state"] == "failed"


def test_a_graceful_stop_waits_for_a_lazy_restore_s_pages(
    make_daemon: MakeDaemon, world_tmp: Path
) -> None:
    """`systemctl restart stasis` mid lazy restore: the daemon stops answering, serves the
    remaining pages, then ends; the job lives on with all of its memory (before, the stop took
    the page server with it and the job was killed)."""
    store = world_tmp / "lazy-daemon-drained"
    d = make_daemon(
        store=f"dir::file://{store}",
        env={"STASIS_TEST_PAGE_DELAY_MS": "50", "STASIS_LAZY_DRAIN_TIMEOUT_S": "15"},
    )
    job = d.run(*workload("memhold.py", 64))
    wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
    cp = d.json("dump", job["job"])
    original = _digests(d, job["job"])
    restored = d.json("restore", "--lazy", cp["checkpoint"])
    assert restored["lazy"] is True
    root = workload_pid(restored["pid"])
    memory = d.state_dir / "jobs" / restored["job"] / "memory.json"
    assert not memory.exists()  # pages still to come: 64 MiB at 50 ms an answer
    d.stop()  # SIGTERM, waits for the daemon to end
    assert memory.exists() and json.loads(memory.read_text())["ok"] is True
    assert proctree.alive(root, None)
    os.kill(root, signal.SIGUSR1)
    # The restored job writes on the original's log (read here: the daemon is down).
    log = d.state_dir / "logs" / f"{job['job']}.log"
    wait_for(lambda: len(re.findall(r"^digest (\w+)$", log.read_text(), re.M)) == 2, 30, "digest")
    assert re.findall(r"^digest (\w+)$", log.read_text(), re.M) == original * 2
    assert not (d.state_dir / "jobs" / restored["job"] / "killed.json").exists()
    d.start()
    assert d.job(restored["job"])["state"] == "restored"
    d.cli("kill", restored["job"])
