"""What the control plane knows of its nodes: their joining and credentials, heartbeats, the
jobs and checkpoints they report, and the commands given to them (queued, leased, renewed,
committed, answered, recovered). Its tables' SQL is here; tokens and clusters are
stasis.controlplane.access's, the database stasis.controlplane.database's."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, case, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from stasis.controlplane import events as event_log
from stasis.controlplane import migration, verdicts, wire
from stasis.controlplane.access import (
    NODE_PREFIX,
    Access,
    Principal,
    iso_now,
    stamp,
    token_sha,
    validate_name,
)
from stasis.controlplane.commands import Args, CheckpointArgs, Command, kind_of
from stasis.controlplane.commands import Kind as CommandKind
from stasis.controlplane.database import Database
from stasis.controlplane.schema import (
    checkpoints,
    clusters,
    commands,
    node_credentials,
    nodes,
    restores,
)
from stasis.controlplane.verdicts import CHECKPOINT_ID as CHECKPOINT_ID
from stasis.errors import (
    ConflictError,
    NotFoundError,
    PermissionDeniedError,
    UsageError,
)

# What nodes may report as ids (job ids, users, labels): checked before they reach a form, a
# path, a log or a command. Daemon job ids, Slurm ids (123, 123_4), container ids; users are
# login names or "k8s:NAMESPACE"; labels are the store's (stasis.store.manifest).
JOB_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$"
USER = r"^[A-Za-z0-9._][A-Za-z0-9._:@-]{0,99}$"
LABEL = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# A command leased this many times without an answer (its daemon dies carrying it out, each
# time) is failed rather than given out for ever.
MAX_LEASES = 5


class _Raced(Exception):
    """A command's row changed between reading and failing it."""


