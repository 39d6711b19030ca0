"""stasis.slurm.registrations.Registrations: Slurm registrations as rows of the daemon's
database, and the move of the JSON files an older daemon kept in <state_dir>/slurm/."""

from __future__ import annotations

import json
import os
import pwd
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from stasis.client import Client
from stasis.daemon.db import JobDB
from stasis.engine import proctree
from stasis.slurm.registrations import Registrations, slurm_jobs_table
from stasis.wire import Registration
from tests.conftest import Daemon, new_daemon


def registration(slurm_job: str, **kw: Any) -> Registration:
    """A registration as the daemon keeps it (and an older daemon wrote it as JSON)."""
    reg = Registration(
        slurm_job=slurm_job,
        pid=4242,
        pid_start=987654,
        launcher_pid=4241,
        uid=1001,
        gid=1001,
        user="stasis-test",
        label=f"lab-{slurm_job}",
        explicit_label=True,
        token="tok",
        stdout="/home/u/slurm-%j.out",
        stderr="/home/u/slurm-%j.err",
        work_dir="/home/u",
        command=["/bin/sh", "job.sh", "with space"],
        state="running",
        registered="2026-01-01T00:00:00+00:00",
        stop_asked=False,
        final_failed=False,
        stop_checkpoint=None,
        restarts=0,
        restored_from=None,
    )
    return cast(Registration, {**reg, **kw})


def as_json(reg: Registration) -> str:
    return json.dumps(reg)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[JobDB]:
    d = JobDB(tmp_path / "jobs.db")
    d.create_tables([slurm_jobs_table])
    yield d
    d.engine.dispose()


@pytest.fixture
def regs(db: JobDB) -> Registrations:
    return Registrations(db)


def test_save_get_remove(regs: Registrations) -> None:
    assert regs.get("101") is None
    a = registration("101")
    b = registration("102", pid_start=None, explicit_label=False, label="102")
    regs.save(a)
    regs.save(b)
    assert regs.get("101") == a and regs.get("102") == b  # lists and bools come back as such
    # Saving again replaces the row.
    a2 = registration("101", pid=5555, label="relabelled")
    regs.save(a2)
    assert regs.get("101") == a2
    regs.remove("101")
    assert regs.get("101") is None and regs.get("102") == b
    regs.remove("101")  # gone already: nothing happens
    assert regs.get("102") == b


def test_running_and_set_state(regs: Registrations) -> None:
    for job in ("201", "202", "203"):
        regs.save(registration(job))
    regs.set_state("202", "checkpointed")
    regs.set_state("203", "requeue-failed")
    regs.set_state("999", "checkpointed")  # no such row
    assert [r["slurm_job"] for r in regs.running()] == ["201"]
    assert regs.get("202") == registration("202", state="checkpointed")
    assert regs.get("203") == registration("203", state="requeue-failed")
    assert regs.get("999") is None


def test_rows_survive_a_new_database_object(tmp_path: Path, regs: Registrations) -> None:
    reg = registration("301")
    regs.save(reg)
    regs.db.engine.dispose()
    again = JobDB(tmp_path / "jobs.db")
    try:
        again.create_tables([slurm_jobs_table])
        assert Registrations(again).get("301") == reg
    finally:
        again.engine.dispose()


def test_migrate_moves_the_files(regs: Registrations, tmp_path: Path) -> None:
    legacy = tmp_path / "slurm"
    legacy.mkdir()
    old = [registration("401"), registration("402", state="checkpointed")]
    for reg in old:
        (legacy / f"{reg['slurm_job']}.json").write_text(as_json(reg))
    (legacy / "notes.txt").write_text("not a registration")  # not *.json: not looked at
    assert regs.migrate(legacy) == 2
    assert regs.get("401") == old[0] and regs.get("402") == old[1]
    assert sorted(p.name for p in legacy.iterdir()) == ["notes.txt"]
    (legacy / "notes.txt").unlink()
    assert regs.migrate(legacy) == 0  # an empty directory: removed
    assert not legacy.exists()


def test_migrate_removes_the_directory_when_done(regs: Registrations, tmp_path: Path) -> None:
    legacy = tmp_path / "slurm"
    legacy.mkdir()
    reg = registration("451")
    (legacy / "451.json").write_text(as_json(reg))
    assert regs.migrate(legacy) == 1
    assert not legacy.exists() and regs.get("451") == reg
    assert regs.migrate(legacy) == 0  # never there (again): nothing to do
    assert regs.migrate(tmp_path / "never-made") == 0


def test_migrate_leaves_what_it_cannot_read(regs: Registrations, tmp_path: Path) -> None:
    legacy = tmp_path / "slurm"
    legacy.mkdir()
    good = registration("501")
    (legacy / "501.json").write_text(as_json(good))
    (legacy / "502.json").write_text("{not json")
    (legacy / "503.json").write_text(json.dumps({"slurm_job": "503"}))  # fields missing
    (legacy / "504.json").write_bytes(b"\xff\xfe\x00garbage")
    (legacy / "505.json").mkdir()  # not a file
    assert regs.migrate(legacy) == 1
    assert regs.get("501") == good
    assert all(regs.get(j) is None for j in ("502", "503", "504", "505"))
    assert sorted(p.name for p in legacy.iterdir()) == [
        "502.json",
        "503.json",
        "504.json",
        "505.json",
    ]
    assert (legacy / "502.json").read_text() == "{not json"  # left as it was
    assert legacy.is_dir()


