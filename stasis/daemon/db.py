"""The daemon's database: one SQLite file under the state directory, holding the job table, the
network locks this node holds, and the tables integrations add (`create_tables`, `transaction`).

It is what lets a restarted daemon find the jobs it started: each row keeps the job's pid and its
start time (so a recycled pid is never mistaken for the job) and the job's own directory, where
the job's supervisor writes the exit status even while no daemon runs. Of a job's --env it keeps
the names only: the values may be secrets, and nothing needs them once the job started (a
restore gets the environment back from the job's memory).

Every failure of the database (locked by another process past the busy timeout, corrupt, a full
disk) is raised as `JobDatabaseError`: one line naming the file and what to do, never
SQLAlchemy's text (its SQL and parameters are no user's business).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, cast, get_args, get_origin, get_type_hints

from sqlalchemy import (
    Boolean,
    Column,
    Float,
    Integer,
    MetaData,
    Table,
    Text,
    create_engine,
    delete,
    event,
    insert,
    select,
    update,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from stasis import wire
from stasis.errors import StasisError

_metadata = MetaData()

# How long a write waits for another process's lock (an admin's sqlite3, a backup) before it
# fails: SQLite's own default is to fail at once.
DEFAULT_BUSY_TIMEOUT_S = 5.0


class JobDatabaseError(StasisError):
    """The daemon's job database could not be read or written (locked, corrupt, disk full)."""

    http_status = 503  # the daemon is unable now, not the request wrong

    def __init__(self, message: str, corrupt: bool = False) -> None:
        super().__init__(message)
        self.corrupt = corrupt


def _db_error(path: Path, e: BaseException) -> JobDatabaseError:
    orig = getattr(e, "orig", None) or e
    text = str(orig).splitlines()[0] if str(orig) else type(orig).__name__
    lowered = text.lower()
    if "locked" in lowered or "busy" in lowered:
        return JobDatabaseError(
            f"the daemon's job database {path} is locked by another process: the daemon "
            "retries; if this lasts, end whatever holds it (fuser -v "
            f"{path})"
        )
    corrupt = isinstance(orig, sqlite3.DatabaseError) and (
        "malformed" in lowered or "not a database" in lowered or "corrupt" in lowered
    )
    if corrupt:
        return JobDatabaseError(
            f"the daemon's job database {path} is corrupt ({text}): restart the daemon, which "
            "moves it aside and rebuilds it from what runs on this node",
            corrupt=True,
        )
    return JobDatabaseError(
        f"the daemon's job database {path} failed: {text} (is the disk " "full or read-only?)"
    )


def now() -> str:
    """A record's time: UTC, to the millisecond, ISO 8601."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


@dataclass
class JobRow:
    """A job, as the database keeps it: the one definition of a job record. The table is made
    from these fields (`_columns`), and `wire()` is what the API answers of it (stasis/wire.py's
    Job): everything but the supervisor's bookkeeping and the names of --env variables."""

    id: str
    pid: int | None
    pid_start: int | None
    shim_pid: int | None
    state: str
    label: str
    exit_code: int | None
    command: list[str]
    cwd: str
    env: list[str]  # the names of the job's --env variables, never their values
    user: str
    uid: int
    gid: int
    log: str
    checkpoint: str | None  # the checkpoint it was restored from
    created: str
    job_dir: str
    private_tmp: bool = False  # its own /tmp and /var/tmp (engine/privatetmp.py)

    @classmethod
    def before_start(
        cls,
        job_id: str,
        state: Literal["running", "restoring"],
        *,
        label: str,
        command: list[str],
        cwd: str,
        log: str,
        owner: tuple[str, int, int],
        private_tmp: bool,
        env: list[str] | None = None,
        checkpoint: str | None = None,
    ) -> JobRow:
        """The record of a job whose process does not exist yet: one being started
        ("running") or restored ("restoring"). No pid, supervisor, exit code or directory yet:
        `Started.row` adds them once it runs. `owner`: its user's name, uid and gid."""
        user, uid, gid = owner
        return cls(
            id=job_id,
            pid=None,
            pid_start=None,
            shim_pid=None,
            state=state,
            label=label,
            exit_code=None,
            command=command,
            cwd=cwd,
            env=env or [],
            user=user,
            uid=uid,
            gid=gid,
            log=log,
            checkpoint=checkpoint,
            created=now(),
            job_dir="",
            private_tmp=private_tmp,
        )

    def wire(self) -> wire.Job:
        return wire.Job(
            job=self.id,
            pid=self.pid,
            state=cast(wire.JobState, self.state),
            label=self.label,
            exit_code=self.exit_code,
            command=self.command,
            user=self.user,
            uid=self.uid,
            cwd=self.cwd,
            log=self.log,
            checkpoint=self.checkpoint,
            created=self.created,
            private_tmp=self.private_tmp,
            frozen=False,  # the daemon's PartFreezes knows (JobManager marks it)
        )


