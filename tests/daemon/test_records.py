"""stasis.daemon.records: integrations' rows kept as files for a rebuild of a corrupt job
database, on a real database and directory. A refresh keeps the file to the row; a rebuilt
database gets the rows back (over a salvaged row of the same key); a sound start matches the
files to the rows (an upgraded daemon's rows get theirs, stale files go); a file that is not
a record of its table (torn, misplaced) is skipped, never a crash."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, select, update

from stasis.daemon import records
from stasis.daemon.db import JobDB

_md = MetaData()
kept = Table(
    "kept_rows",
    _md,
    Column("id", String(40), primary_key=True),
    Column("state", String(16), nullable=False),
    Column("n", Integer, nullable=True),
    info={records.KEY: records.ALL},
)
answers = Table(
    "answer_rows",
    _md,
    Column("id", String(40), primary_key=True),
    Column("result", String(100), nullable=False),
    info={records.KEY: records.UNTIL_DROPPED},
)
plain = Table("plain_rows", _md, Column("id", Integer, primary_key=True))
TABLES = [kept, answers, plain]


@pytest.fixture
def db(tmp_path: Path) -> Iterator[JobDB]:
    d = JobDB(tmp_path / "jobs.db")
    d.create_tables(TABLES)
    yield d
    d.engine.dispose()


def files(root: Path, table: Table) -> list[Path]:
    return sorted((root / table.name).glob("*.json"))


def rows(db: JobDB, table: Table) -> list[dict[str, object]]:
    with db.transaction() as conn:
        return [dict(r) for r in conn.execute(select(table).order_by(table.c.id)).mappings()]


def put(db: JobDB, table: Table, **values: object) -> None:
    with db.transaction() as conn:
        conn.execute(insert(table).values(**values))


def test_a_refresh_keeps_the_file_to_the_row(db: JobDB, tmp_path: Path) -> None:
    root = tmp_path / "records"
    kept_files = records.Records(db, root)
    put(db, kept, id="a/../b", state="running", n=1)  # a key is never a path
    kept_files.refresh(kept, "a/../b")
    (path,) = files(root, kept)
    assert path.name == records.file_name("a/../b")
    assert json.loads(path.read_text())["row"] == {"id": "a/../b", "state": "running", "n": 1}
    assert path.stat().st_mode & 0o777 == 0o600
    assert (root / kept.name).stat().st_mode & 0o777 == 0o700
    with db.transaction() as conn:
        conn.execute(update(kept).where(kept.c.id == "a/../b").values(state="stopping"))
    kept_files.refresh(kept, "a/../b")
    assert json.loads(path.read_text())["row"]["state"] == "stopping"
    with db.transaction() as conn:
        conn.execute(kept.delete())
    kept_files.refresh(kept, "a/../b")
    assert not files(root, kept)


def test_a_rebuilt_database_gets_the_rows_back_over_salvaged_ones(
    db: JobDB, tmp_path: Path
) -> None:
    root = tmp_path / "records"
    kept_files = records.Records(db, root)
    put(db, kept, id="j1", state="stopping", n=None)
    kept_files.refresh(kept, "j1")
    put(db, answers, id="c1", result="{}")
    kept_files.refresh(answers, "c1")
    fresh = JobDB(tmp_path / "rebuilt.db")
    try:
        fresh.create_tables(TABLES)
        put(fresh, kept, id="j1", state="running", n=5)  # salvaged: an older page
        put(fresh, kept, id="j2", state="running", n=2)  # salvaged only: kept
        assert records.restore(fresh, root, TABLES) == {"kept_rows": 1, "answer_rows": 1}
        assert rows(fresh, kept) == [
            {"id": "j1", "state": "stopping", "n": None},
            {"id": "j2", "state": "running", "n": 2},
        ]
        assert rows(fresh, answers) == [{"id": "c1", "result": "{}"}]
    finally:
        fresh.engine.dispose()


def test_files_not_of_their_table_are_skipped(db: JobDB, tmp_path: Path) -> None:
    root = tmp_path / "records"
    d = root / kept.name
    d.mkdir(parents=True)
    (d / "torn.json").write_text('{"table": "kept_rows", "key": "x", "row": {"id"')
    (d / records.file_name("y")).write_text(
        json.dumps({"table": "kept_rows", "key": "z", "row": {"id": "z", "state": "running"}})
    )
    (d / records.file_name("w")).write_text(
        json.dumps({"table": "answer_rows", "key": "w", "row": {"id": "w", "state": "running"}})
    )
    (d / records.file_name("v")).write_text(
        json.dumps({"table": "kept_rows", "key": "v", "row": {"id": "v"}})
    )  # no state: refused by SQL
    os.symlink("/etc/passwd", d / records.file_name("u"))
    good = {"id": "t", "state": "running", "n": 3, "gone_column": 1}
    (d / records.file_name("t")).write_text(
        json.dumps({"table": "kept_rows", "key": "t", "row": good})
    )
    assert records.restore(db, root, TABLES) == {"kept_rows": 1, "answer_rows": 0}
    assert rows(db, kept) == [{"id": "t", "state": "running", "n": 3}]


def test_a_sound_start_matches_the_files_to_the_rows(db: JobDB, tmp_path: Path) -> None:
    root = tmp_path / "records"
    put(db, kept, id="old", state="running", n=1)  # an upgraded daemon's row: no file yet
    put(db, answers, id="acked", result="{}")  # an answer taken before: no file made
    put(db, answers, id="waiting", result="{}")
    kept_files = records.Records(db, root)
    kept_files.refresh(answers, "waiting")
    stale = root / kept.name / records.file_name("gone")  # its row deleted, the file not
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    old_answer = root / answers.name / records.file_name("ancient")
    put(db, answers, id="ancient", result="{}")
    kept_files.refresh(answers, "ancient")
    week_ago = time.time() - 8 * 86400
    os.utime(old_answer, (week_ago, week_ago))
    records.sync(db, root, TABLES)
    assert [p.name for p in files(root, kept)] == [records.file_name("old")]
    assert [p.name for p in files(root, answers)] == [records.file_name("waiting")]
    assert not (root / plain.name).exists()