def test_migrate_takes_a_file_without_state_as_running(regs: Registrations, tmp_path: Path) -> None:
    legacy = tmp_path / "slurm"
    legacy.mkdir()
    data = {k: v for k, v in registration("551").items() if k != "state"}
    (legacy / "551.json").write_text(json.dumps(data))
    assert regs.migrate(legacy) == 1
    assert regs.get("551") == registration("551", state="running")


def test_migrate_leaves_a_file_with_a_wrong_kind_of_value(
    regs: Registrations, tmp_path: Path
) -> None:
    legacy = tmp_path / "slurm"
    legacy.mkdir()
    # A null label once stopped the daemon's start (NOT NULL in the table, raised from save).
    (legacy / "561.json").write_text(json.dumps({**registration("561"), "label": None}))
    (legacy / "562.json").write_text(json.dumps({**registration("562"), "explicit_label": "no"}))
    (legacy / "563.json").write_text(as_json(registration("563")))
    (legacy / "564.json").write_text(json.dumps({**registration("564"), "pid": True}))
    (legacy / "565.json").write_text(json.dumps({**registration("565"), "command": ["a", 1]}))
    assert regs.migrate(legacy) == 1
    assert all(regs.get(j) is None for j in ("561", "562", "564", "565"))
    assert regs.get("563") == registration("563")
    assert sorted(p.name for p in legacy.iterdir()) == [
        "561.json",
        "562.json",
        "564.json",
        "565.json",
    ]


def test_migrate_never_overwrites_the_table(regs: Registrations, tmp_path: Path) -> None:
    current = registration("601", state="checkpointed", label="current")
    regs.save(current)
    legacy = tmp_path / "slurm"
    legacy.mkdir()
    (legacy / "601.json").write_text(as_json(registration("601", label="stale")))
    (legacy / "602.json").write_text(as_json(registration("602")))
    assert regs.migrate(legacy) == 1  # 602 only
    assert regs.get("601") == current
    assert regs.get("602") == registration("602")
    assert not legacy.exists()  # the stale file went too: the table has the job already


def test_daemon_moves_registrations_at_start(world_tmp: Path, test_user: pwd.struct_passwd) -> None:
    d: Daemon = new_daemon(world_tmp, "daemon")
    # A live workload, so that the daemon's sweep of ended ones keeps the registration.
    workload = subprocess.Popen(["sleep", "120"])
    try:
        reg = registration(
            "701",
            pid=workload.pid,
            pid_start=proctree.start_time(workload.pid),
            uid=test_user.pw_uid,
            gid=test_user.pw_gid,
            user=test_user.pw_name,
        )
        legacy = d.state_dir / "slurm"
        legacy.mkdir(parents=True)
        os.chmod(d.state_dir, 0o711)
        (legacy / "701.json").write_text(as_json(reg))
        d.start()
        try:
            assert "moved 1 Slurm registration" in (d.root / "daemon.log").read_text()
            assert not legacy.exists()
            with Client(d.socket, timeout_s=60) as client:
                assert client.slurm_job("701") == reg
            db = sqlite3.connect(f"file:{d.state_dir / 'jobs.db'}?mode=ro", uri=True)
            try:
                rows = db.execute(
                    "SELECT slurm_job, pid, label, command, state FROM " "slurm_jobs"
                ).fetchall()
            finally:
                db.close()
            assert rows == [
                ("701", workload.pid, reg["label"], json.dumps(reg["command"]), "running")
            ]
        finally:
            d.stop()
        # A second start has nothing to move.
        d.start()
        try:
            assert (d.root / "daemon.log").read_text().count("moved 1 Slurm registration") == 1
            with Client(d.socket, timeout_s=60) as client:
                assert client.slurm_job("701")["pid"] == workload.pid
        finally:
            d.stop()
    finally:
        workload.kill()
        workload.wait()


def test_an_older_table_gets_the_stop_columns(tmp_path: Path) -> None:
    """A daemon upgraded in place: its slurm_jobs table (made without the issue-28 columns)
    gets them, its rows read as "nothing asked"."""
    import sqlite3

    path = tmp_path / "old.db"
    con = sqlite3.connect(path)
    cols = [
        c.name
        for c in slurm_jobs_table.columns
        if c.name not in ("stop_asked", "final_failed", "stop_checkpoint", "restarts")
    ]
    con.execute(f"CREATE TABLE slurm_jobs ({', '.join(cols)})")
    old = registration("301")
    values = {**old, "command": json.dumps(old["command"]), "explicit_label": 1}
    con.execute(
        f"INSERT INTO slurm_jobs ({', '.join(cols)}) VALUES " f"({', '.join('?' for _ in cols)})",
        [values[c] for c in cols],
    )
    con.commit()
    con.close()
    d = JobDB(path)
    try:
        regs = Registrations(d)
        regs.upgrade()
        regs.upgrade()  # a second start: nothing to add
        assert regs.get("301") == old
        regs.set_state("301", "stopping", stop_asked=1, stop_checkpoint="x")
        got = regs.get("301")
        assert got is not None and got["stop_asked"] is True and got["state"] == "stopping"
        assert [r["slurm_job"] for r in regs.in_state("stopping")] == ["301"]
    finally:
        d.engine.dispose()
