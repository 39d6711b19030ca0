"""The nodes of the control plane's clusters (the `nodes` and `node_credentials` tables): their
joining, credentials and approval, their heartbeats (the jobs they run), and which of them are
lost. Its tables' SQL is here; what a heartbeat reports of checkpoints and restores goes to
stasis.controlplane.reports, through its public methods, in the heartbeat's transaction."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable
from typing import Any, cast

from sqlalchemy import Connection, RowMapping, insert, select, update
from sqlalchemy.exc import IntegrityError

from stasis.controlplane import events as event_log
from stasis.controlplane import verdicts, wire
from stasis.controlplane.access import (
    NODE_PREFIX,
    Access,
    Principal,
    iso_now,
    token_sha,
    validate_name,
)
from stasis.controlplane.reports import Reports
from stasis.controlplane.schema import node_credentials, nodes
from stasis.errors import (
    ConflictError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    UsageError,
)


class Nodes:
    """The nodes: joined, approved, reset, heard from and found lost."""

    def __init__(self, access: Access, reports: Reports) -> None:
        self.access = access
        self.reports = reports
        self.db = access.db

    def register_node(self, by: Principal, report: dict[str, Any]) -> wire.Registered:
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
        answer: wire.Registered = {
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
                pending = self.access.approves_joins(conn, by.cluster_id)
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

    def _issue_credential(self, conn: Connection, cluster_id: str, name: str) -> str:
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

    def approve_node(
        self, by: Principal, name: str, cluster: str | None = None
    ) -> wire.NodeApproved:
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

    def authenticate(self, token: str) -> Principal:
        """The node whose own credential `token` is."""
        with self.db.transaction() as conn:
            cred = conn.execute(
                select(node_credentials).where(node_credentials.c.sha256 == token_sha(token))
            ).first()
        if cred is None:
            raise UnauthenticatedError(
                "unknown node credential (reset by an admin, or the control "
                "plane lost it): the node joins again with its cluster's token"
            )
        return Principal(
            kind="node", token_id="node:" + cred.node, cluster_id=cred.cluster_id, node=cred.node
        )

    def refuse_if_pending(self, cluster_id: str, node: str) -> None:
        """Refused (409) if node `node` waits for an admin's approval."""
        with self.db.transaction() as conn:
            self.refuse_pending(conn, cluster_id, node)

    def refuse_pending(self, conn: Connection, cluster_id: str, node: str) -> None:
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

    def reset_node(self, by: Principal, name: str, cluster: str | None = None) -> wire.NodeWasReset:
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
            return self.access.cluster_id_of(cluster)
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
    ) -> wire.Heard:
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
                self.reports.record_activity(conn, by.cluster_id, name, a)
            for v in verdicts_heard or ():
                self.reports.record_verdict(conn, by.cluster_id, name, v)
        return {"name": name, "ok": True}

    def _back(self, conn: Connection, cluster_id: str, name: str) -> None:
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

    def list_nodes(self, by: Principal, lost_after_s: float) -> list[wire.Node]:
        names = self.access.cluster_names()
        q = select(nodes)
        if by.kind != "admin":
            q = q.where(nodes.c.cluster_id == by.cluster_id)
        with self.db.transaction() as conn:
            rows = _by_cluster(names, conn.execute(q).mappings().all())
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
        out: list[wire.Node] = []
        for d in rows:
            age = now - d["last_heartbeat"]
            state: wire.NodeState = (
                "pending"
                if not d["approved"]
                else "lost"
                if age > lost_after_s
                else ("ready" if d["check_ok"] else "not-ready")
            )
            out.append(
                {
                    "cluster_id": d["cluster_id"],
                    "name": d["name"],
                    "host": d["host"],
                    "stasis_version": d["stasis_version"],
                    "criu_version": d["criu_version"],
                    "slurm_version": d["slurm_version"],
                    "check_ok": d["check_ok"],
                    "problems": json.loads(d["problems"]),
                    "registered": d["registered"],
                    "last_heartbeat": d["last_heartbeat"],
                    "jobs": d["jobs"],
                    "mem_total_bytes": d["mem_total_bytes"],
                    "scheduler_state": d["scheduler_state"],
                    "lost_since": d["lost_since"],
                    "approved": d["approved"],
                    "cluster": d["cluster"],
                    "credential_since": since.get((d["cluster_id"], d["name"])),
                    "state": state,
                    "last_heartbeat_age_s": round(age, 1),
                }
            )
        return out

    def list_jobs(self, by: Principal) -> list[wire.Job]:
        """Every job the nodes last reported, with its node and cluster."""
        names = self.access.cluster_names()
        q = select(nodes.c.cluster_id, nodes.c.name, nodes.c.job_list)
        if by.kind != "admin":
            q = q.where(nodes.c.cluster_id == by.cluster_id)
        with self.db.transaction() as conn:
            rows = _by_cluster(names, conn.execute(q).mappings().all())
        # (each as the node reported it: stasis.controlplane.models.JobReport checked it)
        jobs = [
            cast(
                wire.Job,
                {**j, "node": r["name"], "cluster": r["cluster"], "cluster_id": r["cluster_id"]},
            )
            for r in rows
            for j in json.loads(r["job_list"])
        ]
        last = self.reports.last_checkpoints(by)
        now = time.time()
        for j in jobs:
            ckpt = last.get((j["cluster_id"], j.get("user"), j.get("label")))
            j["last_checkpoint"] = ckpt["id"] if ckpt else None
            j["last_checkpoint_age_s"] = round(now - ckpt["created"], 1) if ckpt else None
            # ok, failed: REASON, not verified (stasis.controlplane.verdicts)
            j["last_checkpoint_verified"] = verdicts.shown(ckpt)["verified"] if ckpt else None
        return jobs

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

    def spans(self) -> list[tuple[str, str, int | None]]:
        """(cluster id, when it joined, when it was found lost) of each node."""
        with self.db.transaction() as conn:
            return [
                (r.cluster_id, r.registered, r.lost_since)
                for r in conn.execute(
                    select(nodes.c.cluster_id, nodes.c.registered, nodes.c.lost_since)
                )
            ]

    # -- read in the transaction of a command (stasis.controlplane.commandqueue) ---------------

    def pending(self, conn: Connection, cluster_id: str, node: str) -> bool:
        """Whether node `node` joined and waits for an admin's approval."""
        return (
            conn.execute(
                select(nodes.c.approved).where(
                    nodes.c.cluster_id == cluster_id, nodes.c.name == node
                )
            ).scalar()
            is False
        )

    def ready(self, conn: Connection, cluster_id: str, lost_after_s: float) -> set[str]:
        """The nodes of cluster `cluster_id` that may take a restore: approved, their check
        passing, heard from within `lost_after_s`."""
        now = time.time()
        return {
            r.name
            for r in conn.execute(
                select(nodes.c.name, nodes.c.last_heartbeat).where(
                    nodes.c.cluster_id == cluster_id,
                    nodes.c.check_ok.is_(True),
                    nodes.c.approved.is_not(False),
                )
            )
            if now - r.last_heartbeat <= lost_after_s
        }

    def silent(
        self, conn: Connection, lost_after_s: float, since: float
    ) -> dict[tuple[str, str], int]:
        """(cluster id, name) of each node silent for more than `lost_after_s`, counted from
        `since` at the earliest (while the control plane was down, nobody could be heard):
        for how many seconds."""
        now = int(time.time())
        return {
            (r.cluster_id, r.name): now - r.last_heartbeat
            for r in conn.execute(
                select(nodes.c.cluster_id, nodes.c.name, nodes.c.last_heartbeat).where(
                    nodes.c.last_heartbeat < now - lost_after_s
                )
            )
            if now - max(r.last_heartbeat, since) > lost_after_s
        }


def _by_cluster(names: dict[str, str], rows: Iterable[RowMapping]) -> list[dict[str, Any]]:
    """Node rows of the clusters in `names`, with their cluster's name, by cluster name then
    node name."""
    out = [{**r, "cluster": names[r["cluster_id"]]} for r in rows if r["cluster_id"] in names]
    return sorted(out, key=lambda r: (r["cluster"], r["name"]))


def not_ready(n: wire.Node) -> str:
    """One line: why node `n` (as list_nodes shows it) is not ready."""
    if n["state"] == "lost":
        return f"node {n['name']} is lost (silent {n['last_heartbeat_age_s']:.0f} s)"
    why = "; ".join(str(p) for p in n.get("problems") or [])[:500] or "its check failed"
    return f"node {n['name']} is not ready ({' '.join(why.split())})"
