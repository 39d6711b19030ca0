"""`stasis controlplane serve`: the control plane's HTTP API (aiohttp).

    GET  /api/v1/health                    no token
    POST /api/v1/clusters                  admin: {name, kind} -> {cluster_id, token, ...}
    GET  /api/v1/clusters                  admin
    POST /api/v1/clusters/{id}/rotate      admin: a new cluster token, the old ones revoked
    GET  /api/v1/tokens                    admin: ids, kinds, clusters, revoked (never tokens)
    POST /api/v1/tokens/{id}/revoke        admin
    POST /api/v1/nodes/register            cluster token: a node joins (its versions and
                                           check) and gets its own credential, `node_token`,
                                           shown once; refused (409) for a name that has one.
                                           The node's credential: its own report again
    POST /api/v1/nodes/{name}/reset        admin: {cluster}: the node's credential forgotten,
                                           so that the node joins again
    POST /api/v1/nodes/{name}/heartbeat    the node's credential: {jobs: [its jobs],
                                           activity, verdicts: [stasis verify's verdicts]}
    GET  /api/v1/nodes                     admin: every node; a cluster token: its own
    GET  /api/v1/jobs                      the jobs the nodes last reported (same scoping)
    POST /api/v1/commands                  admin: {kind: checkpoint, job, leave_running,
                                           cluster, node}: a job id several nodes report is
                                           refused (409) unless cluster and node are given
    GET  /api/v1/commands[/{id}]           the commands and their results (same scoping)
    POST /api/v1/nodes/{name}/commands/lease   the node's credential: its next command (with
                                           its `lease_id`) or null
    POST /api/v1/nodes/{name}/commands/{id}/renew   the node's credential: {lease_id}: the
                                           lease of a command the node is still carrying
                                           out, extended
    POST /api/v1/nodes/{name}/commands/{id}/commit   the node's credential: {lease_id}: the
                                           restore it holds may resume its job (a fence:
                                           409 once the command was failed, re-targeted)
    POST /api/v1/commands/{id}/ack         the credential of the node holding the lease:
                                           {lease_id, ok, result}
    POST /api/v1/migrations                admin: {job, to, cluster, node}: checkpoint and
                                           stop it on its
                                           node, then restore it on `to` (the checkpoint
                                           command's result names the restore's as `next`)
    POST /api/v1/nodes/{name}/drain        admin: {reason, cluster}: every live job of the
                                           node migrated to the
                                           other ready nodes of its cluster
    GET|POST /api/v1/policies, PATCH|DELETE /api/v1/policies/{name}   admin
                                           (stasis.controlplane.policies; PATCH: only the
                                           fields given change)
    POST /api/v1/policies/{name}/rotate-hook   admin: a new hook token for the policy
    GET  /metrics                          admin: Prometheus metrics (stasis.controlplane.metrics)
    GET  /api/v1/events[?limit=N]          what happened, oldest first (same scoping as nodes)
    GET  /api/v1/checkpoints[?limit=N&deleted=1]   the checkpoints the nodes reported, newest
                                           first: size, CRIU's time, frozen time, store, and
                                           the verdict of `stasis verify` (`verdict`: null or
                                           {ok, reason, node, at, duration_s, processes};
                                           `verified`: ok | failed: REASON | not verified)
    POST /api/v1/checkpoints/{id}/verify   admin: a verify command for it, to the node that
                                           took it (its result: the verdict, also kept with
                                           the checkpoint)
    GET  /api/v1/savings                   node-hours of work kept by restores: in all, per
                                           cluster, user and day
    POST /api/v1/policies/{name}/run       admin, or that policy's own hook token
                                           (stasis_hook_...): run it now (its webhook)
    GET  /install/kubernetes               a kubernetes cluster's token: the helm command that
                                           installs the chart connected to this control plane
    GET  /install/slurm                    a slurm cluster's token: the node installer script
                                           (stasis.controlplane.installer), for `| sudo -E bash`
    GET  /install/stasis.whl               a slurm cluster's token: the wheel it installs

The dashboard's pages live under /ui/ (stasis.controlplane.dashboard: log in with a token, a
session cookie after). Every API request but health carries `Authorization: Bearer <token>`;
errors are one JSON line {"error": {"type": CLASS, "message": "..."}} with the status of their
class (stasis.errors: the client raises that class again). Plain HTTP only on
loopback unless allowed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stasis.controlplane import policies
from stasis.controlplane.registry import (
    CHECKPOINT_ID,
    HOOK_PREFIX,
    JOB_ID,
    LABEL,
    USER,
    Principal,
    Registry,
    safe_url,
)
from stasis.controlplane.verdicts import VerdictReport
from stasis.errors import StasisError, UnauthenticatedError, UsageError, wire_name

log = logging.getLogger("stasis.controlplane")
MAX_BODY_BYTES = 1 << 20
REGISTRY = web.AppKey("registry", Registry)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NewCluster(_Model):
    name: str = Field(max_length=100)
    kind: Literal["slurm", "kubernetes"]
    expires_in_s: int | None = Field(default=None, ge=1, le=10 * 366 * 86400)
    # Its nodes wait for an admin's approval once joined (stasis.controlplane.registry).
    approve_joins: bool = False


class ClusterSettings(_Model):
    approve_joins: bool


class Rotation(_Model):
    expires_in_s: int | None = Field(default=None, ge=1, le=10 * 366 * 86400)


# What nodes send is checked here, by charset and length, before it reaches a form, a path, a
# log or a command (registry's patterns for ids). Free text (problems, hosts, versions) is
# printable characters only.
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
_TEXT = r"^[^\x00-\x1f\x7f]*$"
_WORD = r"^[A-Za-z0-9._:+ -]*$"
# A node's scheduler state: Slurm's (MIXED+DRAIN) or a Kubernetes node's as kubectl shows it
# (Ready,SchedulingDisabled+DRAIN).
_STATE = r"^[A-Za-z0-9._:+, -]*$"


class NodeReport(_Model):
    name: str = Field(pattern=_NAME)
    cluster_id: str | None = Field(default=None, max_length=40, pattern=_NAME)
    host: str = Field(max_length=200, pattern=_TEXT)
    stasis_version: str = Field(max_length=60, pattern=_TEXT)
    criu_version: str | None = Field(default=None, max_length=60, pattern=_TEXT)
    slurm_version: str | None = Field(default=None, max_length=60, pattern=_TEXT)
    check_ok: bool
    problems: list[Annotated[str, Field(max_length=1000, pattern=_TEXT)]] = Field(
        default_factory=list, max_length=50
    )
    jobs: int = Field(default=0, ge=0)


class JobReport(_Model):
    job: str = Field(pattern=JOB_ID)
    label: str | None = Field(default=None, pattern=LABEL)
    user: str | None = Field(default=None, pattern=USER)
    state: str = Field(max_length=40, pattern=_WORD)
    restored_from: str | None = Field(default=None, pattern=CHECKPOINT_ID)
    started: str | None = Field(default=None, max_length=40, pattern=_WORD)
    kind: str = Field(default="daemon", max_length=20, pattern=_NAME)  # daemon | slurm | ...
    partition: str | None = Field(default=None, max_length=100, pattern=_WORD)
    rss_bytes: int = Field(default=0, ge=0)


class ActivityReport(_Model):
    """A checkpoint or restore of the node (stasis.daemon.activity.Activity)."""

    kind: Literal["checkpoint", "restore"]
    checkpoint: str = Field(pattern=CHECKPOINT_ID)
    label: str = Field(pattern=LABEL)
    job: str = Field(pattern=JOB_ID)
    user: str = Field(pattern=USER)
    size_bytes: int = Field(ge=0)
    stored_size_bytes: int = Field(default=0, ge=0)
    work_s: float = Field(ge=0)
    duration_s: float = Field(ge=0)
    frozen_s: float = Field(default=0.0, ge=0)
    leave_running: bool = True
    store: str = Field(default="", max_length=500, pattern=_TEXT)
    reason: str = Field(default="", max_length=60, pattern=_WORD)
    at: float = Field(gt=0)


class Heartbeat(_Model):
    jobs: list[JobReport] = Field(default_factory=list, max_length=10_000)
    activity: list[ActivityReport] = Field(default_factory=list, max_length=1000)
    mem_total_bytes: int | None = Field(default=None, ge=0)
    scheduler_state: str | None = Field(default=None, max_length=60, pattern=_STATE)
    # Verdicts of `stasis verify` the node reached (kept for its own cluster's checkpoints).
    verdicts: list[VerdictReport] = Field(default_factory=list, max_length=1000)


class NewCommand(_Model):
    kind: Literal["checkpoint"]
    job: str = Field(pattern=JOB_ID)
    leave_running: bool = True
    cluster: str | None = Field(default=None, pattern=_NAME)  # its id or name
    node: str | None = Field(default=None, pattern=_NAME)


class Drain(_Model):
    reason: str = Field(default="stasis drain", max_length=60, pattern=r"^[A-Za-z0-9 ._:-]*$")
    cluster: str | None = Field(default=None, pattern=_NAME)


class Migration(_Model):
    job: str = Field(pattern=JOB_ID)
    to: str = Field(pattern=_NAME)
    cluster: str | None = Field(default=None, pattern=_NAME)
    node: str | None = Field(default=None, pattern=_NAME)


class NodeReset(_Model):
    cluster: str | None = Field(default=None, pattern=_NAME)


class Renewal(_Model):
    lease_id: str = Field(default="", max_length=40)


class NewPolicy(_Model):
    name: str = Field(max_length=100)
    every_s: int = Field(ge=0, le=366 * 86400)  # 0: only when its webhook is called
    action: Literal["checkpoint", "retain", "migrate", "verify"]
    filters: dict[str, str] = Field(default_factory=dict, max_length=len(policies.FILTERS))
    keep: int | None = Field(default=None, ge=1, le=100_000)
    older_than_s: int | None = Field(default=None, ge=1)
    trigger: Literal["every", "memory", "drain"] = "every"
    threshold_pct: float | None = Field(default=None, gt=0, le=100)
    stop: bool = False  # checkpoint: and stop the job (a Slurm job: requeued)
    completed: bool = False  # retain: the checkpoints of labels whose job completed


class PolicyEdit(_Model):
    """What PATCH /api/v1/policies/NAME changes: only the fields given (NewPolicy's rules);
    `filters` are merged in, an empty or null value removes one."""

    every_s: int | None = Field(default=None, ge=0, le=366 * 86400)
    action: Literal["checkpoint", "retain", "migrate", "verify"] | None = None
    filters: dict[str, str | None] | None = Field(default=None, max_length=len(policies.FILTERS))
    keep: int | None = Field(default=None, ge=1, le=100_000)
    older_than_s: int | None = Field(default=None, ge=1)
    trigger: Literal["every", "memory", "drain"] | None = None
    threshold_pct: float | None = Field(default=None, gt=0, le=100)
    stop: bool | None = None
    completed: bool | None = None
    enabled: bool | None = None

    def changes(self) -> dict[str, Any]:
        """The fields the request gave (null for keep/older_than_s/threshold_pct: unset)."""
        given = self.model_dump(exclude_unset=True)
        for key in ("every_s", "action", "trigger", "stop", "completed", "enabled"):
            if key in given and given[key] is None:
                raise UsageError(f"bad request: {key}: cannot be null")
        return given


class Ack(_Model):
    lease_id: str = Field(default="", max_length=40)
    ok: bool
    result: dict[str, Any] = Field(default_factory=dict)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(e: StasisError) -> web.Response:
    """The one error envelope of stasis's APIs (stasis.errors.wire_name names its class)."""
    return web.json_response(
        {"error": {"type": wire_name(e), "message": str(e)}}, status=e.http_status
    )


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except StasisError as e:
        return _error(e)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        return _error(UsageError(f"bad request: {where}: {first['msg']}"))
    except web.HTTPRequestEntityTooLarge:
        too_large = UsageError(f"request body over {MAX_BODY_BYTES} bytes")
        too_large.http_status = 413
        return _error(too_large)


def _bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise UnauthenticatedError(
            "no token: send `Authorization: Bearer stasis_...` " "(STASIS_AUTH_TOKEN)"
        )
    return token.strip()


def _principal(request: web.Request) -> Principal:
    return request.app[REGISTRY].authenticate(_bearer(request))


async def _body(request: web.Request, model: type[_Model]) -> Any:
    try:
        data = await request.json() if request.body_exists else {}
    except ValueError:
        raise UsageError("bad request: body is not JSON") from None
    return model.model_validate(data)


def _limit(request: web.Request, default: int) -> int:
    raw = request.query.get("limit", str(default))
    if not raw.isdigit() or not 0 < int(raw) <= 10_000:
        raise UsageError(f"bad limit {raw!r}: 1..10000")
    return int(raw)


def app(
    registry: Registry,
    lost_after_s: float,
    lease_s: float = 60.0,
    session_ttl_s: int = 8 * 3600,
    cache_dir: Path = Path("/var/lib/stasis/controlplane"),
    min_interval_s: int = policies.MIN_INTERVAL_S,
    behind_tls: bool = False,
) -> web.Application:
    from stasis.controlplane import dashboard

    a = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    a[REGISTRY] = registry
    a.add_routes(
        dashboard.routes(registry, lost_after_s, session_ttl_s, min_interval_s, behind_tls)
    )

    def own_url(request: web.Request) -> str:
        """This control plane's URL as the caller reached it (https:// behind a TLS proxy)."""
        return f"{'https' if behind_tls else request.scheme}://{request.host}"

    def run(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        return asyncio.to_thread(fn, *args)

    async def health(request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    async def add_cluster(request: web.Request) -> web.StreamResponse:
        _principal(request).admin_only()
        body = await _body(request, NewCluster)
        return web.json_response(
            await run(
                registry.add_cluster, body.name, body.kind, body.expires_in_s, body.approve_joins
            ),
            status=201,
        )

    async def list_clusters(request: web.Request) -> web.StreamResponse:
        _principal(request).admin_only()
        return web.json_response(await run(registry.list_clusters))

    async def cluster_settings(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.admin_only()
        body = await _body(request, ClusterSettings)
        return web.json_response(
            await run(registry.set_approve_joins, who, request.match_info["id"], body.approve_joins)
        )

    async def rotate(request: web.Request) -> web.StreamResponse:
        _principal(request).admin_only()
        body = await _body(request, Rotation)
        return web.json_response(
            await run(registry.rotate, request.match_info["id"], body.expires_in_s)
        )

    async def list_tokens(request: web.Request) -> web.StreamResponse:
        _principal(request).admin_only()
        return web.json_response(await run(registry.list_tokens))

    async def revoke(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.admin_only()
        return web.json_response(await run(registry.revoke, request.match_info["id"], who))

    async def register(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        body = await _body(request, NodeReport)
        return web.json_response(await run(registry.register_node, who, body.model_dump()))

    async def heartbeat(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.node_only(request.match_info["name"], "a heartbeat")
        body = await _body(request, Heartbeat)
        return web.json_response(
            await run(
                registry.heartbeat,
                who,
                request.match_info["name"],
                [j.model_dump() for j in body.jobs],
                [a.model_dump() for a in body.activity],
                body.mem_total_bytes,
                body.scheduler_state,
                body.verdicts,
            )
        )

    async def list_nodes(request: web.Request) -> web.StreamResponse:
        return web.json_response(await run(registry.list_nodes, _principal(request), lost_after_s))

    async def list_jobs(request: web.Request) -> web.StreamResponse:
        return web.json_response(await run(registry.list_jobs, _principal(request)))

    async def new_command(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.admin_only()
        body = await _body(request, NewCommand)
        return web.json_response(
            await run(
                registry.queue,
                who,
                body.kind,
                body.job,
                {"leave_running": body.leave_running},
                body.cluster,
                body.node,
            ),
            status=201,
        )

    async def verify_checkpoint(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.admin_only()
        return web.json_response(
            await run(registry.verify_checkpoint, who, request.match_info["id"], lost_after_s),
            status=201,
        )

    async def migrate(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.admin_only()
        body = await _body(request, Migration)
        return web.json_response(
            await run(
                registry.migrate_job,
                who,
                body.job,
                body.to,
                None,
                body.cluster,
                body.node,
                lost_after_s,
            ),
            status=201,
        )

    async def drain(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.admin_only()
        body = await _body(request, Drain)
        return web.json_response(
            await run(
                registry.drain,
                who,
                request.match_info["name"],
                lost_after_s,
                body.reason,
                body.cluster,
            ),
            status=201,
        )

    async def reset_node(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.admin_only()
        body = await _body(request, NodeReset)
        return web.json_response(
            await run(registry.reset_node, who, request.match_info["name"], body.cluster)
        )

    async def approve_node(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.admin_only()
        body = await _body(request, NodeReset)
        return web.json_response(
            await run(registry.approve_node, who, request.match_info["name"], body.cluster)
        )

    async def add_policy(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        b = await _body(request, NewPolicy)
        return web.json_response(
            await run(
                policies.add,
                registry,
                who,
                b.name,
                b.every_s,
                b.action,
                b.filters,
                b.keep,
                b.older_than_s,
                b.trigger,
                b.threshold_pct,
                b.stop,
                b.completed,
                min_interval_s,
            ),
            status=201,
        )

    async def edit_policy(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.admin_only()
        b = await _body(request, PolicyEdit)
        return web.json_response(
            await run(
                policies.edit,
                registry,
                who,
                request.match_info["name"],
                b.changes(),
                min_interval_s,
            )
        )

    async def rotate_hook(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            await run(
                policies.rotate_hook, registry, _principal(request), request.match_info["name"]
            )
        )

    async def list_policies(request: web.Request) -> web.StreamResponse:
        return web.json_response(await run(policies.listed, registry, _principal(request)))

    async def remove_policy(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            await run(policies.remove, registry, _principal(request), request.match_info["name"])
        )

    async def list_events(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            await run(registry.list_events, _principal(request), _limit(request, 200))
        )

    async def list_checkpoints(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            await run(
                registry.list_checkpoints,
                _principal(request),
                _limit(request, 500),
                request.query.get("deleted") == "1",
            )
        )

    async def savings(request: web.Request) -> web.StreamResponse:
        return web.json_response(await run(registry.savings, _principal(request)))

    async def run_policy(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        token = _bearer(request)
        if token.startswith(HOOK_PREFIX):  # the policy's own hook token: this policy only
            return web.json_response(
                await run(policies.run_hook, registry, token, name, lost_after_s)
            )
        return web.json_response(
            await run(policies.run_now, registry, _principal(request), name, lost_after_s)
        )

    async def metrics(request: web.Request) -> web.StreamResponse:
        from stasis.controlplane.metrics import render

        text = await run(render, registry, _principal(request), lost_after_s)
        return web.Response(
            text=text,
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    async def install_kubernetes(request: web.Request) -> web.StreamResponse:
        import shlex

        who = _principal(request)
        if who.kind != "cluster" or who.cluster_id is None:
            raise UsageError(
                "ask with the cluster's token (`clusters add NAME --kind " "kubernetes` printed it)"
            )
        cluster = await run(registry.cluster, who.cluster_id)
        if cluster["kind"] != "kubernetes":
            raise UsageError(f"cluster {cluster['name']} is a {cluster['kind']} cluster")
        token = request.headers["Authorization"].partition(" ")[2].strip()
        url = own_url(request)
        # The token reaches helm on its stdin, from bash's own printf: on no command line,
        # which every user of the admin's machine can read.
        text = (
            f"printf '%s' {shlex.quote(token)} |\n"
            "  helm upgrade -i stasis charts/stasis -n stasis-system --create-namespace \\\n"
            f"  --set config.url={shlex.quote(url)} \\\n"
            f"  --set config.clusterId={shlex.quote(who.cluster_id)} \\\n"
            "  --set-file config.authToken=/dev/stdin\n"
        )
        return web.Response(text=text, content_type="text/plain")

    def slurm_cluster(request: web.Request) -> tuple[Principal, str]:
        who = _principal(request)
        if who.kind != "cluster" or who.cluster_id is None:
            raise UsageError(
                "ask with the cluster's token (`clusters add NAME --kind slurm` " "printed it)"
            )
        return who, request.headers["Authorization"].partition(" ")[2].strip()

    async def install_slurm(request: web.Request) -> web.StreamResponse:
        from stasis.controlplane.installer import build_wheel, sha256_of, slurm_script

        who, token = slurm_cluster(request)
        assert who.cluster_id is not None
        cluster = await run(registry.cluster, who.cluster_id)
        if cluster["kind"] != "slurm":
            raise UsageError(
                f"cluster {cluster['name']} is a {cluster['kind']} cluster: " "/install/kubernetes"
            )
        # The script pins the wheel it will fetch by this hash: bytes changed on the way are
        # refused by the node before pip sees them.
        wheel_sha256 = await run(lambda: sha256_of(build_wheel(cache_dir)))
        return web.Response(
            text=slurm_script(
                own_url(request), who.cluster_id, cluster["name"], token, wheel_sha256
            ),
            content_type="text/x-shellscript",
        )

    async def install_wheel(request: web.Request) -> web.StreamResponse:
        from stasis.controlplane.installer import build_wheel

        slurm_cluster(request)
        path = await run(build_wheel, cache_dir)
        return web.Response(
            body=path.read_bytes(),
            content_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{path.name}"'},
        )

    async def list_commands(request: web.Request) -> web.StreamResponse:
        return web.json_response(await run(registry.list_commands, _principal(request)))

    async def get_command(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            await run(registry.command, _principal(request), request.match_info["id"])
        )

    async def lease(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.node_only(request.match_info["name"], "leasing a node's commands")
        return web.json_response(
            await run(registry.lease, who, request.match_info["name"], lease_s)
        )

    async def renew(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.node_only(request.match_info["name"], "renewing a command's lease")
        body = await _body(request, Renewal)
        return web.json_response(
            await run(
                registry.renew,
                who,
                request.match_info["name"],
                request.match_info["id"],
                lease_s,
                body.lease_id,
            )
        )

    async def commit(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.node_only(request.match_info["name"], "committing a restore")
        body = await _body(request, Renewal)
        return web.json_response(
            await run(
                registry.commit,
                who,
                request.match_info["name"],
                request.match_info["id"],
                lease_s,
                body.lease_id,
            )
        )

    async def ack(request: web.Request) -> web.StreamResponse:
        who = _principal(request)
        who.node_only(who.node or "?", "acknowledging a command")
        body = await _body(request, Ack)
        return web.json_response(
            await run(
                registry.ack,
                who,
                request.match_info["id"],
                body.ok,
                body.result,
                body.lease_id,
                lost_after_s,
            )
        )

    a.add_routes(
        [
            web.get("/api/v1/health", health),
            web.post("/api/v1/clusters", add_cluster),
            web.get("/api/v1/clusters", list_clusters),
            web.post("/api/v1/clusters/{id}/rotate", rotate),
            web.post("/api/v1/clusters/{id}/settings", cluster_settings),
            web.get("/api/v1/tokens", list_tokens),
            web.post("/api/v1/tokens/{id}/revoke", revoke),
            web.post("/api/v1/nodes/register", register),
            web.post("/api/v1/nodes/{name}/heartbeat", heartbeat),
            web.post("/api/v1/nodes/{name}/reset", reset_node),
            web.post("/api/v1/nodes/{name}/approve", approve_node),
            web.get("/api/v1/nodes", list_nodes),
            web.get("/api/v1/jobs", list_jobs),
            web.post("/api/v1/commands", new_command),
            web.get("/api/v1/commands", list_commands),
            web.get("/api/v1/commands/{id}", get_command),
            web.post("/api/v1/nodes/{name}/commands/lease", lease),
            web.post("/api/v1/nodes/{name}/commands/{id}/renew", renew),
            web.post("/api/v1/nodes/{name}/commands/{id}/commit", commit),
            web.post("/api/v1/commands/{id}/ack", ack),
            web.post("/api/v1/migrations", migrate),
            web.post("/api/v1/nodes/{name}/drain", drain),
            web.get("/metrics", metrics),
            web.get("/api/v1/events", list_events),
            web.get("/api/v1/checkpoints", list_checkpoints),
            web.post("/api/v1/checkpoints/{id}/verify", verify_checkpoint),
            web.get("/api/v1/savings", savings),
            web.post("/api/v1/policies/{name}/run", run_policy),
            web.get("/install/kubernetes", install_kubernetes),
            web.get("/install/slurm", install_slurm),
            web.get("/install/stasis.whl", install_wheel),
            web.get("/api/v1/policies", list_policies),
            web.post("/api/v1/policies", add_policy),
            web.patch("/api/v1/policies/{name}", edit_policy),
            web.delete("/api/v1/policies/{name}", remove_policy),
            web.post("/api/v1/policies/{name}/rotate-hook", rotate_hook),
        ]
    )
    return a


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--listen {listen!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_admin_token(registry: Registry, path: Path | None) -> None:
    """The first start's admin token, shown once: into `path` when given, else on stdout.
    The file is made new (0600), never a link followed or a file overwritten: it is opened
    before the token exists, so a refusal loses nothing."""
    if path is None:
        token = registry.bootstrap_admin()
        if token is not None:
            print(f"admin token (shown once, keep it): {token}", flush=True)
        return
    if any(t["kind"] == "admin" and t["revoked"] is None for t in registry.list_tokens()):
        return  # made at an earlier start
    import os

    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except FileExistsError:
        raise UsageError(
            f"refused --admin-token-file {path}: something is there already (a "
            "file or a link, not followed); remove it, or name a new path"
        ) from None
    except OSError as e:
        raise UsageError(f"cannot create --admin-token-file {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        token = registry.bootstrap_admin()
        if token is None:  # another start made one meanwhile
            os.unlink(path)
            return
        f.write(token + "\n")
    print(f"admin token written to {path} (0600)", flush=True)


async def serve(
    db: str,
    listen: str,
    admin_token_file: Path | None,
    cert: Path | None,
    key: Path | None,
    allow_plain_http: bool,
    lost_after_s: float,
    lease_s: float = 60.0,
    session_ttl_s: int = 8 * 3600,
    cache_dir: Path = Path("/var/lib/stasis/controlplane"),
    min_interval_s: int = policies.MIN_INTERVAL_S,
    behind_tls: bool = False,
) -> None:
    host, port = parse_listen(listen)
    context = None
    if cert is not None or key is not None:
        if cert is None or key is None:
            raise UsageError("HTTPS needs both --cert and --key")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise UsageError(f"cannot load the certificate {cert} / key {key}: {e}") from None
    elif not _loopback(host) and not allow_plain_http:
        raise UsageError(
            f"plain HTTP on {host} would send tokens in the clear: give --cert "
            "and --key, listen on 127.0.0.1, or --allow-plain-http"
        )
    registry = await asyncio.to_thread(Registry, db)
    try:
        await asyncio.to_thread(make_admin_token, registry, admin_token_file)
    except BaseException:
        registry.close()
        raise
    runner = web.AppRunner(
        app(registry, lost_after_s, lease_s, session_ttl_s, cache_dir, min_interval_s, behind_tls),
        access_log=None,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=context)
    await site.start()
    scheme = "https" if context else "http"
    log.info(
        "control plane on %s://%s:%d (database %s)",
        scheme,
        host,
        port,
        json.dumps(safe_url(registry.url)),
    )
    print(f"listening on {scheme}://{host}:{port}", flush=True)
    runs = asyncio.create_task(_run_policies(registry, lost_after_s))
    try:
        await asyncio.Event().wait()
    finally:
        runs.cancel()
        await runner.cleanup()
        registry.close()


async def _run_policies(registry: Registry, lost_after_s: float) -> None:
    failing = ""
    while True:
        try:
            await asyncio.to_thread(registry.note_lost, lost_after_s)
            # commands a lost or dying node holds: failed, a restore re-targeted
            await asyncio.to_thread(registry.recover, lost_after_s)
            queued = await asyncio.to_thread(policies.run_due, registry, lost_after_s)
            if queued:
                log.info("policies queued %d command(s)", queued)
            failing = ""
        except Exception as e:  # the next round tries again; say it once
            if str(e) != failing:
                log.warning("running the policies failed: %s: %s", type(e).__name__, e)
                failing = str(e)
        await asyncio.sleep(1.0)
