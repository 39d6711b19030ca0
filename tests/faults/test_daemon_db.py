"""The node daemon's job database under faults (issue 28): locked by another process during a
dump that stops its job, and corrupt at the daemon's start. In every case the job is never
left frozen, its checkpoint stays listed, and nobody reads SQLAlchemy's text."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

from stasis.engine import proctree
from tests.conftest import Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_netlock import Peer, peer, start  # noqa: F401 - the fixture
from tests.faults import kit
from tests.faults.kit import checkpoints, stopped


def _hold_write_lock(d: Daemon) -> sqlite3.Connection:
    """Another process's write transaction on the daemon's database (an admin's sqlite3)."""
    conn = sqlite3.connect(d.state_dir / "jobs.db", isolation_level=None, timeout=0)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def test_stop_dump_while_the_database_is_locked(make_daemon: MakeDaemon, peer: Peer) -> None:
    d = make_daemon(env={"STASIS_DB_BUSY_TIMEOUT_S": "1"})
    job, _ = start(d, peer)
    lock = _hold_write_lock(d)
    try:
        answer = d.cli("dump", job["job"], check=False)
        said = answer.stderr + answer.stdout
        assert "OperationalError" not in said and "sqlalchemy" not in said.lower(), said
        # The checkpoint was taken and the job stopped, as asked: a success, with a note.
        assert answer.returncode == 0 and "could not record it yet" in said, said
        # Never left frozen: the checkpoint was published and a stop asked, so the tree goes.
        wait_for(
            lambda: not proctree.alive(job["pid"], None) or not stopped(job["pid"]),
            20,
            "the job not to stand frozen",
        )
        assert not proctree.alive(job["pid"], None), "the job runs beside its checkpoint"
        assert checkpoints(d, job["label"]), "no checkpoint listed"
    finally:
        lock.rollback()
        lock.close()
    # Once the database can be written, the job's state is what happened to it.
    wait_for(
        lambda: d.job(job["job"])["state"] == "checkpointed", 20, "the job recorded checkpointed"
    )
    assert not list((d.state_dir / "dumps").glob("*.json")), "the dump's journal entry stays"
    _release_locks(d, job["label"])


def _not_ready(d: Daemon) -> list[str]:
    report = json.loads(d.cli("check", "--json", check=False).stdout)
    return [p["what"] for p in report["problems"] if p["what"].startswith("not ready")]


def _release_locks(d: Daemon, label: str) -> None:
    """Delete the label's checkpoints: their network locks go with them (not left behind in
    the firewall by a test daemon that stops)."""
    for c in checkpoints(d, label):
        d.cli("checkpoints", "rm", c["id"])


def test_a_corrupt_database_is_moved_aside_and_rebuilt(make_daemon: MakeDaemon) -> None:
    d = make_daemon()
    running = d.run(*workload("counter.py", 0.05), label="survives")
    done = d.run(*workload("counter.py", 0.05), label="kept")
    wait_for(lambda: d.log_of(running["job"]).count("\n") >= 3, 20, "counting")
    checkpoint = d.json("dump", done["job"])["checkpoint"]
    d.stop()
    db = d.state_dir / "jobs.db"
    db.write_bytes(os.urandom(64 << 10))  # garbage, where SQLite expects its header
    for extra in ("jobs.db-wal", "jobs.db-shm"):
        (d.state_dir / extra).unlink(missing_ok=True)
    d.start()  # before: "file is not a database", and the daemon did not come up
    aside = [p.name for p in d.state_dir.glob("jobs.db.corrupt-*")]
    assert len(aside) == 1, os.listdir(d.state_dir)
    log = (d.root / "daemon.log").read_text()
    assert f"moved aside as {d.state_dir / aside[0]}" in log, log[-2000:]
    # The running job is listed again, with its tree, and is still the caller's to stop.
    job = d.job(running["job"])
    assert job["state"] == "running" and job["pid"] == running["pid"]
    assert job["label"] == "survives"
    assert [c["id"] for c in d.json("checkpoints", "--label", "kept")] == [checkpoint]
    assert not _not_ready(d), _not_ready(d)
    d.cli("kill", running["job"])
    assert not proctree.alive(running["pid"], None)


def test_not_ready_while_a_dump_waits_for_the_database(make_daemon: MakeDaemon, peer: Peer) -> None:
    d = make_daemon(env={"STASIS_DB_BUSY_TIMEOUT_S": "1"})
    job, _ = start(d, peer)
    lock = _hold_write_lock(d)
    try:
        d.cli("dump", job["job"])
        said = d.cli("check", check=False)
        assert said.returncode != 0 and "not ready" in said.stdout + said.stderr, said
    finally:
        lock.rollback()
        lock.close()
    wait_for(lambda: not _not_ready(d), 20, "the daemon ready again")
    _release_locks(d, job["label"])


def test_killed_after_publish_then_started_with_the_database_locked(
    make_daemon: MakeDaemon,
) -> None:
    """Whatever the database does at the next start, a published stop-dump's tree is not left
    stopped: killed (the stop was asked), recorded once the database can be written."""
    d = make_daemon(env={"STASIS_DB_BUSY_TIMEOUT_S": "1"})
    job = d.run(*workload("counter.py", 0.05), label="locked-start")
    wait_for(lambda: d.log_of(job["job"]).count("\n") >= 3, 20, "counting")
    kit.arm(d, "dump.after-criu")
    dump = kit.start_cli(d, "dump", job["job"])
    kit.died(d)
    dump.communicate(timeout=30)
    assert stopped(job["pid"]), "CRIU did not leave the tree stopped"
    # Not published, the tree stopped by CRIU, and the database locked at the next start.
    lock = _hold_write_lock(d)
    try:
        kit.arm(d)
        wait_for(lambda: not stopped(job["pid"]), 20, "the tree resumed")
        assert proctree.alive(job["pid"], None), "an unpublished dump's job was killed"
    finally:
        lock.rollback()
        lock.close()
    wait_for(lambda: not list((d.state_dir / "dumps").glob("*.json")), 20, "the journal empty")
    assert d.job(job["job"])["state"] == "running"
    d.cli("kill", job["job"])


def test_published_then_started_with_the_database_locked(make_daemon: MakeDaemon) -> None:
    d = make_daemon(env={"STASIS_DB_BUSY_TIMEOUT_S": "1"})
    job = d.run(*workload("counter.py", 0.05), label="locked-published")
    wait_for(lambda: d.log_of(job["job"]).count("\n") >= 3, 20, "counting")
    kit.arm(d, "dump.after-publish")
    dump = kit.start_cli(d, "dump", job["job"])
    kit.died(d)
    dump.communicate(timeout=30)
    assert stopped(job["pid"]), "the tree is not stopped at the point"
    lock = _hold_write_lock(d)
    try:
        kit.arm(d)  # starts although the database refuses writes
        wait_for(lambda: not proctree.alive(job["pid"], None), 20, "the stopped job killed")
        assert _not_ready(d), "ready while the dump's record waits"
    finally:
        lock.rollback()
        lock.close()
    wait_for(lambda: d.job(job["job"])["state"] == "checkpointed", 20, "checkpointed")
    wait_for(lambda: not list((d.state_dir / "dumps").glob("*.json")), 20, "the journal empty")
    assert checkpoints(d, "locked-published")


def test_not_ready_while_the_store_does_not_answer(
    make_daemon: MakeDaemon, world_tmp: Path
) -> None:
    # An S3 endpoint where nothing listens: the daemon runs, but cannot protect a job.
    d = make_daemon(
        store="s3://nowhere/x",
        env={
            "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
            "AWS_ACCESS_KEY_ID": "k",
            "AWS_SECRET_ACCESS_KEY": "s",
            "AWS_REGION": "us-east-1",
            "AWS_CONFIG_FILE": "/dev/null",
            "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
            "AWS_EC2_METADATA_DISABLED": "true",
        },
    )
    said = d.cli("check", check=False)
    assert said.returncode != 0, said.stdout
    problems = _not_ready(d)
    assert any("checkpoint store" in p and "does not answer" in p for p in problems), problems
