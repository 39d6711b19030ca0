"""`stasis controlplane serve`: the control plane's HTTP API (aiohttp). Its routes, who may call
each, and their request and answer shapes are declared in stasis.controlplane.routes; this
module registers one handler per route from those declarations (`add_routes`: the methods of
`Api`, named after their routes) and checks each caller as its route says.

What the routes do (their handlers call stasis.controlplane.registry and .policies): clusters
and their tokens (admin); nodes join with their cluster's token and get their own credential,
shown once (refused, 409, for a name that has one), then heartbeat their jobs, activity and
`stasis verify` verdicts, and lease, renew, commit (a restore's fence: 409 once the command was
failed, re-targeted) and acknowledge their commands; the admin queues checkpoints, migrations
(checkpoint and stop, then restore on `to`: the checkpoint command's result names the restore's
as `next`), drains and verifies, edits policies (a policy's own hook token runs it); the
installers (/install/kubernetes: the helm command; /install/slurm: the node installer script,
for `| sudo -E bash`; /install/stasis.whl: the wheel it installs) answer a cluster's token;
/metrics is Prometheus's text (admin).

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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from stasis.controlplane import intervals, jobgroups, models, policies, routes, wire
from stasis.controlplane.access import HOOK_PREFIX, Principal
from stasis.controlplane.commands import Command
from stasis.controlplane.database import safe_url
from stasis.controlplane.models import MODELS
from stasis.controlplane.options import ServerOptions
from stasis.controlplane.registry import Registry
from stasis.controlplane.savings import savings_of
from stasis.errors import StasisError, UnauthenticatedError, UsageError, wire_name
from stasis.routes import AnyRoute

log = logging.getLogger("stasis.controlplane")
P = ParamSpec("P")
T = TypeVar("T")
MAX_BODY_BYTES = 1 << 20
REGISTRY = web.AppKey("registry", Registry)


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
            "no token: send `Authorization: Bearer stasis_...` (STASIS_AUTH_TOKEN)"
        )
    return token.strip()


def _principal(request: web.Request) -> Principal:
    token = _bearer(request)
    if token.startswith(HOOK_PREFIX):
        policies.refuse_hook(request.app[REGISTRY], token)
    return request.app[REGISTRY].authenticate(token)


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
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


@dataclass(frozen=True)
class Call:
    """One request, as a handler gets it: the caller the route allows (None on a public or
    hook route: the handler tells), the path's parameters, the validated body."""

    request: web.Request
    who: Principal | None
    args: dict[str, str]
    body: Any

    @property
    def principal(self) -> Principal:
        assert self.who is not None, "a route that names its callers"
        return self.who


# Routes that create something answer 201.
CREATED = frozenset(
    r.name
    for r in (
        routes.ADD_CLUSTER,
        routes.NEW_COMMAND,
        routes.VERIFY_CHECKPOINT,
        routes.MIGRATE,
        routes.DRAIN,
        routes.ADD_POLICY,
    )
)


async def _caller(route: AnyRoute, request: web.Request) -> Principal | None:
    """Who calls, refused at once where the route's declaration does not allow them."""
    if route.caller in ("public", "hook"):
        return None
    who = _principal(request)
    if route.caller == "admin":
        who.admin_only()
    elif route.caller == "node":
        who.node_only(request.match_info.get("name", who.node or "?"), route.denied)
    return who


def add_routes(app: web.Application, declared: Sequence[AnyRoute], handlers: object) -> None:
    """Serve each declared route with the method of `handlers` of its name: `(call) -> answer`
    (JSON), or a response of its own (text, a file). A route without its handler stops the
    start."""
    for route in declared:
        fn = getattr(handlers, route.name, None)
        if not callable(fn):
            raise ValueError(f"route {route.name} ({route.method} {route.path}): no handler")
        model = MODELS[route.request] if route.request is not None else None
        _add(app, route, _endpoint(route, fn, model))


def _add(app: web.Application, route: AnyRoute, handler: Handler) -> None:
    # (a GET answers HEAD too, as aiohttp's own web.get has it)
    if route.method == "GET":
        app.router.add_get(route.path, handler)
    else:
        app.router.add_route(route.method, route.path, handler)


