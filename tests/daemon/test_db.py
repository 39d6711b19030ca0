"""stasis.daemon.db.JobDB on a file of its own: the jobs table, the network locks, tables of an
integration, and a private file (with its WAL and shared memory) under the daemon's umask."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, select

from stasis.daemon.db import JobDB, JobRow, NetLockRow


def row(
    job_id: str, state: str = "running", created: str = "2026-01-01T00:00:00.000+00:00", **kw: Any
) -> JobRow:
    base = JobRow(
        id=job_id,
        pid=100,
        pid_start=12345,
        shim_pid=99,
        state=state,
        label="lab",
        exit_code=None,
        command=["python3", "-u", "x.py"],
        cwd="/",
        env=["A", "B"],
        user="root",
        uid=0,
        gid=0,
        log="/tmp/x.log",
        checkpoint=None,
        created=created,
        job_dir=f"/state/jobs/{job_id}",
    )
    return replace(base, **kw)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[JobDB]:
    d = JobDB(tmp_path / "jobs.db")
    yield d
    d.engine.dispose()


def test_add_get_all(db: JobDB, tmp_path: Path) -> None:
    assert db.get("000000000001") is None and db.all() == []
    second = row("000000000002", created="2026-01-02T00:00:00.000+00:00")
    first = row("000000000001", created="2026-01-01T00:00:00.000+00:00", checkpoint="cp-1")
    db.add(second)
    db.add(first)
    assert db.get("000000000001") == first  # JSON columns come back as lists
    assert db.all() == [first, second]  # ordered by created
    with pytest.raises(Exception):  # the id is the primary key
        db.add(first)
    db.engine.dispose()
    again = JobDB(tmp_path / "jobs.db")  # what a restarted daemon reads
    try:
        assert again.all() == [first, second]
    finally:
        again.engine.dispose()


def test_live_finished_and_remove_finished(db: JobDB) -> None:
    states = {
        "00000000000a": "running",
        "00000000000b": "restored",
        "00000000000c": "exited",
        "00000000000d": "checkpointed",
        "00000000000e": "exited",
    }
    for i, (job_id, state) in enumerate(states.items()):
        db.add(
            row(
                job_id,
                state,
                created=f"2026-01-0{i + 1}T00:00:00.000+00:00",
                shim_pid=None if job_id == "00000000000e" else 7,
            )
        )
    assert {r.id for r in db.live()} == {"00000000000a", "00000000000b"}
    assert db.finished() == [  # newest first
        ("00000000000e", "2026-01-05T00:00:00.000+00:00", "/state/jobs/00000000000e", None),
        ("00000000000d", "2026-01-04T00:00:00.000+00:00", "/state/jobs/00000000000d", 7),
        ("00000000000c", "2026-01-03T00:00:00.000+00:00", "/state/jobs/00000000000c", 7),
    ]
    # Live rows are never removed, whatever is asked; unknown ids count for nothing.
    assert db.remove_finished(["00000000000a", "00000000000c", "00000000000d", "ffffffffffff"]) == 2
    assert [r.id for r in db.all()] == ["00000000000a", "00000000000b", "00000000000e"]
    assert db.remove_finished([]) == 0


def test_remove_finished_in_chunks(db: JobDB) -> None:
    ids = [f"{i:012x}" for i in range(1200)]  # more than one statement's parameters
    for job_id in ids:
        db.add(row(job_id, "exited"))
    db.add(row("ffffffffffff", "running"))
    assert db.remove_finished([*ids, "ffffffffffff"]) == 1200
    assert [r.id for r in db.all()] == ["ffffffffffff"]


def test_set_and_finish(db: JobDB) -> None:
    db.add(row("000000000001"))
    db.set("000000000001", state="restored", pid=321, checkpoint="cp-9")
    got = db.get("000000000001")
    assert got is not None and (got.state, got.pid, got.checkpoint) == ("restored", 321, "cp-9")
    db.set("ffffffffffff", state="exited")  # no such row: nothing happens
    assert db.get("ffffffffffff") is None

    assert db.finish("000000000001", "exited", 3) is True
    got = db.get("000000000001")
    assert got is not None and (got.state, got.exit_code) == ("exited", 3)
    # No longer live: a second finisher loses, and changes nothing.
    assert db.finish("000000000001", "checkpointed", None) is False
    got = db.get("000000000001")
    assert got is not None and (got.state, got.exit_code) == ("exited", 3)
    assert db.finish("ffffffffffff", "exited", 0) is False


def test_finish_has_one_winner(db: JobDB) -> None:
    db.add(row("000000000001"))
    wins: list[str] = []
    barrier = threading.Barrier(8)

    def race(state: str) -> None:
        barrier.wait()
        if db.finish("000000000001", state, None):
            wins.append(state)

    threads = [threading.Thread(target=race, args=(f"s{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = db.get("000000000001")
    assert len(wins) == 1 and got is not None and got.state == wins[0]


def test_netlocks(db: JobDB) -> None:
    assert db.netlocks() == []
    late = NetLockRow(
        checkpoint="cp-b", job="job-b", created=200.0, rules=[["iptables", "-D", "INPUT", "x"]]
    )
    early = NetLockRow(
        checkpoint="cp-a",
        job="job-a",
        created=100.0,
        rules=[["iptables", "-D", "OUTPUT", "y"], ["ip6tables", "-D", "z"]],
    )
    db.add_netlock(late)
    db.add_netlock(early)
    assert db.netlocks() == [early, late]  # ordered by created
    # The same checkpoint again replaces its row.
    newer = NetLockRow(checkpoint="cp-a", job="job-a2", created=300.0, rules=[])
    db.add_netlock(newer)
    assert db.netlocks() == [late, newer]
    assert db.remove_netlock("cp-b") is True
    assert db.remove_netlock("cp-b") is False
    assert db.remove_netlock("cp-none") is False
    assert db.netlocks() == [newer]


def test_an_integrations_table(db: JobDB, tmp_path: Path) -> None:
    extra = Table(
        "extra_things",
        MetaData(),
        Column("key", String(8), primary_key=True),
        Column("n", Integer, nullable=False),
    )
    db.create_tables([extra])
    db.create_tables([extra])  # again, as at every start: kept as it is
    with db.transaction() as conn:
        conn.execute(insert(extra).values(key="a", n=1))
        conn.execute(insert(extra).values(key="b", n=2))
    # A transaction that fails leaves nothing behind.
    with pytest.raises(RuntimeError):
        with db.transaction() as conn:
            conn.execute(insert(extra).values(key="c", n=3))
            raise RuntimeError("boom")
    with db.transaction() as conn:
        rows = conn.execute(select(extra.c.key, extra.c.n).order_by(extra.c.key)).all()
    assert [tuple(r) for r in rows] == [("a", 1), ("b", 2)]
    db.add(row("000000000001"))  # the jobs table is still there beside it
    db.engine.dispose()
    again = JobDB(tmp_path / "jobs.db")
    try:
        again.create_tables([extra])
        with again.transaction() as conn:
            assert conn.execute(select(extra.c.n)).scalars().all() == [1, 2]
    finally:
        again.engine.dispose()


def test_files_are_private_under_the_daemons_umask(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    old = os.umask(0o077)  # what `stasis daemon` sets before it opens the database
    try:
        db = JobDB(path)
        db.add(row("000000000001"))
        modes = {
            name: stat.S_IMODE(os.stat(f"{path}{name}").st_mode) for name in ("", "-wal", "-shm")
        }
        assert db.get("000000000001") is not None
        db.engine.dispose()
    finally:
        os.umask(old)
    assert modes == {"": 0o600, "-wal": 0o600, "-shm": 0o600}


def test_files_follow_the_umask(tmp_path: Path) -> None:
    # The check above can fail: under a looser umask the same files are readable by others.
    path = tmp_path / "jobs.db"
    old = os.umask(0o022)
    try:
        db = JobDB(path)
        db.add(row("000000000001"))
        mode = stat.S_IMODE(path.stat().st_mode)
        db.engine.dispose()
    finally:
        os.umask(old)
    assert mode == 0o644
