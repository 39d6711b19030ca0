"""Policies: trigger -> filter -> action, kept in the control plane's database and run by it.

    trigger  every N seconds (`every_s`), or only when called (`every_s` 0: its webhook,
             POST /api/v1/policies/NAME/run, `stasis controlplane policies run NAME`)
    filter   cluster (name), node, label (a glob: `train-*`), user
    action   checkpoint: a leave-running checkpoint of every matching live job;
             retain: on every matching node, each matching label keeps its newest `keep`
             checkpoints, and none older than `older_than_s` but its newest one (the node
             deletes the rest)

A policy's run queues ordinary node commands (stasis.controlplane.registry), marked with its
name; a job that still has a command of the policy under way gets no second one.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from stasis.controlplane.registry import Principal, Registry, validate_name
from stasis.controlplane.schema import commands, policies
from stasis.errors import NotFoundError, UsageError

log = logging.getLogger("stasis.controlplane")
ACTIONS = ("checkpoint", "retain")
FILTERS = ("cluster", "node", "label", "user")
_SYSTEM = Principal(kind="admin", token_id="policy")


def add(registry: Registry, by: Principal, name: str, every_s: int, action: str,
        filters: dict[str, str], keep: int | None, older_than_s: int | None = None
        ) -> dict[str, Any]:
    by.admin_only()
    validate_name(name, "policy name")
    if action not in ACTIONS:
        raise UsageError(f"bad action {action!r}: {' or '.join(ACTIONS)}")
    if every_s < 0:
        raise UsageError("every_s is seconds between runs, or 0 (only when called)")
    if action == "retain" and (keep is None or keep < 1) and not older_than_s:
        raise UsageError("retain needs keep >= 1 (the newest checkpoints each label keeps) "
                         "or older_than_s")
    unknown = sorted(set(filters) - set(FILTERS))
    if unknown:
        raise UsageError(f"bad filter {unknown[0]!r}: {', '.join(FILTERS)}")
    row = {"name": name, "every_s": every_s, "action": action,
           "filters": json.dumps({k: v for k, v in filters.items() if v}),
           "keep": keep, "older_than_s": older_than_s, "enabled": True, "last_run": 0,
           "created": datetime.now(UTC).isoformat(timespec="seconds")}
    try:
        with registry.engine.begin() as conn:
            conn.execute(insert(policies).values(**row))
    except IntegrityError:
        raise UsageError(f"a policy named {name!r} exists already") from None
    return _shown(row)


def remove(registry: Registry, by: Principal, name: str) -> dict[str, Any]:
    by.admin_only()
    with registry.engine.begin() as conn:
        n = conn.execute(delete(policies).where(policies.c.name == name)).rowcount
    if not n:
        raise NotFoundError(f"no policy {name}")
    return {"name": name, "removed": True}


def listed(registry: Registry, by: Principal) -> list[dict[str, Any]]:
    by.admin_only()
    with registry.engine.begin() as conn:
        rows = conn.execute(select(policies).order_by(policies.c.name)).mappings().all()
    return [_shown(dict(r)) for r in rows]


def _shown(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "filters": json.loads(row["filters"])}


def _matches(filters: dict[str, str], job: dict[str, Any]) -> bool:
    return all(job.get(k) is not None and fnmatch.fnmatchcase(str(job[k]), v)
               for k, v in filters.items())


def run_due(registry: Registry, lost_after_s: float) -> int:
    """Every periodic policy whose time has come, run once; how many commands were queued."""
    now = int(time.time())
    with registry.engine.begin() as conn:
        due = [dict(r) for r in conn.execute(select(policies).where(
            policies.c.enabled.is_(True), policies.c.every_s > 0)).mappings().all()
            if now - r["last_run"] >= r["every_s"]]
    return sum(_run(registry, p, lost_after_s, "every") for p in due)


def run_now(registry: Registry, by: Principal, name: str, lost_after_s: float
            ) -> dict[str, Any]:
    """The policy's webhook: run it at once, whatever its period."""
    by.admin_only()
    with registry.engine.begin() as conn:
        row = conn.execute(select(policies).where(policies.c.name == name)).mappings().first()
    if row is None:
        raise NotFoundError(f"no policy {name}")
    return {"name": name, "queued": _run(registry, dict(row), lost_after_s, "webhook")}


def _run(registry: Registry, p: dict[str, Any], lost_after_s: float, why: str) -> int:
    with registry.engine.begin() as conn:
        conn.execute(update(policies).where(policies.c.name == p["name"])
                     .values(last_run=int(time.time())))
    filters = json.loads(p["filters"])
    if p["action"] == "checkpoint":
        queued = _checkpoint_jobs(registry, p["name"], filters)
    else:
        queued = _retain(registry, p["name"], filters, p["keep"], p.get("older_than_s"),
                         lost_after_s)
    if queued:
        registry.event(None, None, "policy-run",
                       f"policy {p['name']} ({why}): {queued} command(s) queued")
    return queued


def _busy(registry: Registry, policy: str) -> set[tuple[str, str]]:
    """(node, job or label) that still have a command of this policy under way."""
    with registry.engine.begin() as conn:
        rows = conn.execute(select(commands.c.node, commands.c.args).where(
            commands.c.state.in_(("queued", "leased")))).all()
    out = set()
    for node, args in rows:
        a = json.loads(args)
        if a.get("policy") == policy:
            out.add((node, str(a.get("job") or a.get("label"))))
    return out


def _checkpoint_jobs(registry: Registry, policy: str, filters: dict[str, str]) -> int:
    busy = _busy(registry, policy)
    n = 0
    for job in registry.list_jobs(_SYSTEM):
        if job.get("state") != "running" or not _matches(filters, job) or \
                (job["node"], job["job"]) in busy:
            continue
        registry.queue(_SYSTEM, "checkpoint", job["job"],
                       {"leave_running": True, "policy": policy})
        n += 1
    return n


def _retain(registry: Registry, policy: str, filters: dict[str, str], keep: int | None,
            older_than_s: int | None, lost_after_s: float) -> int:
    busy = _busy(registry, policy)
    n = 0
    for node in registry.list_nodes(_SYSTEM, lost_after_s):
        if node["state"] == "lost" or (node["name"], filters.get("label", "*")) in busy:
            continue
        if not _matches({k: v for k, v in filters.items() if k in ("cluster", "node")},
                        {"cluster": node["cluster"], "node": node["name"]}):
            continue
        registry.queue_for_node(node["cluster_id"], node["name"], "retain",
                                {"label": filters.get("label", "*"),
                                 "user": filters.get("user"), "keep": keep,
                                 "older_than_s": older_than_s, "policy": policy})
        n += 1
    return n
