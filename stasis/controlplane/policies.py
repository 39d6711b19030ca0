"""Policies: trigger -> filter -> action, kept in the control plane's database and run by it.

    trigger  every N seconds (`every_s`), or only when called (`every_s` 0: its webhook,
             POST /api/v1/policies/NAME/run, `stasis controlplane policies run NAME`);
             every "auto" (checkpoint only): each job it picks at its own interval, Young/Daly
             from the job's measured checkpoint cost and its cluster's interruption rate,
             within the control plane's floor and ceiling, looked at every second
             (stasis.controlplane.intervals; stored as `every_auto`, `every_s` 0);
             memory: a job whose resident memory is above `threshold_pct` of its node's
             (looked at every second; a job is acted on again `every_s` later at the soonest,
             60 s by default); drain: the jobs of a node its scheduler drains or holds for
             maintenance (Slurm's DRAIN, MAINT), each once
    filter   cluster (name), node, label (a glob: `train-*`), user, partition (Kubernetes: the
             namespace), min_age_s (the job has run that long), min_rss_bytes (its size)
    action   checkpoint: a checkpoint of every matching live job, leave-running, or with
             `stop` stopped (a Slurm job: checkpointed and requeued);
             migrate: every matching job of the daemon's own moved to the ready node of its
             cluster with the fewest jobs (a Slurm job: checkpointed and requeued);
             retain: on every matching node, each matching label keeps its newest `keep`
             checkpoints, and none older than `older_than_s` but its newest one, and with
             `completed` none of a label whose last job on that node completed (exit 0) and
             that runs nowhere in the cluster (the node deletes them);
             verify: for each matching (cluster, user, label), its newest checkpoint not
             verified yet and newer than its newest verified one, verified (`stasis verify`:
             restored in a sandbox, then removed) by the node that took it, if that node is
             ready; at low priority: a node leases a verify only when no other command waits,
             and carries out one at a time (stasis.controlplane.node). The verdict is kept
             with the checkpoint (stasis.controlplane.verdicts). Its filters are cluster, node
             (the checkpoint's), label and user; a verify policy runs every N s or when called

A policy's run queues ordinary node commands (stasis.controlplane.registry), marked with its
name; a job that still has a command of the policy under way gets no second one.

Policies are edited in place (`edit`: only what is named changes, checked as a new one is). A
period below the control plane's floor (`MIN_INTERVAL_S`, `serve --min-interval`) is refused. A
webhook policy has a hook token of its own (`stasis_hook_...`, made when it is added or by
`rotate_hook`, shown once, its SHA-256 kept): it runs that policy and is refused everywhere else.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, NoReturn, cast

from sqlalchemy import delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from stasis.controlplane import events as event_log
from stasis.controlplane import intervals, wire
from stasis.controlplane.access import HOOK_PREFIX, Principal, validate_name
from stasis.controlplane.registry import Registry
from stasis.controlplane.routes import RUN_POLICY
from stasis.controlplane.schema import policies
from stasis.errors import NotFoundError, PermissionDeniedError, UnauthenticatedError, UsageError

log = logging.getLogger("stasis.controlplane")
ACTIONS = ("checkpoint", "retain", "migrate", "verify")
TRIGGERS = ("every", "memory", "drain")
GLOB_FILTERS = ("cluster", "node", "label", "user", "partition")
NUMBER_FILTERS = ("min_age_s", "min_rss_bytes")
FILTERS = GLOB_FILTERS + NUMBER_FILTERS
_VERIFY_FILTERS = ("cluster", "node", "label", "user")  # a checkpoint's
_SYSTEM = Principal(kind="admin", token_id="policy")
# The shortest period a policy may have unless the control plane is served with another floor
# (`serve --min-interval`): a dump freezes its job, and one a few seconds apart leaves it little
# time to run.
MIN_INTERVAL_S = 60
EDITABLE = (
    "every_s",
    "action",
    "filters",
    "keep",
    "older_than_s",
    "trigger",
    "threshold_pct",
    "stop",
    "completed",
    "enabled",
)
_MEMORY_COOLDOWN_S = 60
# The ceiling on an `every auto` interval unless served with another (`serve --max-interval`).
MAX_INTERVAL_S = 86400
AUTO = "auto"
_HELD = ("DRAIN", "MAINT")  # in Slurm's node state: the node is being emptied


def add(
    registry: Registry,
    by: Principal,
    name: str,
    every_s: int | str,
    action: str,
    filters: dict[str, str],
    keep: int | None,
    older_than_s: int | None = None,
    trigger: str = "every",
    threshold_pct: float | None = None,
    stop: bool = False,
    completed: bool = False,
    min_interval_s: int = MIN_INTERVAL_S,
) -> wire.Policy:
    """A new policy; a webhook one (every_s 0) with its hook token, shown this once."""
    by.admin_only()
    validate_name(name, "policy name")
    row = {
        "name": name,
        "every_s": 0 if every_s == AUTO else every_s,
        "every_auto": every_s == AUTO,
        "action": action,
        "filters": {k: str(v) for k, v in filters.items() if v},
        "keep": keep,
        "older_than_s": older_than_s,
        "trigger": trigger,
        "threshold_pct": threshold_pct,
        "stop": stop,
        "completed": completed,
    }
    _check(row, min_interval_s)
    token = new_hook_token() if _webhook(row) else None
    row.update(
        filters=json.dumps(row["filters"]),
        enabled=True,
        last_run=0,
        created=_now(),
        hook_sha256=_sha(token) if token else None,
        hook_created=_now() if token else None,
    )
    try:
        with registry.db.transaction() as conn:
            conn.execute(insert(policies).values(**row))
    except IntegrityError:
        raise UsageError(f"a policy named {name!r} exists already") from None
    shown = _shown(row)
    if token:
        shown["hook_token"] = token
    return shown


def edit(
    registry: Registry,
    by: Principal,
    name: str,
    changes: dict[str, Any],
    min_interval_s: int = MIN_INTERVAL_S,
) -> wire.Policy:
    """Only what `changes` names changes (its `filters` are merged in, an empty value removes
    one); the result is checked as a new policy would be, and nothing changes if it fails.
    A policy that becomes a webhook one without a hook token gets one, shown this once."""
    by.admin_only()
    unknown = sorted(set(changes) - set(EDITABLE))
    if unknown:
        raise UsageError(f"cannot edit {unknown[0]!r} of a policy: {', '.join(EDITABLE)}")
    if "every_s" in changes:  # "auto", or a period (which ends auto)
        auto = changes["every_s"] == AUTO
        changes = {**changes, "every_s": 0 if auto else changes["every_s"], "every_auto": auto}
    with registry.db.transaction() as conn:
        found = (
            conn.execute(select(policies).where(policies.c.name == name).with_for_update())
            .mappings()
            .first()
        )
        if found is None:
            raise NotFoundError(f"no policy {name}")
        old = {**dict(found), "filters": json.loads(found["filters"])}
        new = {**old, **{k: v for k, v in changes.items() if k != "filters"}}
        merged = {**old["filters"], **{k: v for k, v in (changes.get("filters") or {}).items()}}
        new["filters"] = {k: str(v) for k, v in merged.items() if v not in (None, "")}
        # The floor is the one in force now; an untouched period set under an older one stays.
        _check(new, min_interval_s if {"every_s", "trigger"} & set(changes) else 0)
        token = new_hook_token() if _webhook(new) and not old["hook_sha256"] else None
        if token:
            new.update(hook_sha256=_sha(token), hook_created=_now())
        said = [
            f"{k} {_said(old[k])} -> {_said(new[k])}"
            for k in (*EDITABLE, "every_auto")
            if old[k] != new[k]
        ]
        conn.execute(
            update(policies)
            .where(policies.c.name == name)
            .values(
                **{k: new[k] for k in EDITABLE if k != "filters"},
                every_auto=new["every_auto"],
                filters=json.dumps(new["filters"]),
                hook_sha256=new["hook_sha256"],
                hook_created=new["hook_created"],
            )
        )
        if said:
            event_log.record(
                conn, None, None, "policy-edited", f"policy {name} edited: {'; '.join(said)}"
            )
    shown = _shown({**new, "filters": json.dumps(new["filters"])})
    if token:
        shown["hook_token"] = token
    return shown


def rotate_hook(registry: Registry, by: Principal, name: str) -> wire.HookRotated:
    """A new hook token for the policy (shown this once); the old one stops working."""
    by.admin_only()
    token = new_hook_token()
    with registry.db.transaction() as conn:
        n = conn.execute(
            update(policies)
            .where(policies.c.name == name)
            .values(hook_sha256=_sha(token), hook_created=_now())
        ).rowcount
    if not n:
        raise NotFoundError(f"no policy {name}")
    return {"name": name, "hook_token": token}


def refuse_hook(registry: Registry, token: str) -> NoReturn:
    """Hook token `token`, refused anywhere but its policy's run (its route checks it)."""
    with registry.db.transaction() as conn:
        hook = conn.execute(
            select(policies.c.name).where(policies.c.hook_sha256 == _sha(token))
        ).first()
    if hook is None:
        raise UnauthenticatedError("unknown token")
    raise PermissionDeniedError(
        f"this is the hook token of policy {hook.name}: it runs that policy only "
        f"({RUN_POLICY.method} {RUN_POLICY.url(name=hook.name)})"
    )


