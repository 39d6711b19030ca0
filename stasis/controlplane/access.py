"""Who may do what at the control plane: its tokens (the admin's, each cluster's, each node's
own credential and the policies' hook tokens, only their SHA-256 kept) and its clusters. The
repository of the `tokens` and `clusters` tables; the nodes, their reports and their commands
(stasis.controlplane.nodes, .reports, .commandqueue) ask it for clusters."""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, cast

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.exc import IntegrityError

from stasis.controlplane import events as event_log
from stasis.controlplane import wire
from stasis.controlplane.database import Database
from stasis.controlplane.schema import clusters, tokens
from stasis.errors import (
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    UsageError,
)

TOKEN_PREFIX = "stasis_"
HOOK_PREFIX = TOKEN_PREFIX + "hook_"  # a policy's (stasis.controlplane.policies)
NODE_PREFIX = TOKEN_PREFIX + "node_"  # a node's own credential (node_credentials)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
Kind = Literal["slurm", "kubernetes"]


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: the admin, a cluster's token (which only joins nodes and
    reads the cluster's view), or one node of a cluster (its own credential)."""

    kind: Literal["admin", "cluster", "node"]
    token_id: str
    cluster_id: str | None = None
    node: str | None = None

    def admin_only(self) -> None:
        if self.kind != "admin":
            raise PermissionDeniedError(
                "this needs the admin token; a cluster token may only "
                "join nodes, a node's credential only report and "
                "carry out that node's commands"
            )

    def node_only(self, name: str, what: str) -> str:
        """The node name of a node's own request about node `name`; refused for any other."""
        if self.kind != "node" or self.node is None:
            raise PermissionDeniedError(
                f"{what} needs the node's own credential (it got one when it joined): a "
                f"{self.kind} token may not act as "
                + (f"node {name[:100]}" if name != "?" else "a node")
            )
        if name != self.node:
            raise PermissionDeniedError(
                f"this credential is node {self.node}'s: it may not " f"act as node {name[:100]}"
            )
        return self.node


def iso_now(timespec: str = "seconds") -> str:
    return datetime.now(UTC).isoformat(timespec=timespec)


def stamp() -> str:
    """A command's creation time, fine enough to order the commands one request made."""
    return iso_now("microseconds")


def token_sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    while True:
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        # one in 2^30: it would read as a hook token or a node credential
        if not token.startswith((HOOK_PREFIX, NODE_PREFIX)):
            return token


def validate_name(name: str, what: str = "name") -> str:
    if not _NAME.fullmatch(name):
        raise UsageError(f"bad {what} {name!r}: letters, digits, '.', '_' and '-', at most 100")
    return name


def _expiry(expires_in_s: int | None) -> int | None:
    return int(time.time()) + expires_in_s if expires_in_s else None


