"""Rows of the integrations' tables whose loss would lose work or do it twice, kept also as
files: a job database found corrupt at the start is rebuilt (rebuild.py) and these rows come
back from here, whatever could be read of the old file.

    <state_dir>/records/<table>/<sha256 of the row's key>.json   {"table", "key", "row"}

Root's alone (0700 directories, 0600 files, under the daemon's umask), each written whole
(a temporary file, fsync, rename, fsync of the directory): a file is either the row as it was
after a committed write, or the one before it. A table opts in by its `info`:

    Table("slurm_jobs", ..., info={records.KEY: records.ALL})

- ALL: a file for every row (written after every write of the row, removed with it); at a
  sound start, files without a row go and rows without a file get one (an upgraded daemon's
  rows, a write cut between the database and the file).
- UNTIL_DROPPED: a file from the row's write until its owner `drop`s it (the control plane's
  answer to a command, until the control plane took it: acknowledged, it is never asked again);
  at a sound start files without a row, or older than a week, go.

The database stays the daemon's truth while it can be read: these files are only read back when
it is rebuilt. A write of a file that fails (a full disk) is logged and costs nothing else: the
database has the row, and only a rebuild would miss it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import Table, select
from sqlalchemy.exc import SQLAlchemyError

from stasis.atomicfile import fsync_dir, write_atomically
from stasis.daemon.db import JobDB
from stasis.errors import StasisError

log = logging.getLogger("stasis.daemon")

KEY = "stasis_records"  # the Table.info key
ALL = "all"
UNTIL_DROPPED = "until-dropped"
_MAX_FILE = 1 << 20  # a row is a few KiB (a Slurm job's command line 64 KiB at most)
_UNTIL_DROPPED_KEPT_S = 7 * 86400  # a command not leased again in a week never is

# One writer at a time: a refresh reads the row and writes its file as one step, so the last
# file written is of the last committed row (never an older read overtaking a newer one).
_lock = threading.Lock()


def policy(table: Table) -> str | None:
    value = table.info.get(KEY)
    return value if value in (ALL, UNTIL_DROPPED) else None


def _key_column(table: Table) -> str:
    (column,) = table.primary_key.columns  # the tables kept here have a one-column key
    return str(column.name)


def file_name(key: str) -> str:
    """Keys are ids of the daemon's choosing or of a validated request; hashed all the same,
    so no key is ever a path."""
    return hashlib.sha256(key.encode()).hexdigest() + ".json"


def _dir(root: Path, table: Table) -> Path:
    return root / table.name


def _write(path: Path, body: bytes, durable: bool = True) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomically(path, body, durable=durable)


def _body(table: Table, key: str, row: Mapping[Any, Any]) -> bytes:
    return json.dumps({"table": table.name, "key": key, "row": dict(row)}).encode()


class Records:
    """The files of an integration's tables; `root` is the state dir's records/ (layout)."""

    def __init__(self, db: JobDB, root: Path) -> None:
        self.db = db
        self.root = root
        self._failing: str | None = None

    def refresh(self, table: Table, key: str) -> None:
        """The file of `table`'s row `key` made what the database now holds: written, or
        removed when there is no such row. Call it after the transaction, never inside."""
        assert policy(table) is not None, table.name
        column = table.c[_key_column(table)]
        with _lock:
            try:
                with self.db.transaction() as conn:
                    row = conn.execute(select(table).where(column == key)).mappings().first()
                path = _dir(self.root, table) / file_name(key)
                if row is None:
                    _unlink(path)
                else:
                    _write(path, _body(table, key, row))
            except (OSError, StasisError) as e:
                self._failed(table, key, e)
                return
        self._failing = None

    def drop(self, table: Table, key: str) -> None:
        """Forget the file of `key` (its row stays in the database)."""
        with _lock:
            try:
                _unlink(_dir(self.root, table) / file_name(key))
            except OSError as e:
                self._failed(table, key, e)

    def _failed(self, table: Table, key: str, e: BaseException) -> None:
        said = f"{table.name}: {e}"
        if said != self._failing:  # once per cause, not once per row
            log.warning(
                "cannot keep the record of %s %s in %s (%s): the database has it, but a "
                "rebuild of a corrupt database would miss it",
                table.name,
                key,
                self.root,
                e,
            )
            self._failing = said


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    fsync_dir(path.parent)


def _files(directory: Path) -> list[Path]:
    try:
        return [
            p
            for p in directory.iterdir()
            if p.name.endswith(".json") and not p.name.startswith(".")
        ]
    except FileNotFoundError:
        return []


def _read(path: Path) -> Any:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return json.loads(os.read(fd, _MAX_FILE + 1)[:_MAX_FILE])
    finally:
        os.close(fd)


def _rows(root: Path, table: Table) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The rows kept for `table`, each checked to be of it and filed under its own key; a
    file that is not is skipped, with a line."""
    columns = {str(c.name) for c in table.columns}
    for path in sorted(_files(_dir(root, table))):
        try:
            data = _read(path)
            if (
                not isinstance(data, dict)
                or data.get("table") != table.name
                or not isinstance(data.get("row"), dict)
                or not isinstance(data.get("key"), str)
            ):
                raise ValueError("not a record of this table")
            row = {k: v for k, v in data["row"].items() if k in columns}
            if (
                str(row.get(_key_column(table))) != data["key"]
                or file_name(data["key"]) != path.name
            ):
                raise ValueError("filed under another key")
        except (OSError, ValueError) as e:
            log.warning("record %s skipped: %s", path, e)
            continue
        yield path, row


