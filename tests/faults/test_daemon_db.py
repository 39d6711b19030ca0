"""The node daemon's job database under faults (issue 28): locked by another process during a
dump that stops its job, and corrupt at the daemon's start. In every case the job is never
left frozen, its checkpoint stays listed, and nobody reads SQLAlchemy's text."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from stasis.engine import proctree
from tests.conftest import Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_netlock import Peer, peer, start  # noqa: F401 - the fixture
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
        wait_for(lambda: not proctree.alive(job["pid"], None) or not stopped(job["pid"]), 20,
                 "the job not to stand frozen")
        assert not proctree.alive(job["pid"], None), "the job runs beside its checkpoint"
        assert checkpoints(d, job["label"]), "no checkpoint listed"
    finally:
        lock.rollback()
        lock.close()
    # Once the database can be written, the job's state is what happened to it.
    wait_for(lambda: d.job(job["job"])["state"] == "checkpointed", 20,
             "the job recorded checkpointed")
    assert not list((d.state_dir / "dumps").glob("*.json")), "the dump's journal entry stays"
