"""What happened, kept for people to read (the `events` table): nodes joining and lost,
commands answered or failed, migrations retried, policies run and edited. Written inside the
transaction that made it happen, read oldest first."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import cast

from sqlalchemy import Connection, insert, select

from stasis.controlplane import wire
from stasis.controlplane.database import Database
from stasis.controlplane.schema import events


def record(
    conn: Connection, cluster_id: str | None, node: str | None, kind: str, message: str
) -> None:
    """An event, in the transaction of `conn` (it is kept only if that commits)."""
    conn.execute(
        insert(events).values(
            at=datetime.now(UTC).isoformat(timespec="microseconds"),
            cluster_id=cluster_id,
            node=node,
            kind=kind,
            message=message[:2000],
        )
    )


def add(db: Database, cluster_id: str | None, node: str | None, kind: str, message: str) -> None:
    """An event in a transaction of its own."""
    with db.transaction() as conn:
        record(conn, cluster_id, node, kind, message)


def clusters_of(db: Database, kind: str, since: str) -> list[str | None]:
    """The cluster (None: the admin's view) of each event of `kind` since `since` (ISO 8601)."""
    with db.transaction() as conn:
        return [
            r.cluster_id
            for r in conn.execute(
                select(events.c.cluster_id).where(events.c.kind == kind, events.c.at >= since)
            )
        ]


def listed(db: Database, cluster_id: str | None, limit: int = 200) -> list[wire.Event]:
    """The latest `limit` events, oldest first: every cluster's (None) or one's."""
    q = select(events).order_by(events.c.id.desc()).limit(limit)
    if cluster_id is not None:
        q = q.where(events.c.cluster_id == cluster_id)
    with db.transaction() as conn:
        rows = [cast(wire.Event, dict(r)) for r in conn.execute(q).mappings().all()]
    return rows[::-1]