def restore(db: JobDB, root: Path, tables: Iterable[Table]) -> dict[str, int]:
    """Put the kept rows of `tables` into `db` (a rebuilt database, holding what could be
    salvaged of the corrupt one): a kept row replaces a salvaged one of the same key, written
    whole after its last committed write, where the salvaged one comes from a damaged file.
    The rows put, by table."""
    put: dict[str, int] = {}
    for table in tables:
        if policy(table) is None:
            continue
        n = 0
        for path, row in _rows(root, table):
            names = list(row)
            cols = ",".join(f'"{c}"' for c in names)
            marks = ",".join("?" for _ in names)
            sql = f'INSERT OR REPLACE INTO "{table.name}" ({cols}) VALUES ({marks})'  # noqa: S608
            try:
                with db.transaction() as conn:
                    conn.exec_driver_sql(sql, tuple(row[c] for c in names))
            except (StasisError, SQLAlchemyError) as e:
                log.warning("record %s not restored: %s", path, str(e).splitlines()[0])
                continue
            n += 1
        put[table.name] = n
    return put


def sync(db: JobDB, root: Path, tables: Iterable[Table]) -> None:
    """At a start on a sound database: the files made to match its rows (see the module's
    docstring for each policy)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    wrote = False
    now = time.time()
    with _lock:
        for table in tables:
            kind = policy(table)
            if kind is None:
                continue
            column = table.c[_key_column(table)]
            with db.transaction() as conn:
                keys = {file_name(str(k)): str(k) for k in conn.execute(select(column)).scalars()}
            directory = _dir(root, table)
            present = set()
            for path in _files(directory):
                try:
                    stale = path.name not in keys or (
                        kind == UNTIL_DROPPED and now - path.stat().st_mtime > _UNTIL_DROPPED_KEPT_S
                    )
                    if stale:
                        path.unlink()
                    else:
                        present.add(path.name)
                except OSError:
                    continue
            if kind != ALL:
                continue
            for name in keys.keys() - present:
                key = keys[name]
                with db.transaction() as conn:
                    row = conn.execute(select(table).where(column == key)).mappings().first()
                if row is not None:
                    # Many at once (a first start after an upgrade): synced together below.
                    _write(directory / name, _body(table, key, row), durable=False)
                    wrote = True
    if wrote:
        os.sync()