@dataclass
class NetLockRow:
    """A network lock this node holds (stasis/daemon/netlocks.py): the iptables commands that
    put each of CRIU's rules in for a checkpoint, until they are taken out."""

    checkpoint: str
    job: str
    created: float  # seconds since the epoch
    rules: list[list[str]]


def _columns(row: type[Any], primary_key: str) -> list[Column[Any]]:
    """The table's columns, from the row's fields: lists are JSON text, `X | None` nullable."""
    kinds: dict[Any, Any] = {int: Integer, str: Text, float: Float, bool: Boolean}
    columns: list[Column[Any]] = []
    for name, hint in get_type_hints(row).items():
        args = [a for a in get_args(hint) if a is not type(None)]
        nullable = type(None) in get_args(hint)
        base = args[0] if nullable and len(args) == 1 else hint
        kind = Text if get_origin(base) in (list, dict) else kinds[base]
        # A flag added later (private_tmp): rows of an older database read as False.
        default = "0" if base is bool else None
        columns.append(
            Column(
                name,
                kind,
                primary_key=name == primary_key,
                nullable=nullable,
                server_default=default,
            )
        )
    return columns


def _json_fields(row: type[Any]) -> tuple[str, ...]:
    return tuple(
        name for name, hint in get_type_hints(row).items() if get_origin(hint) in (list, dict)
    )


jobs_table = Table("jobs", _metadata, *_columns(JobRow, "id"))
netlocks_table = Table("netlocks", _metadata, *_columns(NetLockRow, "checkpoint"))


_JSON_COLUMNS = _json_fields(JobRow)
# `restoring`: recorded before its tree may resume; the poll makes it `restored` or removes it.
_LIVE = ("running", "restored", "restoring")


def _add_flags(engine: Engine) -> None:
    """The flag columns an older database lacks (create_all adds tables, not columns)."""
    with engine.begin() as conn:
        have = {r[1] for r in conn.exec_driver_sql("PRAGMA table_info(jobs)").all()}
        for column in jobs_table.columns:
            if column.name not in have and column.server_default is not None:
                conn.exec_driver_sql(
                    f"ALTER TABLE jobs ADD COLUMN {column.name} BOOLEAN NOT NULL DEFAULT 0"
                )


def _to_row(values: Any) -> JobRow:
    data = dict(values._mapping)
    for key in _JSON_COLUMNS:
        data[key] = json.loads(data[key])
    if isinstance(data["env"], dict):  # a row written before values were dropped
        data["env"] = sorted(data["env"])
    return JobRow(**data)