class Registry(Access):
    """The nodes, the jobs and checkpoints they report, and their commands (on the tokens and
    clusters of stasis.controlplane.access; policies, sessions, events and the migration
    workflow in modules of their own)."""

    def __init__(self, db: str) -> None:
        super().__init__(Database(db))
        self.url = self.db.url
        # Nodes are judged lost (recover) by their silence since this control plane started:
        # while it was down, nobody could be heard.
        self.started = int(time.time())
        self._answered: dict[
            CommandKind,
            Callable[[Any, dict[str, Any], bool, dict[str, Any], float], dict[str, Any]],
        ] = {
            "checkpoint": self._checkpoint_answered,
            "restore": self._restore_answered,
            "verify": self._verify_answered,
            "retain": self._retain_answered,
            "drain": self._drain_answered,
        }

    def close(self) -> None:
        self.db.close()

    # -- nodes --------------------------------------------------------------------------------

    def register_node(self, by: Principal, report: dict[str, Any]) -> dict[str, Any]:
        """A node's report of itself. With the cluster's token: the node joins, and gets its
        own credential (`node_token`, shown once), unless its name has one already (refused:
        an admin resets it). With that credential: the node's own report, again."""
        if by.kind not in ("cluster", "node") or by.cluster_id is None:
            raise UsageError("nodes register with their cluster's token, not the admin's")
        if report.get("cluster_id") and report["cluster_id"] != by.cluster_id:
            raise PermissionDeniedError(
                f"this token belongs to cluster {by.cluster_id}, not "
                f"{str(report['cluster_id'])[:40]}: fix "
                "STASIS_CLUSTER_ID or STASIS_AUTH_TOKEN"
            )
        name = validate_name(str(report["name"]), "node name")
        if by.kind == "node":
            by.node_only(name, "registering a joined node")
        row = {
            "host": str(report["host"])[:200],
            "stasis_version": str(report["stasis_version"])[:60],
            "criu_version": (
                str(report["criu_version"])[:60] if report.get("criu_version") else None
            ),
            "slurm_version": (
                str(report["slurm_version"])[:60] if report.get("slurm_version") else None
            ),
            "check_ok": bool(report["check_ok"]),
            "problems": json.dumps(list(report.get("problems") or [])[:50]),
            "last_heartbeat": int(time.time()),
            "jobs": int(report.get("jobs") or 0),
        }
        credential = None
        try:
            credential = self._join(by, name, row)
        except IntegrityError:  # another join of that name won the primary key meanwhile
            raise ConflictError(self._joined(by.cluster_id, name, "just now")) from None
        answer: dict[str, Any] = {
            "cluster_id": by.cluster_id,
            "name": name,
            "registered": True,
            "approved": self._approved(by.cluster_id, name),
        }
        if credential is not None:
            answer["node_token"] = credential
        return answer

    def _join(self, by: Principal, name: str, row: dict[str, Any]) -> str | None:
        assert by.cluster_id is not None
        credential = None
        with self.db.transaction() as conn:
            if by.kind == "cluster":
                credential = self._issue_credential(conn, by.cluster_id, name)
                # Joined with the cluster's token (which a thief may hold too): where the
                # cluster says so, pending until an admin approves it, also under a name that
                # was approved before (its credential was reset).
                pending = bool(
                    conn.execute(
                        select(clusters.c.approve_joins).where(clusters.c.id == by.cluster_id)
                    ).scalar()
                )
                row = {**row, "approved": not pending}
                if pending:
                    event_log.record(
                        conn,
                        by.cluster_id,
                        name,
                        "node-pending",
                        f"node {name} joined and waits for an admin's approval: "
                        f"`stasis controlplane nodes approve {name} --cluster "
                        f"{by.cluster_id}`",
                    )
            n = conn.execute(
                update(nodes)
                .where(nodes.c.cluster_id == by.cluster_id, nodes.c.name == name)
                .values(**row)
            ).rowcount
            if n:
                self._back(conn, by.cluster_id, name)
            else:
                conn.execute(
                    insert(nodes).values(
                        cluster_id=by.cluster_id, name=name, registered=iso_now(), **row
                    )
                )
                event_log.record(
                    conn,
                    by.cluster_id,
                    name,
                    "node-joined",
                    f"node {name} joined (stasis {row['stasis_version']}, CRIU "
                    f"{row['criu_version']}, check "
                    f"{'ok' if row['check_ok'] else 'failing'})",
                )
        return credential

    def _issue_credential(self, conn: Any, cluster_id: str, name: str) -> str:
        """A new credential for node `name`, which has none (the primary key holds that
        against two joins at once)."""
        token = NODE_PREFIX + secrets.token_urlsafe(32)
        held = conn.execute(
            select(node_credentials.c.created).where(
                node_credentials.c.cluster_id == cluster_id, node_credentials.c.node == name
            )
        ).first()
        if held is not None:
            raise ConflictError(self._joined(cluster_id, name, held.created))
        conn.execute(
            insert(node_credentials).values(
                cluster_id=cluster_id, node=name, sha256=token_sha(token), created=iso_now()
            )
        )
        event_log.record(
            conn,
            cluster_id,
            name,
            "node-credential",
            f"node {name} got its own credential (joined with the cluster token)",
        )
        return token

    def _joined(self, cluster_id: str, name: str, since: str) -> str:
        return (
            f"node {name} of cluster {cluster_id} is already joined (it has had its own "
            f"credential since {since}): a node speaks with the credential it keeps in "
            f"its state dir; if that was lost, an admin runs `stasis controlplane nodes "
            f"reset {name} --cluster {cluster_id}` and the node joins again"
        )

    def _approved(self, cluster_id: str, name: str) -> bool:
        with self.db.transaction() as conn:
            return bool(
                conn.execute(
                    select(nodes.c.approved).where(
                        nodes.c.cluster_id == cluster_id, nodes.c.name == name
                    )
                ).scalar()
            )

    def approve_node(self, by: Principal, name: str, cluster: str | None = None) -> dict[str, Any]:
        """Node `name`, pending since it joined a cluster that approves joins, approved: it
        is given commands and chosen as a target from now on."""
        by.admin_only()
        validate_name(name, "node name")
        cid = self._cluster_of_node(by, name, cluster)
        with self.db.transaction() as conn:
            n = conn.execute(
                update(nodes)
                .where(nodes.c.cluster_id == cid, nodes.c.name == name, nodes.c.approved.is_(False))
                .values(approved=True)
            ).rowcount
            if n:
                event_log.record(
                    conn, cid, name, "node-approved", f"node {name} was approved by an admin"
                )
            elif (
                conn.execute(
                    select(nodes.c.name).where(nodes.c.cluster_id == cid, nodes.c.name == name)
                ).first()
                is None
            ):
                raise NotFoundError(f"no node {name} in cluster {cid}: it joins first")
        return {"cluster_id": cid, "name": name, "approved": True, "was_pending": bool(n)}

    def _refuse_pending(self, conn: Any, cluster_id: str, node: str) -> None:
        approved = conn.execute(
            select(nodes.c.approved).where(nodes.c.cluster_id == cluster_id, nodes.c.name == node)
        ).scalar()
        if approved is False:
            raise ConflictError(
                f"node {node} of cluster {cluster_id} is pending: it joined "
                "and waits for an admin's approval before it takes commands "
                f"(`stasis controlplane nodes approve {node} --cluster "
                f"{cluster_id}`, once you know it is yours)"
            )

    def reset_node(self, by: Principal, name: str, cluster: str | None = None) -> dict[str, Any]:
        """Node `name`'s credential forgotten: the node (or whoever holds the cluster's token)
        may join under that name again."""
        by.admin_only()
        validate_name(name, "node name")
        cid = self._cluster_of_node(by, name, cluster)
        with self.db.transaction() as conn:
            n = conn.execute(
                node_credentials.delete().where(
                    node_credentials.c.cluster_id == cid, node_credentials.c.node == name
                )
            ).rowcount
            if n:
                event_log.record(
                    conn,
                    cid,
                    name,
                    "node-reset",
                    f"node {name}'s credential was reset by an admin: it joins again "
                    "with the cluster token",
                )
        return {"cluster_id": cid, "name": name, "reset": bool(n)}

    def _cluster_of_node(self, by: Principal, name: str, cluster: str | None) -> str:
        if cluster is not None:
            return self.cluster_id_of(cluster)
        with self.db.transaction() as conn:
            found = {
                str(r.cluster_id)
                for r in conn.execute(select(nodes.c.cluster_id).where(nodes.c.name == name))
            } | {
                str(r.cluster_id)
                for r in conn.execute(
                    select(node_credentials.c.cluster_id).where(node_credentials.c.node == name)
                )
            }
        if by.kind != "admin":
            found &= {str(by.cluster_id)}
        if not found:
            raise NotFoundError(f"no node {name}")
        if len(found) > 1:
            raise UsageError(
                f"node {name} is in several clusters ({', '.join(sorted(found))}):"
                " name its cluster (--cluster)"
            )
        return found.pop()

    def heartbeat(
        self,
        by: Principal,
        name: str,
        jobs: list[dict[str, Any]],
        activity: list[dict[str, Any]] | None = None,
        mem_total_bytes: int | None = None,
        scheduler_state: str | None = None,
        verdicts_heard: list[verdicts.VerdictReport] | None = None,
    ) -> dict[str, Any]:
        validate_name(name, "node name")
        by.node_only(name, "a heartbeat")
        running = sum(1 for j in jobs if j.get("state") in ("running", "restored"))
        with self.db.transaction() as conn:
            n = conn.execute(
                update(nodes)
                .where(nodes.c.cluster_id == by.cluster_id, nodes.c.name == name)
                .values(
                    last_heartbeat=int(time.time()),
                    jobs=running,
                    job_list=json.dumps(jobs),
                    mem_total_bytes=mem_total_bytes,
                    scheduler_state=scheduler_state,
                )
            ).rowcount
            if not n:
                raise NotFoundError(
                    f"node {name} is not registered in this cluster: register " "first"
                )
            assert by.cluster_id is not None
            self._back(conn, by.cluster_id, name)
            for a in activity or ():
                self._record(conn, by.cluster_id, name, a)
            for v in verdicts_heard or ():
                self._verdict(conn, by.cluster_id, name, v)
        return {"name": name, "ok": True}

    def _verdict(self, conn: Any, cluster_id: str, node: str, v: verdicts.VerdictReport) -> bool:
        """A verdict of `stasis verify` node `node` reports, kept with its checkpoint if that
        is of the node's own cluster (stasis.controlplane.verdicts); whether it was."""
        if verdicts.record(conn, cluster_id, node, v):
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

    def _back(self, conn: Any, cluster_id: str, name: str) -> None:
        """A node that was found lost and is heard of again: said once."""
        n = conn.execute(
            update(nodes)
            .where(
                nodes.c.cluster_id == cluster_id,
                nodes.c.name == name,
                nodes.c.lost_since.is_not(None),
            )
            .values(lost_since=None)
        ).rowcount
        if n:
            event_log.record(conn, cluster_id, name, "node-back", f"node {name} reports again")

    def note_lost(self, lost_after_s: float) -> list[str]:
        """Nodes silent for `lost_after_s` that were not found so before: marked, and an event
        each; their names."""
        now = int(time.time())
        with self.db.transaction() as conn:
            rows = conn.execute(
                select(
                    nodes.c.cluster_id, nodes.c.name, nodes.c.jobs, nodes.c.last_heartbeat
                ).where(nodes.c.lost_since.is_(None), nodes.c.last_heartbeat < now - lost_after_s)
            ).all()
            for r in rows:
                conn.execute(
                    update(nodes)
                    .where(nodes.c.cluster_id == r.cluster_id, nodes.c.name == r.name)
                    .values(lost_since=now)
                )
                event_log.record(
                    conn,
                    r.cluster_id,
                    r.name,
                    "node-lost",
                    f"node {r.name} is lost: silent for {now - r.last_heartbeat} s "
                    f"with {r.jobs} job(s)",
                )
        return [r.name for r in rows]

    def _record(self, conn: Any, cluster_id: str, node: str, a: dict[str, Any]) -> None:
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

    def list_nodes(self, by: Principal, lost_after_s: float) -> list[dict[str, Any]]:
        q = select(nodes, clusters.c.name.label("cluster")).join(
            clusters, clusters.c.id == nodes.c.cluster_id
        )
        if by.kind != "admin":
            q = q.where(nodes.c.cluster_id == by.cluster_id)
        with self.db.transaction() as conn:
            rows = conn.execute(q.order_by(clusters.c.name, nodes.c.name)).mappings().all()
            # Since when each node has its own credential (None: not joined with one yet,
            # or reset by an admin).
            since = {
                (c.cluster_id, c.node): c.created
                for c in conn.execute(
                    select(
                        node_credentials.c.cluster_id,
                        node_credentials.c.node,
                        node_credentials.c.created,
                    )
                )
            }
        now = time.time()
        out = []
        for r in rows:
            d = dict(r)
            d["credential_since"] = since.get((d["cluster_id"], d["name"]))
            d["problems"] = json.loads(d["problems"])
            d.pop("job_list", None)
            age = now - d["last_heartbeat"]
            d["state"] = (
                "pending"
                if not d["approved"]
                else "lost"
                if age > lost_after_s
                else ("ready" if d["check_ok"] else "not-ready")
            )
            d["last_heartbeat_age_s"] = round(age, 1)
            out.append(d)
        return out

    def list_jobs(self, by: Principal) -> list[dict[str, Any]]:
        """Every job the nodes last reported, with its node and cluster."""
        q = select(
            nodes.c.cluster_id, nodes.c.name, nodes.c.job_list, clusters.c.name.label("cluster")
        ).join(clusters, clusters.c.id == nodes.c.cluster_id)
        if by.kind != "admin":
            q = q.where(nodes.c.cluster_id == by.cluster_id)
        with self.db.transaction() as conn:
            rows = conn.execute(q.order_by(clusters.c.name, nodes.c.name)).mappings().all()
        jobs = [
            {**j, "node": r["name"], "cluster": r["cluster"], "cluster_id": r["cluster_id"]}
            for r in rows
            for j in json.loads(r["job_list"])
        ]
        last = self._last_checkpoints(by)
        now = time.time()
        for j in jobs:
            ckpt = last.get((j["cluster_id"], j.get("user"), j.get("label")))
            j["last_checkpoint"] = ckpt["id"] if ckpt else None
            j["last_checkpoint_age_s"] = round(now - ckpt["created"], 1) if ckpt else None
            # ok, failed: REASON, not verified (stasis.controlplane.verdicts)
            j["last_checkpoint_verified"] = verdicts.shown(ckpt)["verified"] if ckpt else None
        return jobs

    def _last_checkpoints(self, by: Principal) -> dict[tuple[Any, ...], dict[str, Any]]:
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
    ) -> list[dict[str, Any]]:
        """The checkpoints the nodes reported, newest first (deleted ones only if asked)."""
        q = select(checkpoints, clusters.c.name.label("cluster")).join(
            clusters, clusters.c.id == checkpoints.c.cluster_id
        )
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
        return [{**verdicts.shown(dict(r)), "age_s": round(now - r["created"], 1)} for r in rows]

    def live_checkpoints(self) -> list[Any]:
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

    def cluster_names(self) -> dict[str, str]:
        """Each cluster's name, by its id."""
        with self.db.transaction() as conn:
            return {r.id: r.name for r in conn.execute(select(clusters.c.id, clusters.c.name))}

    def node_states(self) -> dict[tuple[str, str], tuple[int | None, str]]:
        """Each node's (cluster id, name): its memory and its scheduler's state ("" if none)."""
        with self.db.transaction() as conn:
            return {
                (r.cluster_id, r.name): (r.mem_total_bytes, r.scheduler_state or "")
                for r in conn.execute(
                    select(
                        nodes.c.cluster_id,
                        nodes.c.name,
                        nodes.c.mem_total_bytes,
                        nodes.c.scheduler_state,
                    )
                ).all()
            }

    def checkpoint_totals(self) -> list[dict[str, Any]]:
        """Per cluster: checkpoints reported (deleted ones too), their bytes and seconds."""
        q = (
            select(
                clusters.c.name.label("cluster"),
                func.count().label("count"),
                func.coalesce(func.sum(checkpoints.c.size_bytes), 0).label("bytes"),
                func.coalesce(func.sum(checkpoints.c.duration_s), 0).label("seconds"),
                func.coalesce(func.sum(checkpoints.c.frozen_s), 0).label("frozen"),
            )
            .join(clusters, clusters.c.id == checkpoints.c.cluster_id)
            .group_by(clusters.c.name)
        )
        with self.db.transaction() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]

    def verdict_totals(self) -> list[dict[str, Any]]:
        """Per cluster: live checkpoints by their verdict (ok, failed, none)."""
        q = (
            select(
                clusters.c.name.label("cluster"),
                checkpoints.c.verified_ok,
                func.count().label("count"),
            )
            .join(clusters, clusters.c.id == checkpoints.c.cluster_id)
            .where(checkpoints.c.deleted.is_(None))
            .group_by(clusters.c.name, checkpoints.c.verified_ok)
        )
        with self.db.transaction() as conn:
            rows = conn.execute(q).all()
        return [
            {
                "cluster": r.cluster,
                "count": r.count,
                "verdict": "none" if r.verified_ok is None else "ok" if r.verified_ok else "failed",
            }
            for r in rows
        ]

    def savings(self, by: Principal) -> dict[str, Any]:
        """Node-hours of work kept by restores instead of reruns: in all, per cluster, per
        user, per day (UTC). A restore keeps the seconds of work its checkpoint held; every
        job counts as one node (the nodes report single-node jobs)."""
        q = select(
            restores.c.cluster_id,
            clusters.c.name.label("cluster"),
            restores.c.user,
            restores.c.work_s,
            restores.c.at,
        ).join(clusters, clusters.c.id == restores.c.cluster_id)
        if by.kind != "admin":
            q = q.where(restores.c.cluster_id == by.cluster_id)
        with self.db.transaction() as conn:
            rows = conn.execute(q.order_by(restores.c.at)).mappings().all()
        per_cluster: dict[str, float] = {}
        per_user: dict[str, float] = {}
        per_day: dict[str, float] = {}
        for r in rows:
            hours = float(r["work_s"]) / 3600
            per_cluster[r["cluster"]] = per_cluster.get(r["cluster"], 0.0) + hours
            per_user[r["user"]] = per_user.get(r["user"], 0.0) + hours
            day = datetime.fromtimestamp(r["at"], UTC).date().isoformat()
            per_day[day] = per_day.get(day, 0.0) + hours

        def listed(d: dict[str, float], key: str) -> list[dict[str, Any]]:
            return [
                {key: k, "node_hours": round(v, 4)}
                for k, v in sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))
            ]

        return {
            "node_hours": round(sum(per_cluster.values()), 4),
            "restores": len(rows),
            "clusters": listed(per_cluster, "cluster"),
            "users": listed(per_user, "user"),
            "days": [{"day": k, "node_hours": round(v, 4)} for k, v in sorted(per_day.items())],
        }

    # -- commands -----------------------------------------------------------------------------

    def find_job(
        self, by: Principal, job: str, cluster: str | None = None, node: str | None = None
    ) -> dict[str, Any]:
        """The one job `job` that a node reports, by (cluster, node, job): a job id that
        several nodes report (two clusters, or a node repeating another's) is refused unless
        its cluster and node are given, never taken by name order."""
        if not re.fullmatch(JOB_ID, job):
            raise UsageError(
                f"bad job id {job[:100]!r}: letters, digits, '.', '_', ':' and " "'-', at most 100"
            )
        cid = self.cluster_id_of(cluster) if cluster else None
        where = [
            j
            for j in self.list_jobs(by)
            if j.get("job") == job
            and (cid is None or j["cluster_id"] == cid)
            and (node is None or j["node"] == node)
        ]
        if not where:
            on = (f" in cluster {cluster}" if cluster else "") + (
                f" on node {node}" if node else ""
            )
            raise NotFoundError(
                f"no node reports a job {job}{on}: `stasis controlplane jobs` " "lists them"
            )
        if len(where) > 1:
            seen = ", ".join(f"{j['cluster']}/{j['node']}" for j in where[:5])
            raise ConflictError(
                f"job {job} is reported by {len(where)} nodes ({seen}): name "
                "its cluster and node (--cluster, --node)"
            )
        return where[0]

    def queue(
        self,
        by: Principal,
        kind: CommandKind,
        job: str,
        args: CheckpointArgs,
        cluster: str | None = None,
        node: str | None = None,
    ) -> Command:
        """A command for the node that reports `job` (cluster and node: see find_job)."""
        by.admin_only()
        found = self.find_job(by, job, cluster, node)
        full: CheckpointArgs = {**args, "job": job, "kind": found.get("kind") or "daemon"}
        return self.queue_for_node(found["cluster_id"], found["node"], kind, full)

    def verify_checkpoint(self, by: Principal, checkpoint_id: str, lost_after_s: float) -> Command:
        """A verify command (`stasis verify`) for checkpoint `checkpoint_id`, sent to the node
        that took it, which must be ready: its verdict is kept with the checkpoint."""
        by.admin_only()
        if not re.fullmatch(CHECKPOINT_ID, checkpoint_id):
            raise UsageError(f"bad checkpoint id {checkpoint_id[:64]!r}")
        with self.db.transaction() as conn:
            row = (
                conn.execute(select(checkpoints).where(checkpoints.c.id == checkpoint_id))
                .mappings()
                .first()
            )
        if row is None or row["deleted"] is not None:
            raise NotFoundError(
                f"no checkpoint {checkpoint_id} known here"
                + (" (deleted)" if row is not None else "")
                + ": `stasis controlplane checkpoints` lists them"
            )
        node = [
            n
            for n in self.list_nodes(by, lost_after_s)
            if n["cluster_id"] == row["cluster_id"] and n["name"] == row["node"]
        ]
        if not node:
            raise NotFoundError(
                f"node {row['node']}, which took checkpoint {checkpoint_id}, "
                "is no longer known here: `stasis verify "
                f"{checkpoint_id}` on a node that shares its store"
            )
        if node[0]["state"] != "ready":
            raise ConflictError(
                _not_ready(node[0]) + f": the node that took checkpoint "
                f"{checkpoint_id} verifies it; ask again once it is ready"
            )
        return self.queue_for_node(
            row["cluster_id"],
            row["node"],
            "verify",
            {
                "checkpoint": checkpoint_id,
                "label": row["label"],
                "user": row["user"],
                "reason": "asked",
            },
        )

    def queue_for_node(self, cluster_id: str, node: str, kind: CommandKind, args: Args) -> Command:
        cid = "cmd_" + secrets.token_hex(8)
        row = {
            "id": cid,
            "cluster_id": cluster_id,
            "node": node,
            "kind": kind,
            "args": json.dumps(args),
            "state": "queued",
            "attempts": 0,
            "lease_until": None,
            "result": None,
            "created": stamp(),
            "finished": None,
        }
        with self.db.transaction() as conn:
            self._refuse_pending(conn, cluster_id, node)
            conn.execute(insert(commands).values(**row))
        return self._command(row)

    def migrate_job(
        self,
        by: Principal,
        job: str,
        to: str,
        extra: CheckpointArgs | None = None,
        cluster: str | None = None,
        node: str | None = None,
        lost_after_s: float = float("inf"),
    ) -> Command:
        """Stop-and-checkpoint `job` on its node, then (once that is acknowledged) restore it
        on node `to` of the same cluster, through the store both share. The restore names
        the job's label and owner as reported now, the checkpoint command, and the seal the
        source node answered with: the target node restores only the checkpoint that command
        took (stasis.controlplane.node)."""
        by.admin_only()
        validate_name(to, "node name")
        src = self.find_job(by, job, cluster, node)
        if (src.get("kind") or "daemon") != "daemon":
            raise UsageError(
                f"{src['kind']} job {job} moves where its scheduler puts it: "
                f"`stasis controlplane checkpoint {job} --stop` checkpoints and "
                "requeues it"
            )
        if src["node"] == to:
            raise UsageError(f"job {job} runs on {to} already")
        peers = [
            n for n in self.list_nodes(by, lost_after_s) if n["cluster_id"] == src["cluster_id"]
        ]
        target = [n for n in peers if n["name"] == to]
        if not target:
            raise NotFoundError(f"no node {to} in cluster {src['cluster']}")
        if target[0]["state"] == "pending":
            with self.db.transaction() as conn:
                self._refuse_pending(conn, src["cluster_id"], to)
        if target[0]["state"] != "ready":
            raise ConflictError(
                _not_ready(target[0]) + ": it is no migration target; "
                "migrate to a ready node (`stasis controlplane nodes`)"
            )
        # Where the restore goes if the target fails it or is lost: the source seals for
        # these too (stasis.controlplane.node), fewest jobs first.
        alternates = [
            n["name"]
            for n in sorted(peers, key=lambda n: (int(n["jobs"]), n["name"]))
            if n["state"] == "ready" and n["name"] not in (to, src["node"])
        ]
        return self.queue(
            by,
            "checkpoint",
            job,
            {
                "leave_running": False,
                "then_restore_on": to,
                "or_on": alternates[: migration.ALTERNATES],
                "reason": f"migration to {to}",
                "label": src.get("label"),
                "user": src.get("user"),
                **(extra or {}),
            },
            src["cluster_id"],
            src["node"],
        )

    def drain(
        self,
        by: Principal,
        node: str,
        lost_after_s: float,
        reason: str = "stasis drain",
        cluster: str | None = None,
    ) -> dict[str, Any]:
        """Every live job of `node` off it. Where the node reports a scheduler state (Slurm,
        Kubernetes), one `drain` command has its daemon empty it in the scheduler: a Slurm
        node drained and its Slurm jobs checkpointed and requeued, a Kubernetes node cordoned
        and its pods checkpointed and evicted; the scheduler runs them again elsewhere,
        restored. Those jobs (kind other than "daemon") are listed as `handled` by that
        command. The daemon's own jobs are migrated to the other ready nodes of the cluster
        (the one with the fewest jobs first)."""
        by.admin_only()
        validate_name(node, "node name")
        all_nodes = self.list_nodes(by, lost_after_s)
        cid = self.cluster_id_of(cluster) if cluster else None
        mine = [
            n for n in all_nodes if n["name"] == node and (cid is None or n["cluster_id"] == cid)
        ]
        if not mine:
            raise NotFoundError(f"no node {node}" + (f" in cluster {cluster}" if cluster else ""))
        if len(mine) > 1:
            raise ConflictError(
                f"node {node} is in several clusters "
                f"({', '.join(n['cluster'] for n in mine)}): name its cluster "
                "(--cluster)"
            )
        cluster = str(mine[0]["cluster_id"])
        listed = [j for j in self.list_jobs(by) if j["node"] == node and j["cluster_id"] == cluster]
        jobs = [j for j in listed if (j.get("kind") or "daemon") == "daemon"]
        theirs = [j for j in listed if (j.get("kind") or "daemon") != "daemon"]
        # Only where the node said its scheduler knows it (a node that runs stasis's own jobs
        # only reports no scheduler state).
        by_scheduler = (
            self.cluster(cluster)["kind"] in ("slurm", "kubernetes")
            and mine[0]["state"] != "lost"
            and bool(mine[0].get("scheduler_state"))
        )
        if theirs and not by_scheduler:
            why = "is lost" if mine[0]["state"] == "lost" else "reports no scheduler state"
            raise UsageError(
                f"node {node} {why}: its {len(theirs)} {theirs[0]['kind']} "
                "job(s) cannot be drained in their scheduler from here"
            )
        others = {
            n["name"]: int(n["jobs"])
            for n in all_nodes
            if n["cluster_id"] == cluster and n["name"] != node and n["state"] == "ready"
        }
        if jobs and not others:
            raise UsageError(
                f"no other ready node in cluster {mine[0]['cluster']} to take the "
                f"{len(jobs)} job(s) of {node}"
            )
        scheduler = (
            self.queue_for_node(cluster, node, "drain", {"reason": reason})
            if by_scheduler
            else None
        )
        moves = []
        for j in jobs:
            to = min(sorted(others), key=lambda n: others[n])
            others[to] += 1
            moves.append(self.migrate_job(by, j["job"], to, None, cluster, node, lost_after_s))
        return {
            "node": node,
            "cluster_id": cluster,
            "migrations": moves,
            "drain": scheduler,
            "handled": [
                {"job": j["job"], "kind": j["kind"], "label": j.get("label")} for j in theirs
            ],
        }

    def lease(self, by: Principal, node: str, lease_s: float) -> Command | None:
        """The node's next command, leased to it for `lease_s` (None: nothing to do), with
        the lease's id: renewing and acknowledging quote it. Only the node itself leases its
        commands (its own credential)."""
        validate_name(node, "node name")
        by.node_only(node, "leasing a node's commands")
        now = int(time.time())
        # A queued command's lease_until, if any, is when it may be leased (a retry's backoff).
        free = (
            (commands.c.state == "queued")
            & (commands.c.lease_until.is_(None) | (commands.c.lease_until <= now))
        ) | ((commands.c.state == "leased") & (commands.c.lease_until < now))
        with self.db.transaction() as conn:
            if (
                conn.execute(
                    select(nodes.c.approved).where(
                        nodes.c.cluster_id == by.cluster_id, nodes.c.name == node
                    )
                ).scalar()
                is False
            ):
                return None  # pending: nothing for it until an admin approves it
            for _ in range(5):  # another leaser may win a row between select and update
                # A verify (low priority) only when nothing else waits: a checkpoint or a
                # migration asked meanwhile goes first.
                row = conn.execute(
                    select(commands.c.id)
                    .where(commands.c.cluster_id == by.cluster_id, commands.c.node == node, free)
                    .order_by(
                        case((commands.c.kind == "verify", 1), else_=0),
                        commands.c.created,
                        commands.c.id,
                    )
                    .limit(1)
                ).first()
                if row is None:
                    return None
                lease_id = "lease_" + secrets.token_hex(12)
                n = conn.execute(
                    update(commands)
                    .where(commands.c.id == row.id, free)
                    .values(
                        state="leased",
                        lease_until=now + int(lease_s),
                        lease_id=lease_id,
                        attempts=commands.c.attempts + 1,
                    )
                ).rowcount
                if n:
                    got = (
                        conn.execute(select(commands).where(commands.c.id == row.id))
                        .mappings()
                        .first()
                    )
                    if got is None:
                        return None
                    leased = self._command(dict(got))
                    leased["lease_id"] = lease_id
                    return leased
        return None

    def _held(
        self, conn: Any, by: Principal, node: str, command_id: str, lease_id: str
    ) -> dict[str, Any]:
        """Command `command_id` of this node's, read for its lease holder: refused for
        another node's command (403), and for a lease that is not the command's current one
        (409). Its row (a done or failed one too: answered from its record)."""
        row = conn.execute(select(commands).where(commands.c.id == command_id)).mappings().first()
        if row is None or row["cluster_id"] != by.cluster_id:
            raise NotFoundError(f"no command {command_id[:40]} for this cluster")
        if row["node"] != node:
            raise PermissionDeniedError(
                f"command {command_id} is node {row['node']}'s, not "
                f"{node}'s: only the node it is for carries it out"
            )
        if row["state"] in ("done", "failed"):
            return dict(row)
        if row["state"] != "leased" or not lease_id or row["lease_id"] != lease_id:
            raise ConflictError(
                f"command {command_id} is not leased to node {node} under "
                f"lease {lease_id[:40] or '(none)'} (its lease ran out and it "
                "was leased again, or it was never leased): the node answers "
                "the lease it holds now"
            )
        return dict(row)

    def renew(
        self, by: Principal, node: str, command_id: str, lease_s: float, lease_id: str = ""
    ) -> wire.Renewed:
        """The lease of a command `node` is still carrying out, extended to `lease_s` from now
        (a long dump is not given out again while its node works on it): the node holding
        the lease only, quoting it."""
        validate_name(node, "node name")
        by.node_only(node, "renewing a command's lease")
        until = int(time.time()) + int(lease_s)
        with self.db.transaction() as conn:
            row = self._held(conn, by, node, command_id, lease_id)
            if row["state"] != "leased":
                raise NotFoundError(
                    f"command {command_id} was answered already "
                    f"({row['state']}): nothing to renew"
                )
            n = conn.execute(
                update(commands)
                .where(
                    commands.c.id == command_id,
                    commands.c.state == "leased",
                    commands.c.lease_id == lease_id,
                )
                .values(lease_until=until)
            ).rowcount
        if not n:
            raise ConflictError(f"command {command_id} is no longer leased under {lease_id}")
        return {"id": command_id, "lease_until": until}

    def commit(
        self, by: Principal, node: str, command_id: str, lease_s: float, lease_id: str = ""
    ) -> wire.Committed:
        """The fence of a restore's resume: node `node`, holding restore `command_id`'s lease
        (quoting it), has the job's tree restored and stopped, and may resume it only on this
        answer. Yes while the command is still its lease: the command is marked committed (in
        its result, until answered), and from then on is never re-targeted (the job may run
        there). Refused (409) once the command was failed (the node found lost and the restore
        re-targeted, or given up): an event says the node was fenced, and the node kills its
        tree. One transaction decides between this and a re-target (recover)."""
        validate_name(node, "node name")
        by.node_only(node, "committing a restore")
        now = int(time.time())
        with self.db.transaction() as conn:
            row = self._held(conn, by, node, command_id, lease_id)
            if row["kind"] != "restore":
                raise UsageError(
                    f"command {command_id} is a {row['kind']}: only a restore is "
                    "committed before its job resumes"
                )
            n = 0
            if row["state"] == "leased":
                n = conn.execute(
                    update(commands)
                    .where(
                        commands.c.id == command_id,
                        commands.c.state == "leased",
                        commands.c.lease_id == lease_id,
                    )
                    .values(
                        result=json.dumps({"committed": iso_now()}), lease_until=now + int(lease_s)
                    )
                ).rowcount
            if n:
                return {"id": command_id, "committed": True}
            got = (
                conn.execute(select(commands).where(commands.c.id == command_id)).mappings().first()
            )
            done = dict(got or row)
            why = _fenced(done, node)
            event_log.record(conn, done["cluster_id"], node, "command-fenced", why)
        raise ConflictError(why)

    def ack(
        self,
        by: Principal,
        command_id: str,
        ok: bool,
        result: dict[str, Any],
        lease_id: str = "",
        lost_after_s: float = float("inf"),
    ) -> Command:
        """The result of a command, from the node holding its lease (quoting it). A command
        moves only forward (queued -> leased -> done | failed): an answer to a done one is
        given its record, never applied again."""
        if by.kind != "node" or by.node is None:
            by.node_only("?", "acknowledging a command")
        assert by.node is not None
        with self.db.transaction() as conn:
            row = self._held(conn, by, by.node, command_id, lease_id)
            if row["state"] in ("done", "failed"):
                if row["state"] == "failed" and ok:
                    migration.late(conn, dict(row), result)
                return self._command(dict(row))  # acknowledged twice: the first one stands
            args = json.loads(row["args"])
            kind = kind_of(row["kind"])
            if kind is not None:  # (a kind this side does not know: recorded as answered)
                result = self._answered[kind](conn, dict(row), ok, result, lost_after_s)
            n = conn.execute(
                update(commands)
                .where(
                    commands.c.id == command_id,
                    commands.c.state == "leased",
                    commands.c.lease_id == lease_id,
                )
                .values(
                    state="done" if ok else "failed",
                    result=json.dumps(result),
                    finished=iso_now(),
                    lease_until=None,
                )
            ).rowcount
            if not n:  # answered meanwhile by a concurrent request: that one stands
                raise ConflictError(f"command {command_id} was answered meanwhile")
            what = f"{row['kind']} {args.get('job') or args.get('label') or ''}".strip()
            event_log.record(
                conn,
                row["cluster_id"],
                row["node"],
                "command-done" if ok else "command-failed",
                f"{what} ({command_id}): "
                + (
                    json.dumps({k: v for k, v in result.items() if k != "next"})
                    if ok
                    else str(result.get("error"))
                ),
            )
            got = (
                conn.execute(select(commands).where(commands.c.id == command_id)).mappings().first()
            )
        return self._command(dict(got or row))

    # What an answer to each kind of command does beside recording it (`ack`), in its
    # transaction: the result to record.

    def _checkpoint_answered(
        self, conn: Any, row: dict[str, Any], ok: bool, result: dict[str, Any], _: float
    ) -> dict[str, Any]:
        if ok and json.loads(row["args"]).get("then_restore_on") and result.get("checkpoint"):
            return migration.restore_half(conn, row, result)
        return result

    def _restore_answered(
        self,
        conn: Any,
        row: dict[str, Any],
        ok: bool,
        result: dict[str, Any],
        lost_after_s: float,
    ) -> dict[str, Any]:
        if ok:
            return result
        return {
            **result,
            **migration.after_failed_restore(
                conn,
                row,
                str(result.get("error") or "failed"),
                bool(result.get("permanent")),
                lost_after_s,
            ),
        }

    def _verify_answered(
        self, conn: Any, row: dict[str, Any], ok: bool, result: dict[str, Any], _: float
    ) -> dict[str, Any]:
        if "verdict" in result:
            self._keep_verdict(conn, row, json.loads(row["args"]), result)
        return result

    def _retain_answered(
        self, conn: Any, row: dict[str, Any], ok: bool, result: dict[str, Any], _: float
    ) -> dict[str, Any]:
        if ok and result.get("deleted"):
            conn.execute(
                update(checkpoints)
                .where(
                    checkpoints.c.id.in_([str(i) for i in result["deleted"]][:10_000]),
                    checkpoints.c.cluster_id == row["cluster_id"],
                )
                .values(deleted=time.time())
            )
        return result

    def _drain_answered(
        self, conn: Any, row: dict[str, Any], ok: bool, result: dict[str, Any], _: float
    ) -> dict[str, Any]:
        return result

    def _keep_verdict(
        self, conn: Any, row: dict[str, Any], args: dict[str, Any], result: dict[str, Any]
    ) -> None:
        """The verdict a verify command's node answered with, kept with the checkpoint the
        command named: a verdict on any other checkpoint is refused (the node answers the
        command it was given)."""
        from pydantic import ValidationError

        try:
            v = verdicts.VerdictReport.model_validate(result["verdict"])
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "verdict"
            raise UsageError(
                f"bad verdict in the answer to command {row['id']}: {where}: " f"{first['msg']}"
            ) from None
        if v.checkpoint != args.get("checkpoint"):
            raise UsageError(
                f"command {row['id']} asked to verify checkpoint "
                f"{args.get('checkpoint')}, not {v.checkpoint}: answer with its "
                "verdict"
            )
        self._verdict(conn, row["cluster_id"], row["node"], v)

    def recover(self, lost_after_s: float) -> int:
        """Commands that would otherwise hang, failed (and a migration's restore half
        re-targeted): a restore queued for, or leased by, a node that is lost; any command
        whose lease ran out on a lost node; any command leased MAX_LEASES times without an
        answer; a verify queued for a lost node (the policy that asked it picks again when
        the node is back, and meanwhile the label is not held up). A queued command of a lost
        node that is neither waits for it (its job is there). How many were failed."""
        now = int(time.time())
        failed = 0
        with self.db.transaction() as conn:
            silent = {
                (r.cluster_id, r.name): now - r.last_heartbeat
                for r in conn.execute(
                    select(nodes.c.cluster_id, nodes.c.name, nodes.c.last_heartbeat).where(
                        nodes.c.last_heartbeat < now - lost_after_s
                    )
                )
                if now - max(r.last_heartbeat, self.started) > lost_after_s
            }
            rows = [
                dict(r)
                for r in conn.execute(
                    select(commands).where(
                        ((commands.c.state == "leased") & (commands.c.lease_until < now))
                        | (
                            (commands.c.state == "queued")
                            & commands.c.kind.in_(("restore", "verify"))
                        )
                    )
                )
                .mappings()
                .all()
            ]
        for row in rows:
            lost = silent.get((row["cluster_id"], row["node"]))
            expired = row["state"] == "leased"
            if lost is not None and (expired or row["kind"] in ("restore", "verify")):
                why = f"node {row['node']} was lost (silent {lost} s) " + (
                    "while carrying it out" if expired else "before carrying it out"
                )
            elif expired and row["attempts"] >= MAX_LEASES:
                why = (
                    f"node {row['node']} leased it {row['attempts']} times without "
                    "answering (its daemon died carrying it out, or could not tell what "
                    "it had done, each time: see its log)"
                )
            else:
                continue
            try:
                self._fail_held(row, why, lost_after_s, lost is not None)
            except _Raced:
                continue  # answered or leased meanwhile: that stands
            failed += 1
        return failed

    def _fail_held(
        self, row: dict[str, Any], why: str, lost_after_s: float, node_lost: bool = False
    ) -> None:
        committed = (
            json.loads(row["result"] or "{}").get("committed") if row["state"] == "leased" else None
        )
        with self.db.transaction() as conn:
            if committed:
                # Its node may have resumed the job (commit): a re-target could run it twice.
                args = json.loads(row["args"])
                ckpt = str(args.get("checkpoint"))
                result = {
                    "committed": committed,
                    "error": (
                        f"{why}, after it had begun resuming checkpoint {ckpt} as job "
                        f"{args.get('job')} there (committed {committed}): not re-targeted, so "
                        f"that the job never runs twice; if node {row['node']} is gone for good, "
                        f"checkpoint {ckpt} is kept: `stasis restore {ckpt}` on a node of the "
                        "cluster"
                    ),
                }
                event_log.record(
                    conn,
                    row["cluster_id"],
                    row["node"],
                    "migration-failed",
                    f"restore ({row['id']}): {result['error']}",
                )
            elif row["kind"] == "restore":
                result = migration.after_failed_restore(
                    conn, row, why, False, lost_after_s, node_gone=True
                )
            else:
                # A lost node may only be cut off, its job running on: a restore by hand
                # elsewhere would run it twice.
                args = json.loads(row["args"])
                caution = (
                    (
                        f"; job {args['job']} may still run on node {row['node']} (cut off, "
                        "not stopped): restore it elsewhere only once that node is known "
                        "down"
                    )
                    if node_lost and row["kind"] == "checkpoint" and args.get("job")
                    else ""
                )
                result = {"error": why + self._newest_known(conn, row) + caution}
                event_log.record(
                    conn,
                    row["cluster_id"],
                    row["node"],
                    "command-failed",
                    f"{row['kind']} ({row['id']}): {result['error']}",
                )
            # Not if it was answered, leased again or committed since it was read.
            n = conn.execute(
                update(commands)
                .where(
                    commands.c.id == row["id"],
                    commands.c.state == row["state"],
                    commands.c.attempts == row["attempts"],
                    commands.c.result.is_(None)
                    if row["result"] is None
                    else commands.c.result == row["result"],
                )
                .values(
                    state="failed", result=json.dumps(result), finished=iso_now(), lease_until=None
                )
            ).rowcount
            if not n:
                raise _Raced()  # rolls back the restore queued in its place

    @staticmethod
    def _newest_known(conn: Any, row: dict[str, Any]) -> str:
        """For a checkpoint command failed with its node: the newest checkpoint of the job's
        label that its nodes reported, to restore by hand."""
        args = json.loads(row["args"])
        if not args.get("label") or row["kind"] == "verify":
            return ""
        newest = conn.execute(
            select(checkpoints.c.id, checkpoints.c.node, checkpoints.c.verified_ok)
            .where(
                checkpoints.c.cluster_id == row["cluster_id"],
                checkpoints.c.label == args["label"],
                checkpoints.c.user == args.get("user"),
                checkpoints.c.deleted.is_(None),
            )
            .order_by(checkpoints.c.created.desc())
            .limit(1)
        ).first()
        if newest is None:
            return f"; no checkpoint of label {args['label']} is known here"
        said = (
            f"; the newest checkpoint of label {args['label']} known here is {newest.id} "
            f"(node {newest.node}"
        )
        if newest.verified_ok:
            return said + ", verified): `stasis restore {newest.id}` on a node restores it"
        # An older one known to restore (`stasis verify`) is worth naming beside it.
        good = conn.execute(
            select(checkpoints.c.id, checkpoints.c.node)
            .where(
                checkpoints.c.cluster_id == row["cluster_id"],
                checkpoints.c.label == args["label"],
                checkpoints.c.user == args.get("user"),
                checkpoints.c.deleted.is_(None),
                checkpoints.c.verified_ok.is_(True),
            )
            .order_by(checkpoints.c.created.desc())
            .limit(1)
        ).first()
        state = "not verified" if newest.verified_ok is None else "failed verification"
        return (
            said
            + f", {state}): `stasis restore {newest.id}` on a node restores it"
            + (f"; the newest verified one is {good.id} (node {good.node})" if good else "")
        )

    def command(self, by: Principal, command_id: str) -> Command:
        with self.db.transaction() as conn:
            row = (
                conn.execute(select(commands).where(commands.c.id == command_id)).mappings().first()
            )
        if row is None or (by.kind != "admin" and row["cluster_id"] != by.cluster_id):
            raise NotFoundError(f"no command {command_id}")
        return self._command(dict(row))

    def commands_under_way(
        self, kind: CommandKind | None = None, created_since: float | None = None
    ) -> list[tuple[str, str, dict[str, Any]]]:
        """(cluster id, node, args) of each command queued or leased (of `kind`), and, with
        `created_since`, of each created since then whatever its state."""
        states: Any = commands.c.state.in_(("queued", "leased"))
        if created_since is not None:
            stamp = datetime.fromtimestamp(created_since, UTC).isoformat(timespec="microseconds")
            states = states | (commands.c.created >= stamp)
        q = select(commands.c.cluster_id, commands.c.node, commands.c.args).where(states)
        if kind is not None:
            q = q.where(commands.c.kind == kind)
        with self.db.transaction() as conn:
            rows = conn.execute(q).all()
        return [(c, n, json.loads(args)) for c, n, args in rows]

    def list_commands(self, by: Principal) -> list[Command]:
        q = select(commands).order_by(commands.c.created, commands.c.id)
        if by.kind != "admin":
            q = q.where(commands.c.cluster_id == by.cluster_id)
        with self.db.transaction() as conn:
            return [self._command(dict(r)) for r in conn.execute(q).mappings().all()]

    # -- events -------------------------------------------------------------------------------

    def list_events(self, by: Principal, limit: int = 200) -> list[dict[str, Any]]:
        return event_log.listed(self.db, None if by.kind == "admin" else by.cluster_id, limit)

    @staticmethod
    def _command(row: dict[str, Any]) -> Command:
        # The lease id is the lease holder's alone: only the lease answer carries it.
        return Command(
            id=row["id"],
            cluster_id=row["cluster_id"],
            node=row["node"],
            kind=row["kind"],
            args=json.loads(row["args"]),
            state=row["state"],
            attempts=row["attempts"],
            lease_until=row["lease_until"],
            result=json.loads(row["result"]) if row.get("result") else None,
            created=row["created"],
            finished=row["finished"],
        )


