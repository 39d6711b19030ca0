"""What the nodes report of their work: the checkpoints they took and the restores they made
(the `checkpoints` and `restores` tables), the verdicts of `stasis verify` kept with those
checkpoints, and the figures read from them (totals, node-hours kept). Its tables' SQL is here;
a node's heartbeat (stasis.controlplane.nodes) and a command's answer
(stasis.controlplane.commandqueue) write here through the public methods that take their
transaction's connection."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Connection, Row, and_, func, insert, select, update

from stasis.controlplane import events as event_log
from stasis.controlplane import verdicts, wire
from stasis.controlplane.access import Access, Principal
from stasis.controlplane.schema import checkpoints, restores
from stasis.errors import UsageError


def human_size(n: float | None) -> str:
    """Bytes as people read them: 512 B, 3.1 MiB."""
    x = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


class Reports:
    """The checkpoints and restores of the nodes (cluster names: stasis.controlplane.access)."""

    def __init__(self, access: Access) -> None:
        self.access = access
        self.db = access.db

    # -- written in the transaction of a heartbeat or an answer ----------------------------------

    def record_activity(
        self, conn: Connection, cluster_id: str, node: str, a: dict[str, Any]
    ) -> None:
        """One checkpoint or restore a node reports; a report sent again changes nothing."""
        if a["kind"] == "checkpoint":
            if (
                conn.execute(
                    select(checkpoints.c.id).where(checkpoints.c.id == a["checkpoint"])
                ).first()
                is not None
            ):
                return
            conn.execute(
                insert(checkpoints).values(
                    id=a["checkpoint"],
                    cluster_id=cluster_id,
                    node=node,
                    job=a["job"],
                    label=a["label"],
                    user=a["user"],
                    size_bytes=a["size_bytes"],
                    stored_size_bytes=a["stored_size_bytes"],
                    duration_s=a["duration_s"],
                    frozen_s=a["frozen_s"],
                    work_s=a["work_s"],
                    leave_running=a["leave_running"],
                    reason=a["reason"],
                    store=a["store"],
                    created=a["at"],
                    deleted=None,
                )
            )
            event_log.record(
                conn,
                cluster_id,
                node,
                "checkpoint",
                f"checkpoint {a['checkpoint']} of job {a['job']} (label {a['label']}, "
                f"user {a['user']}, {a['reason']}): {human_size(a['size_bytes'])} in "
                f"{a['duration_s']:.2f} s, "
                + ("job went on" if a["leave_running"] else "job stopped"),
            )
            return
        if (
            conn.execute(
                select(restores.c.id).where(
                    restores.c.cluster_id == cluster_id,
                    restores.c.node == node,
                    restores.c.job == a["job"],
                    restores.c.checkpoint == a["checkpoint"],
                )
            ).first()
            is not None
        ):
            return
        conn.execute(
            insert(restores).values(
                cluster_id=cluster_id,
                node=node,
                checkpoint=a["checkpoint"],
                job=a["job"],
                label=a["label"],
                user=a["user"],
                work_s=a["work_s"],
                duration_s=a["duration_s"],
                reason=a["reason"],
                at=a["at"],
            )
        )
        event_log.record(
            conn,
            cluster_id,
            node,
            "restore",
            f"job {a['job']} (label {a['label']}, user {a['user']}) restored from "
            f"checkpoint {a['checkpoint']}: {a['work_s'] / 3600:.3f} node-hours of "
            "work kept",
        )

    def record_verdict(
        self, conn: Connection, cluster_id: str, node: str, v: verdicts.VerdictReport
    ) -> bool:
        """A verdict of `stasis verify` node `node` reports, kept with its checkpoint if that
        is of the node's own cluster and holds no newer verdict (stasis.controlplane.verdicts);
        whether it was."""
        at = v.at.timestamp()
        kept = conn.execute(
            update(checkpoints)
            .where(
                checkpoints.c.id == v.checkpoint,
                checkpoints.c.cluster_id == cluster_id,
                checkpoints.c.verified_at.is_(None) | (checkpoints.c.verified_at < at),
            )
            .values(
                verified_ok=v.ok,
                verify_reason="" if v.ok else (v.reason or "no reason given"),
                # The node that spoke (its credential says so), not the host name it wrote.
                verified_by=node[:200],
                verified_at=at,
                verify_duration_s=v.duration_s,
                verify_processes=v.processes,
            )
        ).rowcount
        if kept:
            event_log.record(
                conn,
                cluster_id,
                node,
                "verify" if v.ok else "verify-failed",
                verdicts.event(v.checkpoint, node, v),
            )
            return True
        theirs = conn.execute(
            select(checkpoints.c.cluster_id).where(checkpoints.c.id == v.checkpoint)
        ).scalar()
        if theirs is not None and theirs != cluster_id:
            # Said to the admin only (no cluster's view): the node is told nothing, so it
            # learns nothing of another cluster's checkpoints.
            event_log.record(
                conn,
                None,
                node,
                "verify-refused",
                f"node {node} of cluster {cluster_id} reported a verdict on checkpoint "
                f"{v.checkpoint}, which is cluster {theirs}'s: ignored",
            )
        return False

    def keep_answered_verdict(
        self,
        conn: Connection,
        command_id: str,
        cluster_id: str,
        node: str,
        asked: object,
        verdict: object,
    ) -> None:
        """The verdict a verify command's node answered with, kept with the checkpoint the
        command named (`asked`): a verdict on any other checkpoint is refused (the node
        answers the command it was given)."""
        from pydantic import ValidationError

        try:
            v = verdicts.VerdictReport.model_validate(verdict)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "verdict"
            raise UsageError(
                f"bad verdict in the answer to command {command_id}: {where}: {first['msg']}"
            ) from None
        if v.checkpoint != asked:
            raise UsageError(
                f"command {command_id} asked to verify checkpoint {asked}, not "
                f"{v.checkpoint}: answer with its verdict"
            )
        self.record_verdict(conn, cluster_id, node, v)

    def mark_deleted(self, conn: Connection, cluster_id: str, ids: list[str]) -> None:
        """The checkpoints of `ids` (of cluster `cluster_id`) deleted from their store."""
        conn.execute(
            update(checkpoints)
            .where(checkpoints.c.id.in_(ids[:10_000]), checkpoints.c.cluster_id == cluster_id)
            .values(deleted=time.time())
        )

    def newest_known(self, conn: Connection, cluster_id: str, label: str, user: object) -> str:
        """For a checkpoint command failed with its node: the newest checkpoint of the job's
        label that its nodes reported, to restore by hand (a clause to add to the failure)."""
        live = (
            checkpoints.c.cluster_id == cluster_id,
            checkpoints.c.label == label,
            checkpoints.c.user == user,
            checkpoints.c.deleted.is_(None),
        )
        newest = conn.execute(
            select(checkpoints.c.id, checkpoints.c.node, checkpoints.c.verified_ok)
            .where(*live)
            .order_by(checkpoints.c.created.desc())
            .limit(1)
        ).first()
        if newest is None:
            return f"; no checkpoint of label {label} is known here"
        said = (
            f"; the newest checkpoint of label {label} known here is {newest.id} "
            f"(node {newest.node}"
        )
        if newest.verified_ok:
            return said + ", verified): `stasis restore {newest.id}` on a node restores it"
        # An older one known to restore (`stasis verify`) is worth naming beside it.
        good = conn.execute(
            select(checkpoints.c.id, checkpoints.c.node)
            .where(*live, checkpoints.c.verified_ok.is_(True))
            .order_by(checkpoints.c.created.desc())
            .limit(1)
        ).first()
        state = "not verified" if newest.verified_ok is None else "failed verification"
        return (
            said
            + f", {state}): `stasis restore {newest.id}` on a node restores it"
            + (f"; the newest verified one is {good.id} (node {good.node})" if good else "")
        )

    # -- read -------------------------------------------------------------------------------

    def checkpoint(self, checkpoint_id: str) -> dict[str, Any] | None:
        """Checkpoint `checkpoint_id`'s row (a deleted one too), None if never reported."""
        with self.db.transaction() as conn:
            row = (
                conn.execute(select(checkpoints).where(checkpoints.c.id == checkpoint_id))
                .mappings()
                .first()
            )
        return None if row is None else dict(row)

    def last_checkpoints(self, by: Principal) -> dict[tuple[Any, ...], dict[str, Any]]:
        """The newest live checkpoint of each (cluster, user, label)."""
        newest = (
            select(
                checkpoints.c.cluster_id,
                checkpoints.c.user,
                checkpoints.c.label,
                func.max(checkpoints.c.created).label("created"),
            )
            .where(checkpoints.c.deleted.is_(None))
            .group_by(checkpoints.c.cluster_id, checkpoints.c.user, checkpoints.c.label)
        )
        if by.kind != "admin":
            newest = newest.where(checkpoints.c.cluster_id == by.cluster_id)
        sub = newest.subquery()
        q = select(
            checkpoints.c.id,
            checkpoints.c.cluster_id,
            checkpoints.c.user,
            checkpoints.c.label,
            checkpoints.c.created,
            checkpoints.c.verified_ok,
            checkpoints.c.verify_reason,
            checkpoints.c.verified_by,
            checkpoints.c.verified_at,
            checkpoints.c.verify_duration_s,
            checkpoints.c.verify_processes,
        ).join(
            sub,
            and_(
                checkpoints.c.cluster_id == sub.c.cluster_id,
                checkpoints.c.user == sub.c.user,
                checkpoints.c.label == sub.c.label,
                checkpoints.c.created == sub.c.created,
            ),
        )
        with self.db.transaction() as conn:
            rows = conn.execute(q).mappings().all()
        return {(r["cluster_id"], r["user"], r["label"]): dict(r) for r in rows}

    def list_checkpoints(
        self, by: Principal, limit: int = 500, deleted: bool = False
    ) -> list[wire.Checkpoint]:
        """The checkpoints the nodes reported, newest first (deleted ones only if asked)."""
        names = self.access.cluster_names()
        q = select(checkpoints).where(checkpoints.c.cluster_id.in_(names))
        if by.kind != "admin":
            q = q.where(checkpoints.c.cluster_id == by.cluster_id)
        if not deleted:
            q = q.where(checkpoints.c.deleted.is_(None))
        with self.db.transaction() as conn:
            rows = (
                conn.execute(
                    q.order_by(checkpoints.c.created.desc(), checkpoints.c.id).limit(limit)
                )
                .mappings()
                .all()
            )
        now = time.time()
        return [
            cast(
                wire.Checkpoint,
                {
                    **verdicts.shown({**r, "cluster": names[r["cluster_id"]]}),
                    "age_s": round(now - r["created"], 1),
                },
            )
            for r in rows
        ]

    def live_checkpoints(self) -> list[Row[Any]]:
        """Every checkpoint not deleted, newest first: id, cluster_id, node, label, user and
        verified_ok (the verify policies pick from these)."""
        with self.db.transaction() as conn:
            return list(
                conn.execute(
                    select(
                        checkpoints.c.id,
                        checkpoints.c.cluster_id,
                        checkpoints.c.node,
                        checkpoints.c.label,
                        checkpoints.c.user,
                        checkpoints.c.verified_ok,
                    )
                    .where(checkpoints.c.deleted.is_(None))
                    .order_by(checkpoints.c.created.desc(), checkpoints.c.id)
                ).all()
            )

    def checkpoint_totals(self) -> list[dict[str, Any]]:
        """Per cluster: checkpoints reported (deleted ones too), their bytes and seconds."""
        names = self.access.cluster_names()
        q = select(
            checkpoints.c.cluster_id,
            func.count().label("count"),
            func.coalesce(func.sum(checkpoints.c.size_bytes), 0).label("bytes"),
            func.coalesce(func.sum(checkpoints.c.duration_s), 0).label("seconds"),
            func.coalesce(func.sum(checkpoints.c.frozen_s), 0).label("frozen"),
        ).group_by(checkpoints.c.cluster_id)
        with self.db.transaction() as conn:
            rows = conn.execute(q).mappings().all()
        return [
            {"cluster": names[r["cluster_id"]], **{k: v for k, v in r.items() if k != "cluster_id"}}
            for r in rows
            if r["cluster_id"] in names
        ]

    def verdict_totals(self) -> list[dict[str, Any]]:
        """Per cluster: live checkpoints by their verdict (ok, failed, none)."""
        names = self.access.cluster_names()
        q = (
            select(checkpoints.c.cluster_id, checkpoints.c.verified_ok, func.count().label("count"))
            .where(checkpoints.c.deleted.is_(None))
            .group_by(checkpoints.c.cluster_id, checkpoints.c.verified_ok)
        )
        with self.db.transaction() as conn:
            rows = conn.execute(q).all()
        return [
            {
                "cluster": names[r.cluster_id],
                "count": r.count,
                "verdict": "none" if r.verified_ok is None else "ok" if r.verified_ok else "failed",
            }
            for r in rows
            if r.cluster_id in names
        ]

    def frozen(self, by: Principal) -> list[tuple[str, float, float]]:
        """(cluster id, frozen seconds, created) of each checkpoint reported (deleted ones too)
        of the clusters `by` may see: what checkpointing cost (stasis.controlplane.savings)."""
        q = select(checkpoints.c.cluster_id, checkpoints.c.frozen_s, checkpoints.c.created)
        if by.kind != "admin":
            q = q.where(checkpoints.c.cluster_id == by.cluster_id)
        with self.db.transaction() as conn:
            return [(r.cluster_id, r.frozen_s, r.created) for r in conn.execute(q).all()]

    def stopped_since(self, start: float) -> list[tuple[str, str]]:
        """(cluster id, reason) of each checkpoint that stopped its job, taken since `start`
        (unix seconds; deleted ones too)."""
        q = select(checkpoints.c.cluster_id, checkpoints.c.reason).where(
            checkpoints.c.leave_running.is_(False), checkpoints.c.created >= start
        )
        with self.db.transaction() as conn:
            return [(r.cluster_id, r.reason) for r in conn.execute(q)]

    def frozen_since(self, start: float) -> list[tuple[str, str, str, float]]:
        """(cluster id, user, label, frozen seconds) of each checkpoint taken since `start`,
        newest first (deleted ones too)."""
        q = (
            select(
                checkpoints.c.cluster_id,
                checkpoints.c.user,
                checkpoints.c.label,
                checkpoints.c.frozen_s,
            )
            .where(checkpoints.c.created >= start)
            .order_by(checkpoints.c.created.desc(), checkpoints.c.id)
        )
        with self.db.transaction() as conn:
            return [(r.cluster_id, r.user, r.label, r.frozen_s) for r in conn.execute(q)]

    def savings(self, by: Principal) -> wire.Kept:
        """Node-hours of work kept by restores instead of reruns: in all, per cluster, per
        user, per day (UTC). A restore keeps the seconds of work its checkpoint held; every
        job counts as one node (the nodes report single-node jobs)."""
        names = self.access.cluster_names()
        q = select(restores.c.cluster_id, restores.c.user, restores.c.work_s, restores.c.at)
        if by.kind != "admin":
            q = q.where(restores.c.cluster_id == by.cluster_id)
        with self.db.transaction() as conn:
            rows = [
                r
                for r in conn.execute(q.order_by(restores.c.at)).mappings().all()
                if r["cluster_id"] in names
            ]
        per_cluster: dict[str, float] = {}
        per_user: dict[str, float] = {}
        per_day: dict[str, float] = {}
        for r in rows:
            hours = float(r["work_s"]) / 3600
            cluster = names[r["cluster_id"]]
            per_cluster[cluster] = per_cluster.get(cluster, 0.0) + hours
            per_user[r["user"]] = per_user.get(r["user"], 0.0) + hours
            day = datetime.fromtimestamp(r["at"], UTC).date().isoformat()
            per_day[day] = per_day.get(day, 0.0) + hours

        def most_first(d: dict[str, float]) -> list[tuple[str, float]]:
            return [(k, round(v, 4)) for k, v in sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))]

        return {
            "node_hours": round(sum(per_cluster.values()), 4),
            "restores": len(rows),
            "clusters": [{"cluster": k, "node_hours": v} for k, v in most_first(per_cluster)],
            "users": [{"user": k, "node_hours": v} for k, v in most_first(per_user)],
            "days": [{"day": k, "node_hours": round(v, 4)} for k, v in sorted(per_day.items())],
        }