class JobDB:
    """Thread-safe access to the jobs table (the API runs blocking work in threads)."""

    def __init__(self, path: Path, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> None:
        self.path = path
        self.engine: Engine = create_engine(
            f"sqlite:///{path}", connect_args={"timeout": busy_timeout_s}
        )
        event.listen(self.engine, "connect", _sqlite_pragmas)
        self._lock = threading.Lock()
        with self._guarded():
            _metadata.create_all(self.engine)
            _add_flags(self.engine)
            # A file that is not a database passes create_all only once the tables exist.
            with self.engine.connect() as conn:
                check = conn.exec_driver_sql("PRAGMA quick_check").first()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(
                    f"database disk image is malformed ({check[0] if check else 'no answer'})"
                )
        self._forget_env_values()

    @contextmanager
    def _guarded(self) -> Iterator[None]:
        """SQLAlchemy's and sqlite3's errors as one readable JobDatabaseError."""
        try:
            yield
        except (SQLAlchemyError, sqlite3.Error) as e:
            raise _db_error(self.path, e) from e

    def _forget_env_values(self) -> None:
        """Rows written by an older stasis kept --env values: keep their names only (overwritten
        in the file too: secure_delete), then empty the WAL that held the old pages."""
        with self._lock, self._guarded(), self.engine.begin() as conn:
            old = select(jobs_table.c.id, jobs_table.c.env).where(jobs_table.c.env.like("{%"))
            for job_id, env in conn.execute(old).all():
                names = json.loads(env)
                if isinstance(names, dict):
                    conn.execute(
                        update(jobs_table)
                        .where(jobs_table.c.id == job_id)
                        .values(env=json.dumps(sorted(names)))
                    )
        with self._lock, self._guarded(), self.engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")

    def probe(self) -> None:
        """One read: JobDatabaseError when the database cannot even be read."""
        with self._lock, self._guarded(), self.engine.connect() as conn:
            conn.execute(select(jobs_table.c.id).limit(1)).all()

    # -- for integrations: tables of their own in the same database -----------------------

    def create_tables(self, tables: Sequence[Table]) -> None:
        with self._lock, self._guarded():
            for table in tables:
                table.create(self.engine, checkfirst=True)

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """One transaction, serialised with every other use of the database."""
        with self._lock, self._guarded(), self.engine.begin() as conn:
            yield conn

    # -- jobs ---------------------------------------------------------------------------------

    def add(self, row: JobRow) -> None:
        data = {f.name: getattr(row, f.name) for f in fields(row)}
        for key in _JSON_COLUMNS:
            data[key] = json.dumps(data[key])
        with self._lock, self._guarded(), self.engine.begin() as conn:
            conn.execute(insert(jobs_table).values(**data))

    def get(self, job_id: str) -> JobRow | None:
        with self._lock, self._guarded(), self.engine.connect() as conn:
            found = conn.execute(select(jobs_table).where(jobs_table.c.id == job_id)).first()
        return _to_row(found) if found else None

    def all(self) -> list[JobRow]:
        with self._lock, self._guarded(), self.engine.connect() as conn:
            rows = conn.execute(select(jobs_table).order_by(jobs_table.c.created)).all()
        return [_to_row(r) for r in rows]

    def live(self) -> list[JobRow]:
        with self._lock, self._guarded(), self.engine.connect() as conn:
            rows = conn.execute(select(jobs_table).where(jobs_table.c.state.in_(_LIVE))).all()
        return [_to_row(r) for r in rows]

    def finished(self) -> list[tuple[str, str, str, int | None]]:
        """(id, created, job_dir, shim_pid) of every job that is not live, newest first."""
        with self._lock, self._guarded(), self.engine.connect() as conn:
            rows = conn.execute(
                select(
                    jobs_table.c.id,
                    jobs_table.c.created,
                    jobs_table.c.job_dir,
                    jobs_table.c.shim_pid,
                )
                .where(jobs_table.c.state.not_in(_LIVE))
                .order_by(jobs_table.c.created.desc())
            ).all()
        return [(r.id, r.created, r.job_dir, r.shim_pid) for r in rows]

    def remove_finished(self, job_ids: list[str]) -> int:
        """Delete the rows of `job_ids` that are not live; return how many went."""
        removed = 0
        with self._lock, self._guarded(), self.engine.begin() as conn:
            # In chunks: SQLite limits the parameters of one statement.
            for start in range(0, len(job_ids), 500):
                result = conn.execute(
                    delete(jobs_table)
                    .where(jobs_table.c.id.in_(job_ids[start : start + 500]))
                    .where(jobs_table.c.state.not_in(_LIVE))
                )
                removed += result.rowcount
        return removed

    def remove_unstarted(self, job_id: str) -> bool:
        """Delete the row of a restore that never had a tree (still `restoring`)."""
        with self._lock, self._guarded(), self.engine.begin() as conn:
            result = conn.execute(
                delete(jobs_table)
                .where(jobs_table.c.id == job_id)
                .where(jobs_table.c.state == "restoring")
            )
        return bool(result.rowcount)

    def set(self, job_id: str, **values: Any) -> None:
        with self._lock, self._guarded(), self.engine.begin() as conn:
            conn.execute(update(jobs_table).where(jobs_table.c.id == job_id).values(**values))

    def finish(self, job_id: str, state: str, exit_code: int | None) -> bool:
        """Move a live job to `state`; False when it was no longer live (someone else won)."""
        with self._lock, self._guarded(), self.engine.begin() as conn:
            result = conn.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id)
                .where(jobs_table.c.state.in_(_LIVE))
                .values(state=state, exit_code=exit_code)
            )
        return bool(result.rowcount)

    # -- network locks --------------------------------------------------------------------

    def add_netlock(self, row: NetLockRow) -> None:
        with self._lock, self._guarded(), self.engine.begin() as conn:
            conn.execute(
                delete(netlocks_table).where(netlocks_table.c.checkpoint == row.checkpoint)
            )
            conn.execute(
                insert(netlocks_table).values(
                    checkpoint=row.checkpoint,
                    job=row.job,
                    created=row.created,
                    rules=json.dumps(row.rules),
                )
            )

    def netlocks(self) -> list[NetLockRow]:
        with self._lock, self._guarded(), self.engine.connect() as conn:
            rows = conn.execute(select(netlocks_table).order_by(netlocks_table.c.created)).all()
        return [
            NetLockRow(
                checkpoint=r.checkpoint, job=r.job, created=r.created, rules=json.loads(r.rules)
            )
            for r in rows
        ]

    def remove_netlock(self, checkpoint_id: str) -> bool:
        with self._lock, self._guarded(), self.engine.begin() as conn:
            result = conn.execute(
                delete(netlocks_table).where(netlocks_table.c.checkpoint == checkpoint_id)
            )
        return bool(result.rowcount)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    # Deleted or rewritten content is zeroed, not left in free pages for whoever reads the file.
    cursor.execute("PRAGMA secure_delete=ON")
    cursor.close()
