"""Dashboard log-ins: a token given once on the log-in page becomes a session (table `sessions`):
a random session id in an HttpOnly, SameSite=Strict cookie (its SHA-256 kept, never the id),
the token's id, and a CSRF token that every form of the session carries back. A session ends at
its expiry, at log-out, or when its token is revoked or expires (checked on every request)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import delete, insert, select

from stasis.controlplane.access import HOOK_PREFIX, NODE_PREFIX, Principal
from stasis.controlplane.registry import Registry
from stasis.controlplane.schema import sessions
from stasis.errors import PermissionDeniedError, UnauthenticatedError


@dataclass(frozen=True)
class Session:
    principal: Principal
    csrf: str
    key: str  # the SHA-256 of its id: what it is kept (and its messages found) under
    expires: int

    def csrf_ok(self, given: str) -> bool:
        return hmac.compare_digest(self.csrf.encode(), given.encode())


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def start(registry: Registry, token: str, ttl_s: int) -> tuple[str, Session]:
    """Log in with `token`: the new session's id (for the cookie) and the session."""
    token = token.strip()
    # Refused by their prefix, before any look-up: a session keeps a row of `tokens`, which a
    # node's credential or a hook token is not (its session would never resolve), and neither
    # is a person's key to the site.
    if token.startswith((NODE_PREFIX, HOOK_PREFIX)):
        what = "a node's credential" if token.startswith(NODE_PREFIX) else "a policy's hook token"
        raise PermissionDeniedError(
            f"{what} does not log in to the dashboard: log in with the "
            "admin token or a cluster's token"
        )
    who = registry.authenticate(token)
    if who.kind not in ("admin", "cluster"):
        raise PermissionDeniedError(
            f"a {who.kind} credential does not log in to the dashboard: "
            "log in with the admin token or a cluster's token"
        )
    sid = secrets.token_urlsafe(32)
    csrf = secrets.token_urlsafe(32)
    now = int(time.time())
    with registry.db.transaction() as conn:
        conn.execute(delete(sessions).where(sessions.c.expires < now))
        conn.execute(
            insert(sessions).values(
                sha256=_sha(sid), token_id=who.token_id, csrf=csrf, expires=now + ttl_s
            )
        )
    return sid, Session(who, csrf, _sha(sid), now + ttl_s)


def find(registry: Registry, sid: str) -> Session:
    """The live session of cookie value `sid`, or UnauthenticatedError."""
    if not sid or len(sid) > 100:
        raise UnauthenticatedError("not logged in")
    key = _sha(sid)
    with registry.db.transaction() as conn:
        row = conn.execute(
            select(sessions.c.token_id, sessions.c.csrf, sessions.c.expires).where(
                sessions.c.sha256 == key
            )
        ).first()
    # (its token's state is the access repository's: stasis.controlplane.access)
    token = registry.access.token(row.token_id) if row is not None else None
    if row is None or token is None:
        raise UnauthenticatedError("not logged in")
    token_gone = token["revoked"] is not None or (
        token["expires"] is not None and token["expires"] <= time.time()
    )
    if row.expires < time.time() or token_gone:
        with registry.db.transaction() as conn:
            conn.execute(delete(sessions).where(sessions.c.sha256 == key))
        raise UnauthenticatedError(
            "the session's token was revoked or expired" if token_gone else "the session expired"
        )
    return Session(
        Principal(kind=token["kind"], token_id=row.token_id, cluster_id=token["cluster_id"]),
        row.csrf,
        key,
        int(row.expires),
    )


def end(registry: Registry, session: Session) -> None:
    with registry.db.transaction() as conn:
        conn.execute(delete(sessions).where(sessions.c.sha256 == session.key))
