"""A job database that cannot be read at the daemon's start (garbage written into it, a torn
disk) does not keep the daemon down: it is moved aside, named so an admin finds it
(`jobs.db.corrupt-<UTC time>`, beside the new one), and a new one is rebuilt from what the node
itself keeps outside the database:

- the jobs whose trees run: each job's directory holds its record (`job.json`, written before it
  started) and its tree (`pid.json`, written by its supervisor): adopted at the start, as after
  any crash (tracking.adopt_orphans);
- the dumps in flight: their journal (inflight.py) is a directory of its own, settled as always;
- the network locks of recent stop-dumps: CRIU's dump logs name the rules it left, recorded again
  for their published checkpoints so that they are still lifted on time;
- whatever rows of the old file can still be read (a file damaged in a few pages keeps most).

Finished jobs' history is what is lost. What cannot be rebuilt (a running job without a record
in its directory) is logged and keeps the daemon reporting itself not ready.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import inspect
from sqlalchemy.exc import SQLAlchemyError

from stasis.daemon.db import JobDatabaseError, JobDB, NetLockRow
from stasis.engine import netlock
from stasis.errors import StasisError
from stasis.store import Store, is_checkpoint_id

log = logging.getLogger("stasis.daemon")


def open_job_db(path: Path, busy_timeout_s: float) -> tuple[JobDB, Path | None]:
    """The daemon's database, and where a corrupt one was moved (None: it was sound)."""
    try:
        return JobDB(path, busy_timeout_s), None
    except JobDatabaseError as e:
        if not e.corrupt:
            raise
        reason = str(e.__cause__ or e).splitlines()[0]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    for suffix in ("", "-wal", "-shm"):
        try:
            os.rename(f"{path}{suffix}", f"{aside}{suffix}")
        except FileNotFoundError:
            pass
    log.error("the job database %s is corrupt (%s): moved aside as %s and rebuilt from the "
              "jobs running on this node, its dump journal and CRIU's logs; finished jobs' "
              "history is not rebuilt. Keep %s for a post-mortem, or delete it",
              path, reason, aside, aside.name)
    return JobDB(path, busy_timeout_s), aside


def salvage(old: Path, db: JobDB) -> int:
    """Copy what can still be read of `old`'s tables (the same tables exist in `db`: made by
    the core and the integrations) into `db`; the rows copied. Garbage gives none."""
    copied = 0
    try:
        src = sqlite3.connect(f"file:{old}?mode=ro", uri=True, timeout=0)
    except sqlite3.Error:
        return 0
    try:
        tables = inspect(db.engine).get_table_names()
        for table in tables:
            try:
                cursor = src.execute(f'SELECT * FROM "{table}"')  # noqa: S608 - our own names
                names = [c[0] for c in cursor.description]
                rows = cursor.fetchall()
            except sqlite3.Error:
                continue
            marks = ",".join("?" for _ in names)
            cols = ",".join(f'"{n}"' for n in names)
            insert = f'INSERT OR IGNORE INTO "{table}" ({cols}) VALUES ({marks})'  # noqa: S608
            with db.transaction() as conn:
                for row in rows:
                    try:
                        conn.exec_driver_sql(insert, tuple(row))
                        copied += 1
                    except SQLAlchemyError:
                        continue
    except (sqlite3.Error, StasisError) as e:
        log.warning("salvaging rows from %s stopped: %s", old, e)
    finally:
        src.close()
    if copied:
        log.info("salvaged %d row(s) from the corrupt job database %s", copied, old)
    return copied


def recover_netlocks(db: JobDB, store: Store, criu_logs: Path, timeout_s: int) -> int:
    """Record again the network locks of stop-dumps younger than `timeout_s` whose checkpoint
    is published (CRIU's dump log names the rules): the sweep lifts them on time again."""
    known = {row.checkpoint for row in db.netlocks()}
    now = time.time()
    found = 0
    try:
        logs = list(criu_logs.glob("dump-*.log"))
    except OSError:
        return 0
    for path in logs:
        checkpoint = path.name.removeprefix("dump-").removesuffix(".log")
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if not is_checkpoint_id(checkpoint) or checkpoint in known or now - mtime > timeout_s:
            continue
        rules = netlock.rules_from_log(path)
        if not rules:
            continue
        try:
            if not store.exists(checkpoint):
                continue
        except StasisError:
            continue  # cannot tell: the rules stay listed unmatched by `stasis check`
        db.add_netlock(NetLockRow(checkpoint=checkpoint, job="", created=mtime,
                                  rules=[list(r.argv) for r in rules]))
        found += 1
    return found
