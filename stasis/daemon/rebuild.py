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
- the integrations' rows whose loss would lose work or do it twice, each kept as a file too
  (records.py, <state_dir>/records/), put back whole:
    slurm_jobs             every registration (which Slurm jobs opted in, their label, the
                           stop under way): a preempted job is still checkpointed, a requeued
                           one still resumes, a stop a dead daemon began is still finished;
    k8s_containers         every container registered (its runc root, bundle, label, interval,
                           what it was restored from): intervals go on, its checkpoints keep
                           their parent;
    controlplane_intent    every command begun and not answered: leased again, it is looked
                           up (the checkpoint taken, the job restored), not carried out again;
    controlplane_restored  every migration restored here (and the watermark under which older
                           seals are refused): a seal given again restores nothing;
    controlplane_done      the answers the control plane has not taken yet (acknowledged, a
                           command is never leased again: its file goes);
- whatever rows of the old file can still be read (a file damaged in a few pages keeps most);
  a row kept as a file replaces a salvaged row of the same key (whole, written after its last
  commit, where the salvaged one comes from a damaged file).

Deliberately not rebuilt (they only inform, nothing is done twice or lost without them):
finished jobs' history, the control plane's outbox (checkpoints and verdicts not yet reported:
the control plane hears of the checkpoints again from the store's listing in the node's
heartbeats, not of those events), the answers the control plane already took, and Slurm's step
records (mirrors: written again by the steps still running). What cannot be rebuilt (a running
job without a record in its directory) is logged and keeps the daemon reporting itself not
ready.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import Table, inspect
from sqlalchemy.exc import SQLAlchemyError

from stasis.daemon import records
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
    log.error(
        "the job database %s is corrupt (%s): moved aside as %s and rebuilt from the "
        "jobs running on this node, its dump journal, CRIU's logs and the integrations' "
        "records; finished jobs' history is not rebuilt. Keep %s for a post-mortem, or "
        "delete it",
        path,
        reason,
        aside,
        aside.name,
    )
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
            if not store.catalog.exists(checkpoint):
                continue
        except StasisError:
            continue  # cannot tell: the rules stay listed unmatched by `stasis check`
        db.add_netlock(
            NetLockRow(
                checkpoint=checkpoint, job="", created=mtime, rules=[list(r.argv) for r in rules]
            )
        )
        found += 1
    return found


def restore_records(db: JobDB, root: Path, tables: Sequence[Table]) -> None:
    """The integrations' kept rows (records.py) put back into a database rebuilt (after
    `salvage`, before the integrations read their tables)."""
    try:
        put = records.restore(db, root, tables)
    except (StasisError, OSError) as e:
        log.error("the integrations' records in %s could not be restored: %s", root, e)
        return
    if any(put.values()):
        log.info(
            "restored from %s: %s",
            root,
            ", ".join(f"{n} row(s) of {t}" for t, n in sorted(put.items()) if n),
        )


def match_records(db: JobDB, root: Path, tables: Sequence[Table]) -> None:
    """The integrations' files matched to their tables' rows, at every start (after the
    integrations' own upgrades of their tables). A database that cannot be read now (locked)
    leaves the files as they are: the next start matches them."""
    try:
        records.sync(db, root, tables)
    except (StasisError, OSError) as e:
        log.warning(
            "the integrations' records in %s are not matched to the database now: %s", root, e
        )