def new_hook_token() -> str:
    return HOOK_PREFIX + secrets.token_urlsafe(32)


def _webhook(row: dict[str, Any]) -> bool:
    return row["trigger"] == "every" and not row["every_s"] and not row.get("every_auto")


def _said(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, dict) else str(value)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _check(p: dict[str, Any], min_interval_s: int) -> None:
    """What add and edit both refuse, each with one line."""
    action, trigger, every_s = p["action"], p["trigger"], p["every_s"]
    filters, keep, threshold_pct = p["filters"], p["keep"], p["threshold_pct"]
    if action not in ACTIONS:
        raise UsageError(f"bad action {action!r}: {', '.join(ACTIONS)}")
    if trigger not in TRIGGERS:
        raise UsageError(f"bad trigger {trigger!r}: {', '.join(TRIGGERS)}")
    if not isinstance(every_s, int) or every_s < 0:
        raise UsageError(
            "every_s is seconds between runs, 0 (only when called) or auto (each job at "
            "its own interval)"
        )
    if p.get("every_auto") and (trigger != "every" or action != "checkpoint"):
        raise UsageError(
            f"every auto checkpoints each job at its own interval: it takes the checkpoint "
            f"action and no --on (not {action}"
            + (f" on {trigger}" if trigger != "every" else "")
            + "); give --every N for the others"
        )
    if 0 < every_s < min_interval_s and trigger != "drain":
        # A checkpoint every few seconds freezes the jobs it picks most of the time.
        raise UsageError(
            f"every {every_s} s is below this control plane's floor of "
            f"{min_interval_s} s between runs (serve --min-interval)"
        )
    if (
        action == "retain"
        and (keep is None or keep < 1)
        and not p["older_than_s"]
        and not p["completed"]
    ):
        raise UsageError(
            "retain needs keep >= 1 (the newest checkpoints each label keeps), "
            "older_than_s or completed"
        )
    if trigger != "every" and action in ("retain", "verify"):
        raise UsageError(f"a {trigger} trigger takes the checkpoint or migrate action")
    if action == "verify":
        if p["stop"]:
            raise UsageError(
                "verify stops no job (it restores a checkpoint in a sandbox): " "leave out stop"
            )
        jobs_only = sorted(set(filters) - set(_VERIFY_FILTERS))
        if jobs_only:
            raise UsageError(
                f"filter {jobs_only[0]!r} picks jobs; verify picks checkpoints "
                f"by {', '.join(_VERIFY_FILTERS)}"
            )
    if trigger == "memory" and (threshold_pct is None or not 0 < threshold_pct <= 100):
        raise UsageError("a memory trigger needs threshold_pct, above 0 and at most 100")
    unknown = sorted(set(filters) - set(FILTERS))
    if unknown:
        raise UsageError(f"bad filter {unknown[0]!r}: {', '.join(FILTERS)}")
    for key in NUMBER_FILTERS:
        if filters.get(key) and not str(filters[key]).isdigit():
            raise UsageError(f"filter {key}: a whole number, not {filters[key]!r}")


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def remove(registry: Registry, by: Principal, name: str) -> wire.PolicyRemoved:
    by.admin_only()
    with registry.db.transaction() as conn:
        n = conn.execute(delete(policies).where(policies.c.name == name)).rowcount
    if not n:
        raise NotFoundError(f"no policy {name}")
    return {"name": name, "removed": True}