def _not_ready(n: dict[str, Any]) -> str:
    """One line: why node `n` (as list_nodes shows it) is not ready."""
    if n["state"] == "lost":
        return f"node {n['name']} is lost (silent {n['last_heartbeat_age_s']:.0f} s)"
    why = "; ".join(str(p) for p in n.get("problems") or [])[:500] or "its check failed"
    return f"node {n['name']} is not ready ({' '.join(why.split())})"


def _fenced(row: dict[str, Any], node: str) -> str:
    """One line: why node `node` may not resume the restore of command `row` (no longer its
    lease), and what became of it."""
    args = json.loads(row["args"])
    result = json.loads(row["result"] or "{}") if row["state"] != "leased" else {}
    what = (
        f"node {node} fenced: restore {row['id']} of checkpoint {args.get('checkpoint')} "
        f"(job {args.get('job')}) may not resume there: "
    )
    if row["state"] == "leased":
        return what + (
            "it is leased again under another lease; the node answers the lease " "it holds now"
        )
    if row["state"] == "done":
        return what + "it was answered already"
    nxt, error = result.get("next"), " ".join(str(result.get("error") or "").split())[:400]
    return (
        what
        + f"the control plane failed it meanwhile ({error})"
        + (f", re-targeted as {nxt}" if nxt and str(nxt) not in error else "")
        + "; its restored tree is killed unresumed, so that the job runs once"
    )


def human_size(n: float | None) -> str:
    """Bytes as people read them: 512 B, 3.1 MiB."""
    x = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"