class Access:
    """Tokens and clusters."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # -- tokens -------------------------------------------------------------------------------

    def bootstrap_admin(self) -> str | None:
        """A new admin token when there is none (the control plane's first start), else None."""
        with self.db.transaction() as conn:
            live = conn.execute(
                select(tokens.c.id).where(tokens.c.kind == "admin", tokens.c.revoked.is_(None))
            ).first()
            if live is not None:
                return None
            token = new_token()
            conn.execute(
                insert(tokens).values(
                    id="tok_" + secrets.token_hex(6),
                    kind="admin",
                    cluster_id=None,
                    sha256=token_sha(token),
                    created=iso_now(),
                    revoked=None,
                )
            )
            return token

    def authenticate(self, token: str) -> Principal:
        """The admin or the cluster whose token `token` is (a node's credential:
        stasis.controlplane.nodes; a policy's hook token: stasis.controlplane.policies)."""
        if not token.startswith(TOKEN_PREFIX):
            raise UnauthenticatedError(
                "no valid token: send `Authorization: Bearer stasis_...` " "(STASIS_AUTH_TOKEN)"
            )
        with self.db.transaction() as conn:
            row = conn.execute(select(tokens).where(tokens.c.sha256 == token_sha(token))).first()
        if row is None:
            raise UnauthenticatedError("unknown token")
        if row.revoked is not None:
            raise UnauthenticatedError(f"token {row.id} was revoked on {row.revoked}")
        if row.expires is not None and time.time() >= row.expires:
            when = datetime.fromtimestamp(row.expires, UTC).isoformat(timespec="seconds")
            raise UnauthenticatedError(
                f"token {row.id} expired on {when}: `stasis controlplane "
                "clusters rotate` gives a new one"
            )
        return Principal(kind=row.kind, token_id=row.id, cluster_id=row.cluster_id)

    def list_tokens(self) -> list[wire.Token]:
        return self._tokens(None)

    def token(self, token_id: str) -> wire.Token | None:
        """Token `token_id` (revoked or expired too), None if there is none."""
        found = self._tokens(token_id)
        return found[0] if found else None

    def _tokens(self, token_id: str | None) -> list[wire.Token]:
        q = select(
            tokens.c.id,
            tokens.c.kind,
            tokens.c.cluster_id,
            tokens.c.created,
            tokens.c.revoked,
            tokens.c.expires,
        ).order_by(tokens.c.created, tokens.c.id)
        if token_id is not None:
            q = q.where(tokens.c.id == token_id)
        with self.db.transaction() as conn:
            rows = conn.execute(q).mappings().all()
        return [cast(wire.Token, dict(r)) for r in rows]

    def revoke(self, token_id: str, by: Principal) -> wire.Revoked:
        if token_id == by.token_id:
            raise UsageError("an admin token cannot revoke itself (create another first)")
        with self.db.transaction() as conn:
            n = conn.execute(
                update(tokens)
                .where(tokens.c.id == token_id, tokens.c.revoked.is_(None))
                .values(revoked=iso_now())
            ).rowcount
        if not n:
            raise NotFoundError(f"no live token {token_id}")
        return {"token_id": token_id, "revoked": True}

    def rotate(self, cluster_id: str, expires_in_s: int | None = None) -> wire.Rotated:
        """A new token for the cluster (expiring `expires_in_s` from now, if given); its older
        ones are revoked."""
        self.cluster(cluster_id)
        token = new_token()
        with self.db.transaction() as conn:
            conn.execute(
                update(tokens)
                .where(tokens.c.cluster_id == cluster_id, tokens.c.revoked.is_(None))
                .values(revoked=iso_now())
            )
            tid = "tok_" + secrets.token_hex(6)
            conn.execute(
                insert(tokens).values(
                    id=tid,
                    kind="cluster",
                    cluster_id=cluster_id,
                    sha256=token_sha(token),
                    created=iso_now(),
                    revoked=None,
                    expires=_expiry(expires_in_s),
                )
            )
        return {
            "cluster_id": cluster_id,
            "token_id": tid,
            "token": token,
            "expires": _expiry(expires_in_s),
        }

    # -- clusters -----------------------------------------------------------------------------

    def add_cluster(
        self, name: str, kind: str, expires_in_s: int | None = None, approve_joins: bool = False
    ) -> wire.ClusterAdded:
        validate_name(name, "cluster name")
        if kind not in ("slurm", "kubernetes"):
            raise UsageError(f"bad cluster kind {kind!r}: slurm or kubernetes")
        typed: wire.ClusterKind = "slurm" if kind == "slurm" else "kubernetes"
        cid = "cl_" + secrets.token_hex(8)
        token = new_token()
        tid = "tok_" + secrets.token_hex(6)
        try:
            with self.db.transaction() as conn:
                conn.execute(
                    insert(clusters).values(
                        id=cid, name=name, kind=kind, created=iso_now(), approve_joins=approve_joins
                    )
                )
                conn.execute(
                    insert(tokens).values(
                        id=tid,
                        kind="cluster",
                        cluster_id=cid,
                        sha256=token_sha(token),
                        created=iso_now(),
                        revoked=None,
                        expires=_expiry(expires_in_s),
                    )
                )
        except IntegrityError:
            raise UsageError(f"a cluster named {name!r} exists already") from None
        return {
            "cluster_id": cid,
            "name": name,
            "kind": typed,
            "token_id": tid,
            "token": token,
            "expires": _expiry(expires_in_s),
            "approve_joins": approve_joins,
        }

    def set_approve_joins(self, by: Principal, cluster: str, on: bool) -> wire.ClusterApproval:
        """Whether nodes joining cluster `cluster` (id or name) wait for an admin's approval;
        the nodes joined already keep theirs."""
        by.admin_only()
        cid = self.cluster_id_of(cluster)
        with self.db.transaction() as conn:
            conn.execute(update(clusters).where(clusters.c.id == cid).values(approve_joins=on))
            event_log.record(
                conn,
                cid,
                None,
                "cluster-settings",
                "nodes that join wait for an admin's approval"
                if on
                else "nodes that join are approved at once",
            )
        return {"cluster_id": cid, "approve_joins": on}

    def cluster(self, cluster_id: str) -> wire.Cluster:
        with self.db.transaction() as conn:
            row = (
                conn.execute(select(clusters).where(clusters.c.id == cluster_id)).mappings().first()
            )
        if row is None:
            raise NotFoundError(f"no cluster {cluster_id}")
        return cast(wire.Cluster, dict(row))

    def cluster_names(self) -> dict[str, str]:
        """Each cluster's name, by its id."""
        with self.db.transaction() as conn:
            return {r.id: r.name for r in conn.execute(select(clusters.c.id, clusters.c.name))}

    def approves_joins(self, conn: Connection, cluster_id: str) -> bool:
        """Whether the nodes joining cluster `cluster_id` wait for an admin's approval (in the
        transaction of a join: stasis.controlplane.nodes)."""
        return bool(
            conn.execute(
                select(clusters.c.approve_joins).where(clusters.c.id == cluster_id)
            ).scalar()
        )

    def list_clusters(self) -> list[wire.Cluster]:
        with self.db.transaction() as conn:
            rows = conn.execute(select(clusters).order_by(clusters.c.name)).mappings().all()
        return [cast(wire.Cluster, dict(r)) for r in rows]

    def cluster_id_of(self, cluster: str) -> str:
        """A cluster given by id or by name."""
        with self.db.transaction() as conn:
            row = (
                conn.execute(select(clusters.c.id).where(clusters.c.id == cluster)).first()
                or conn.execute(select(clusters.c.id).where(clusters.c.name == cluster)).first()
            )
        if row is None:
            raise NotFoundError(
                f"no cluster {cluster[:100]}: `stasis controlplane clusters` " "lists them"
            )
        return str(row.id)