def listed(registry: Registry, by: Principal) -> list[wire.Policy]:
    by.admin_only()
    with registry.db.transaction() as conn:
        rows = conn.execute(select(policies).order_by(policies.c.name)).mappings().all()
    return [_shown(dict(r)) for r in rows]


def _shown(row: dict[str, Any]) -> wire.Policy:
    """A policy as the API shows it: its hook token's hash never, whether it has one."""
    shown = {k: v for k, v in row.items() if k not in ("hook_sha256", "every_auto")}
    return cast(
        wire.Policy,
        {
            **shown,
            "every_s": AUTO if row.get("every_auto") else row["every_s"],
            "filters": json.loads(row["filters"]),
            "hook": bool(row["hook_sha256"]),
        },
    )


def _matches(filters: dict[str, str], job: Mapping[str, Any], now: float | None = None) -> bool:
    for key, value in filters.items():
        if key == "min_age_s":
            started = job.get("started")
            try:
                begun = datetime.fromisoformat(str(started)).timestamp() if started else None
            except ValueError:
                begun = None
            if begun is None or (now or time.time()) - begun < int(value):
                return False
        elif key == "min_rss_bytes":
            if int(job.get("rss_bytes") or 0) < int(value):
                return False
        elif job.get(key) is None or not fnmatch.fnmatchcase(str(job[key]), value):
            return False
    return True