def _endpoint(
    route: AnyRoute, fn: Callable[[Call], Awaitable[Any]], model: type[BaseModel] | None
) -> Handler:
    status = 201 if route.name in CREATED else 200

    async def endpoint(request: web.Request) -> web.StreamResponse:
        who = await _caller(route, request)
        body = await _body(request, model) if model is not None else None
        answer = await fn(Call(request, who, dict(request.match_info), body))
        if isinstance(answer, web.StreamResponse):
            return answer
        return web.json_response(answer, status=status)

    return endpoint


def _run(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Awaitable[T]:
    return asyncio.to_thread(fn, *args, **kwargs)


class Api:
    """The handlers of the control plane's API (stasis.controlplane.routes), one method per
    route, of its name; the registry's calls run in threads."""

    def __init__(self, registry: Registry, options: ServerOptions) -> None:
        self.registry = registry
        self.options = options

    def _own_url(self, request: web.Request) -> str:
        """This control plane's URL as the caller reached it (https:// behind a TLS proxy)."""
        return f"{'https' if self.options.behind_tls else request.scheme}://{request.host}"

    async def health(self, call: Call) -> wire.Health:
        return {"ok": True}

    async def add_cluster(self, call: Call) -> wire.ClusterAdded:
        b: models.NewCluster = call.body
        return await _run(
            self.registry.access.add_cluster, b.name, b.kind, b.expires_in_s, b.approve_joins
        )

    async def list_clusters(self, call: Call) -> list[wire.Cluster]:
        return await _run(self.registry.access.list_clusters)

    async def cluster_settings(self, call: Call) -> wire.ClusterApproval:
        b: models.ClusterSettings = call.body
        return await _run(
            self.registry.access.set_approve_joins, call.principal, call.args["id"], b.approve_joins
        )

    async def rotate(self, call: Call) -> wire.Rotated:
        b: models.Rotation = call.body
        return await _run(self.registry.access.rotate, call.args["id"], b.expires_in_s)

    async def list_tokens(self, call: Call) -> list[wire.Token]:
        return await _run(self.registry.access.list_tokens)

    async def revoke(self, call: Call) -> wire.Revoked:
        return await _run(self.registry.access.revoke, call.args["id"], call.principal)

    async def register(self, call: Call) -> wire.Registered:
        b: models.NodeReport = call.body
        return await _run(self.registry.nodes.register_node, call.principal, b.model_dump())

    async def heartbeat(self, call: Call) -> wire.Heard:
        b: models.Heartbeat = call.body
        return await _run(
            self.registry.nodes.heartbeat,
            call.principal,
            call.args["name"],
            [j.model_dump() for j in b.jobs],
            [a.model_dump() for a in b.activity],
            b.mem_total_bytes,
            b.scheduler_state,
            b.verdicts,
        )

    async def reset_node(self, call: Call) -> wire.NodeWasReset:
        return await self._of_node(self.registry.nodes.reset_node, call)

    async def approve_node(self, call: Call) -> wire.NodeApproved:
        return await self._of_node(self.registry.nodes.approve_node, call)

    def _of_node(self, fn: Callable[[Principal, str, str | None], T], call: Call) -> Awaitable[T]:
        """`fn` (reset, approve) for the node of the path, in the cluster the body names."""
        b: models.NodeReset = call.body
        return _run(fn, call.principal, call.args["name"], b.cluster)

    async def list_nodes(self, call: Call) -> list[wire.Node]:
        return await _run(self.registry.nodes.list_nodes, call.principal, self.options.lost_after_s)

    async def list_jobs(self, call: Call) -> list[wire.Job]:
        return await _run(self._jobs, call.principal)

    def _jobs(self, by: Principal) -> list[wire.Job]:
        jobs = self.registry.nodes.list_jobs(by)
        policies.annotate_intervals(self.registry, jobs, self.options.bounds)
        return jobgroups.grouped(jobs)

    async def new_command(self, call: Call) -> Command:
        b: models.NewCommand = call.body
        return await _run(
            self.registry.queue,
            call.principal,
            b.kind,
            b.job,
            {"leave_running": b.leave_running},
            b.cluster,
            b.node,
        )

    async def list_commands(self, call: Call) -> list[Command]:
        return await _run(self.registry.commands.list_commands, call.principal)

    async def get_command(self, call: Call) -> Command:
        return await _run(self.registry.commands.command, call.principal, call.args["id"])

    async def lease(self, call: Call) -> Command | None:
        return await _run(
            self.registry.commands.lease, call.principal, call.args["name"], self.options.lease_s
        )

    async def renew(self, call: Call) -> wire.Renewed:
        return await self._under_lease(self.registry.commands.renew, call)

    async def commit(self, call: Call) -> wire.Committed:
        return await self._under_lease(self.registry.commands.commit, call)

    def _under_lease(
        self, fn: Callable[[Principal, str, str, float, str], T], call: Call
    ) -> Awaitable[T]:
        """`fn` (renew, commit) for the node and command of the path, quoting its lease."""
        b: models.Renewal = call.body
        return _run(
            fn, call.principal, call.args["name"], call.args["id"], self.options.lease_s, b.lease_id
        )

    async def ack(self, call: Call) -> Command:
        b: models.Ack = call.body
        return await _run(
            self.registry.commands.ack,
            call.principal,
            call.args["id"],
            b.ok,
            b.result,
            b.lease_id,
            self.options.lost_after_s,
        )

    async def migrate(self, call: Call) -> Command:
        b: models.Migration = call.body
        return await _run(
            self.registry.migrate_job,
            call.principal,
            b.job,
            b.to,
            cluster=b.cluster,
            node=b.node,
            lost_after_s=self.options.lost_after_s,
        )

    async def drain(self, call: Call) -> wire.Drained:
        b: models.Drain = call.body
        return await _run(
            self.registry.drain,
            call.principal,
            call.args["name"],
            self.options.lost_after_s,
            b.reason,
            b.cluster,
        )

    async def metrics(self, call: Call) -> web.StreamResponse:
        from stasis.controlplane.metrics import render

        text = await _run(render, self.registry, call.principal, self.options.lost_after_s)
        return web.Response(
            text=text,
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    async def list_events(self, call: Call) -> list[wire.Event]:
        return await _run(self.registry.list_events, call.principal, _limit(call.request, 200))

    async def list_checkpoints(self, call: Call) -> list[wire.Checkpoint]:
        return await _run(
            self.registry.reports.list_checkpoints,
            call.principal,
            _limit(call.request, 500),
            call.request.query.get("deleted") == "1",
        )

    async def verify_checkpoint(self, call: Call) -> Command:
        return await _run(
            self.registry.verify_checkpoint,
            call.principal,
            call.args["id"],
            self.options.lost_after_s,
        )

    async def savings(self, call: Call) -> wire.Savings:
        return await _run(savings_of, self.registry, call.principal)

    async def run_policy(self, call: Call) -> wire.PolicyRun:
        name = call.args["name"]
        token = _bearer(call.request)
        if token.startswith(HOOK_PREFIX):  # the policy's own hook token: this policy only
            return await _run(
                policies.run_hook,
                self.registry,
                token,
                name,
                self.options.lost_after_s,
                self.options.bounds,
            )
        return await _run(
            policies.run_now,
            self.registry,
            _principal(call.request),
            name,
            self.options.lost_after_s,
            self.options.bounds,
        )

    async def install_kubernetes(self, call: Call) -> web.StreamResponse:
        import shlex

        who = call.principal
        if who.kind != "cluster" or who.cluster_id is None:
            raise UsageError(
                "ask with the cluster's token (`clusters add NAME --kind kubernetes` printed it)"
            )
        cluster = await _run(self.registry.access.cluster, who.cluster_id)
        if cluster["kind"] != "kubernetes":
            raise UsageError(f"cluster {cluster['name']} is a {cluster['kind']} cluster")
        token = _bearer(call.request)
        url = self._own_url(call.request)
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

    def _slurm_cluster(self, call: Call) -> tuple[str, str]:
        """The Slurm cluster's id and token of an installer's request."""
        who = call.principal
        if who.kind != "cluster" or who.cluster_id is None:
            raise UsageError(
                "ask with the cluster's token (`clusters add NAME --kind slurm` printed it)"
            )
        return who.cluster_id, _bearer(call.request)

    async def install_slurm(self, call: Call) -> web.StreamResponse:
        from stasis.controlplane.installer import build_wheel, sha256_of, slurm_script

        cluster_id, token = self._slurm_cluster(call)
        cluster = await _run(self.registry.access.cluster, cluster_id)
        if cluster["kind"] != "slurm":
            raise UsageError(
                f"cluster {cluster['name']} is a {cluster['kind']} cluster: "
                + routes.INSTALL_KUBERNETES.path
            )
        # The script pins the wheel it will fetch by this hash: bytes changed on the way are
        # refused by the node before pip sees them.
        wheel_sha256 = await _run(lambda: sha256_of(build_wheel(self.options.cache_dir)))
        return web.Response(
            text=slurm_script(
                self._own_url(call.request), cluster_id, cluster["name"], token, wheel_sha256
            ),
            content_type="text/x-shellscript",
        )

    async def install_wheel(self, call: Call) -> web.StreamResponse:
        from stasis.controlplane.installer import build_wheel

        self._slurm_cluster(call)
        path = await _run(build_wheel, self.options.cache_dir)
        return web.Response(
            body=path.read_bytes(),
            content_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{path.name}"'},
        )

    async def list_policies(self, call: Call) -> list[wire.Policy]:
        return await _run(policies.listed, self.registry, call.principal)

    async def add_policy(self, call: Call) -> wire.Policy:
        b: models.NewPolicy = call.body
        return await _run(
            policies.add,
            self.registry,
            call.principal,
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
            self.options.min_interval_s,
        )

    async def edit_policy(self, call: Call) -> wire.Policy:
        b: models.PolicyEdit = call.body
        return await _run(
            policies.edit,
            self.registry,
            call.principal,
            call.args["name"],
            b.changes(),
            self.options.min_interval_s,
        )

    async def remove_policy(self, call: Call) -> wire.PolicyRemoved:
        return await _run(policies.remove, self.registry, call.principal, call.args["name"])

    async def rotate_hook(self, call: Call) -> wire.HookRotated:
        return await _run(policies.rotate_hook, self.registry, call.principal, call.args["name"])


def app(registry: Registry, options: ServerOptions) -> web.Application:
    from stasis.controlplane import dashboard

    a = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    a[REGISTRY] = registry
    dashboard.add_routes(
        a,
        routes.UI,
        dashboard.Dashboard(registry, options),
    )
    add_routes(
        a,
        routes.API,
        Api(registry, options),
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
        token = registry.access.bootstrap_admin()
        if token is not None:
            print(f"admin token (shown once, keep it): {token}", flush=True)
        return
    if any(t["kind"] == "admin" and t["revoked"] is None for t in registry.access.list_tokens()):
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
        token = registry.access.bootstrap_admin()
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
    options: ServerOptions,
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
        app(registry, options),
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
    runs = asyncio.create_task(_run_policies(registry, options.lost_after_s, options.bounds))
    try:
        await asyncio.Event().wait()
    finally:
        runs.cancel()
        await runner.cleanup()
        registry.close()


async def _run_policies(registry: Registry, lost_after_s: float, bounds: intervals.Bounds) -> None:
    failing = ""
    while True:
        try:
            await asyncio.to_thread(registry.nodes.note_lost, lost_after_s)
            # commands a lost or dying node holds: failed, a restore re-targeted
            await asyncio.to_thread(registry.commands.recover, lost_after_s)
            queued = await asyncio.to_thread(policies.run_due, registry, lost_after_s, bounds)
            if queued:
                log.info("policies queued %d command(s)", queued)
            failing = ""
        except Exception as e:  # the next round tries again; say it once
            if str(e) != failing:
                log.warning("running the policies failed: %s: %s", type(e).__name__, e)
                failing = str(e)
        await asyncio.sleep(1.0)