def run_due(
    registry: Registry,
    lost_after_s: float,
    bounds: intervals.Bounds = intervals.Bounds(MIN_INTERVAL_S, MAX_INTERVAL_S),
) -> int:
    """Every periodic policy whose time has come, run once, and every memory, drain and
    `every auto` policy looked at; how many commands were queued."""
    now = int(time.time())
    with registry.db.transaction() as conn:
        rows = [
            dict(r)
            for r in conn.execute(select(policies).where(policies.c.enabled.is_(True)))
            .mappings()
            .all()
        ]
    due = [
        r
        for r in rows
        if r["trigger"] == "every" and r["every_s"] > 0 and now - r["last_run"] >= r["every_s"]
    ]
    watching = [r for r in rows if r["trigger"] in ("memory", "drain")]
    auto = [r for r in rows if r["trigger"] == "every" and r["every_auto"]]
    return (
        sum(_run(registry, p, lost_after_s, "every") for p in due)
        + sum(_watch(registry, p, lost_after_s) for p in watching)
        + sum(_auto(registry, p, lost_after_s, bounds) for p in auto)
    )


def run_now(
    registry: Registry,
    by: Principal,
    name: str,
    lost_after_s: float,
    bounds: intervals.Bounds = intervals.Bounds(MIN_INTERVAL_S, MAX_INTERVAL_S),
) -> wire.PolicyRun:
    """The policy's webhook: run it at once, whatever its period (an `every auto` one: the
    jobs whose interval has passed)."""
    by.admin_only()
    with registry.db.transaction() as conn:
        row = conn.execute(select(policies).where(policies.c.name == name)).mappings().first()
    if row is None:
        raise NotFoundError(f"no policy {name}")
    return _called(registry, dict(row), lost_after_s, bounds)


def run_hook(
    registry: Registry,
    token: str,
    name: str,
    lost_after_s: float,
    bounds: intervals.Bounds = intervals.Bounds(MIN_INTERVAL_S, MAX_INTERVAL_S),
) -> wire.PolicyRun:
    """The policy's webhook called with its own hook token (which runs no other policy)."""
    with registry.db.transaction() as conn:
        row = conn.execute(select(policies).where(policies.c.name == name)).mappings().first()
    # One answer whether the policy is missing or the token is another's: a hook token's
    # holder learns nothing of the other policies.
    if (
        row is None
        or not row["hook_sha256"]
        or not hmac.compare_digest(row["hook_sha256"], _sha(token))
    ):
        raise UnauthenticatedError(f"not the hook token of policy {name}")
    return _called(registry, dict(row), lost_after_s, bounds)


def _called(
    registry: Registry, p: dict[str, Any], lost_after_s: float, bounds: intervals.Bounds
) -> wire.PolicyRun:
    if not p["enabled"]:
        raise UsageError(
            f"policy {p['name']} is disabled (`policies edit {p['name']} " "--enable`)"
        )
    if p.get("every_auto"):
        return {"name": p["name"], "queued": _auto(registry, p, lost_after_s, bounds)}
    return {"name": p["name"], "queued": _run(registry, p, lost_after_s, "webhook")}


def _run(registry: Registry, p: dict[str, Any], lost_after_s: float, why: str) -> int:
    if p.get("trigger") in ("memory", "drain"):
        return _watch(registry, p, lost_after_s)  # called: what meets its trigger now
    with registry.db.transaction() as conn:
        conn.execute(
            update(policies).where(policies.c.name == p["name"]).values(last_run=int(time.time()))
        )
    filters = json.loads(p["filters"])
    if p["action"] in ("checkpoint", "migrate"):
        queued = _checkpoint_jobs(
            registry,
            p["name"],
            filters,
            bool(p.get("stop")),
            migrate=p["action"] == "migrate",
            lost_after_s=lost_after_s,
        )
    elif p["action"] == "verify":
        queued = _verify(registry, p["name"], filters, lost_after_s)
    else:
        queued = _retain(
            registry,
            p["name"],
            filters,
            p["keep"],
            p.get("older_than_s"),
            lost_after_s,
            bool(p.get("completed")),
        )
    if queued:
        _ran(registry, p["name"], why, queued)
    return queued


def _ran(registry: Registry, policy: str, why: str, queued: int) -> None:
    event_log.add(
        registry.db,
        None,
        None,
        "policy-run",
        f"policy {policy} ({why}): {queued} command(s) queued",
    )


def _busy(registry: Registry, policy: str, since: float | None = None) -> set[tuple[str, str, str]]:
    """(cluster, node, job or label) that still have a command of this policy under way (or,
    with `since`, had one created since then): nodes of two clusters may share a name."""
    out = set()
    for cluster_id, node, a in registry.commands.commands_under_way(created_since=since):
        if a.get("policy") == policy:
            out.add((cluster_id, node, str(a.get("job") or a.get("label"))))
    return out


def _checkpoint_jobs(
    registry: Registry,
    policy: str,
    filters: dict[str, str],
    stop: bool = False,
    only: Any = None,
    since: float | None = None,
    migrate: bool = False,
    lost_after_s: float = float("inf"),
) -> int:
    busy = _busy(registry, policy, since)
    n = 0
    now = time.time()
    listed = registry.nodes.list_nodes(_SYSTEM, lost_after_s)
    ready = [x for x in listed if x["state"] == "ready"] if migrate else []
    # A pending node (joined, not approved by an admin) is given no command: its jobs wait.
    pending = {(x["cluster_id"], x["name"]) for x in listed if x["state"] == "pending"}
    for job in registry.nodes.list_jobs(_SYSTEM):
        if (
            (job["cluster_id"], job["node"]) in pending
            or job.get("state") not in ("running", "restored")
            or not _matches(filters, job, now)
            or (job["cluster_id"], job["node"], job["job"]) in busy
            or (only is not None and not only(job))
        ):
            continue
        if migrate and (job.get("kind") or "daemon") == "daemon":
            # To the ready node of its cluster with the fewest jobs; none: it stays.
            others = [
                x
                for x in ready
                if x["cluster_id"] == job["cluster_id"] and x["name"] != job["node"]
            ]
            if not others:
                continue
            to = min(others, key=lambda x: (int(x["jobs"]), x["name"]))
            to["jobs"] = int(to["jobs"]) + 1
            registry.migrate_job(
                _SYSTEM,
                job["job"],
                to["name"],
                {"policy": policy},
                job["cluster_id"],
                job["node"],
                lost_after_s,
            )
        else:  # a scheduler's job moves by requeue
            registry.queue(
                _SYSTEM,
                "checkpoint",
                job["job"],
                {"leave_running": not (stop or migrate), "policy": policy},
                job["cluster_id"],
                job["node"],
            )
        n += 1
    return n


def _watch(registry: Registry, p: dict[str, Any], lost_after_s: float) -> int:
    """A memory or drain policy: the jobs that meet its trigger now."""
    filters = json.loads(p["filters"])
    state = registry.nodes.node_states()
    if p["trigger"] == "memory":

        def over(job: dict[str, Any]) -> bool:
            total = state.get((job["cluster_id"], job["node"]), (None, ""))[0]
            if not total:
                return False
            return 100.0 * int(job.get("rss_bytes") or 0) / total >= float(p["threshold_pct"])

        cooldown = p["every_s"] or _MEMORY_COOLDOWN_S
        queued = _checkpoint_jobs(
            registry,
            p["name"],
            filters,
            p["stop"],
            over,
            since=time.time() - cooldown,
            migrate=p["action"] == "migrate",
            lost_after_s=lost_after_s,
        )
        why = f"memory above {p['threshold_pct']:g}%"
    else:

        def held(job: dict[str, Any]) -> bool:
            s = state.get((job["cluster_id"], job["node"]), (None, ""))[1].upper()
            return any(word in s for word in _HELD)

        queued = _checkpoint_jobs(
            registry,
            p["name"],
            filters,
            p["stop"],
            held,
            since=0,
            migrate=p["action"] == "migrate",
            lost_after_s=lost_after_s,
        )
        why = "node drained or in maintenance"
    if queued:
        with registry.db.transaction() as conn:
            conn.execute(
                update(policies)
                .where(policies.c.name == p["name"])
                .values(last_run=int(time.time()))
            )
        _ran(registry, p["name"], why, queued)
    return queued


def _auto(
    registry: Registry, p: dict[str, Any], lost_after_s: float, bounds: intervals.Bounds
) -> int:
    """An `every auto` policy: a checkpoint of each job it picks whose own interval has
    passed since its newest checkpoint (or this policy's last command for it, or its start)."""
    now = time.time()
    rates = intervals.rates(registry, now)
    costs = intervals.costs(registry, now)
    queued_at = intervals.last_commands(
        registry, p["name"], now - max(bounds.floor_s, bounds.ceiling_s) - 1
    )

    def due(job: dict[str, Any]) -> bool:
        chosen = intervals.for_job(job, rates, costs, bounds, p["name"])
        age = job.get("last_checkpoint_age_s")
        since = [
            now - float(age) if age is not None else None,
            queued_at.get((job["cluster_id"], job["node"], str(job["job"]))),
            _started(job),
        ]
        known = [t for t in since if t is not None]
        return not known or now - max(known) >= chosen["interval_s"]

    queued = _checkpoint_jobs(
        registry,
        p["name"],
        json.loads(p["filters"]),
        bool(p.get("stop")),
        due,
        lost_after_s=lost_after_s,
    )
    if queued:
        with registry.db.transaction() as conn:
            conn.execute(
                update(policies).where(policies.c.name == p["name"]).values(last_run=int(now))
            )
        event_log.add(
            registry.db,
            None,
            None,
            "policy-run",
            f"policy {p['name']} (auto: each job's interval passed): {queued} command(s) queued",
        )
    return queued


def _started(job: dict[str, Any]) -> float | None:
    try:
        return (
            datetime.fromisoformat(str(job["started"])).timestamp() if job.get("started") else None
        )
    except ValueError:
        return None


def annotate_intervals(registry: Registry, jobs: list[wire.Job], bounds: intervals.Bounds) -> None:
    """Each job the first enabled `every auto` policy (by name) picks gets `interval`: its
    interval now and why (stasis.controlplane.intervals.for_job); a job a node reported an
    interval for (`interval_s`, `interval_why`: its own `STASIS_INTERVAL`) keeps that."""
    with registry.db.transaction() as conn:
        auto = [
            dict(r)
            for r in conn.execute(
                select(policies)
                .where(policies.c.enabled.is_(True), policies.c.every_auto.is_(True))
                .order_by(policies.c.name)
            )
            .mappings()
            .all()
        ]
    now = time.time()
    rates = intervals.rates(registry, now) if auto else {}
    costs = intervals.costs(registry, now) if auto else {}
    for job in jobs:
        picked = next((p for p in auto if _matches(json.loads(p["filters"]), job, now)), None)
        if picked is not None:
            job["interval"] = intervals.for_job(job, rates, costs, bounds, picked["name"])
        elif job.get("interval_s") is not None:
            job["interval"] = {
                "source": "node",
                "interval_s": job["interval_s"],
                "why": job.get("interval_why") or "",
            }


def _retain(
    registry: Registry,
    policy: str,
    filters: dict[str, str],
    keep: int | None,
    older_than_s: int | None,
    lost_after_s: float,
    completed: bool = False,
) -> int:
    busy = _busy(registry, policy)
    n = 0
    jobs = registry.nodes.list_jobs(_SYSTEM) if completed else []
    for node in registry.nodes.list_nodes(_SYSTEM, lost_after_s):
        if (
            node["state"] in ("lost", "pending")
            or (node["cluster_id"], node["name"], filters.get("label", "*")) in busy
        ):
            continue
        if not _matches(
            {k: v for k, v in filters.items() if k in ("cluster", "node")},
            {"cluster": node["cluster"], "node": node["name"]},
        ):
            continue
        registry.commands.queue_for_node(
            node["cluster_id"],
            node["name"],
            "retain",
            {
                "label": filters.get("label", "*"),
                "user": filters.get("user"),
                "keep": keep,
                "older_than_s": older_than_s,
                "policy": policy,
                "completed": completed,
                # what runs on another node of the cluster is not
                # completed (the node knows its own jobs best)
                "live": sorted(
                    {
                        (str(j.get("user")), str(j.get("label")))
                        for j in jobs
                        if j["cluster_id"] == node["cluster_id"] and j["node"] != node["name"]
                    }
                ),
            },
        )
        n += 1
    return n


def _verify(registry: Registry, policy: str, filters: dict[str, str], lost_after_s: float) -> int:
    """A verify command for each matching (cluster, user, label) whose newest checkpoint
    not verified yet is newer than its newest verified one: sent to the node that took it,
    if that node is ready; none for a label with a verify under way (of any policy). After a
    failed verdict the next run takes the next older one, down to the newest that restores."""
    ready = {
        (x["cluster_id"], x["name"])
        for x in registry.nodes.list_nodes(_SYSTEM, lost_after_s)
        if x["state"] == "ready"
    }
    names = registry.access.cluster_names()
    under_way = registry.commands.commands_under_way("verify")
    rows = registry.reports.live_checkpoints()
    busy = {(cluster_id, str(a.get("user")), str(a.get("label"))) for cluster_id, _, a in under_way}
    settled: set[tuple[str, str, str]] = set()  # labels with a verified or a picked one
    n = 0
    for r in rows:  # newest first
        key = (r.cluster_id, r.user, r.label)
        if key in settled:
            continue
        if r.verified_ok:
            settled.add(key)  # it restores: nothing older is worth verifying
            continue
        if r.verified_ok is not None:
            continue  # failed: an older one may restore
        if not _matches(
            filters,
            {"cluster": names.get(r.cluster_id), "node": r.node, "label": r.label, "user": r.user},
        ):
            continue
        settled.add(key)
        if (r.cluster_id, r.node) not in ready or key in busy:
            continue
        registry.commands.queue_for_node(
            r.cluster_id,
            r.node,
            "verify",
            {"checkpoint": r.id, "label": r.label, "user": r.user, "policy": policy},
        )
        n += 1
    return n
