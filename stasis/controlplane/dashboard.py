"""The dashboard: server-rendered pages under /ui/ (Jinja2, autoescaped), a little JavaScript
that refreshes each page's live part every few seconds, no build step.

    GET  /ui/login, POST /ui/login      log in with a token (admin: everything; a cluster's:
                                        its own nodes, jobs and checkpoints, read only)
    POST /ui/logout
    GET  /ui/                           clusters and nodes: health, versions, last heartbeat
    GET  /ui/jobs                       jobs (protected, state, interval and why, last
                                        checkpoint and its age);
    POST /ui/jobs/{job}/checkpoint      "Checkpoint now"
    POST /ui/jobs/{job}/migrate         "Migrate" to the node chosen
    GET  /ui/checkpoints                size, CRIU's time, frozen time, where stored, and
                                        Verified: the verdict of `stasis verify` (ok, failed:
                                        REASON, not verified; stasis.controlplane.verdicts)
    POST /ui/checkpoints/{id}/verify    "Verify" (by the node that took it)
    GET  /ui/policies, POST /ui/policies, POST /ui/policies/{name}/run|delete
    GET  /ui/policies/{name}/edit, POST /ui/policies/{name}/edit   a policy edited in place
                                        (the form holds all its fields: what it sends is it)
    GET  /ui/actions, /ui/events        the commands with their status; the timeline
    GET  /ui/savings                    node-hours kept by restores against node-hours spent
                                        checkpointing, per cluster (and the interruption
                                        rate), per user, by day

Every POST carries the session's CSRF token (a hidden field) and, when the browser sends one, an
Origin of this host; the session cookie is HttpOnly and SameSite=Strict, and Secure over HTTPS
or when `serve --behind-tls` says a TLS-terminating proxy is in front.
Pages send a Content-Security-Policy that allows only this server's own script and style.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import jinja2
from aiohttp import web

from stasis.controlplane import jobgroups, policies, routes, sessions
from stasis.controlplane.options import ServerOptions
from stasis.controlplane.registry import Registry
from stasis.controlplane.reports import human_size
from stasis.controlplane.savings import savings_of
from stasis.controlplane.sessions import Session
from stasis.errors import NotFoundError, StasisError, UnauthenticatedError, UsageError
from stasis.routes import AnyRoute

COOKIE = "stasis_session"
HERE = Path(__file__).parent
_STATIC = {"style.css": "text/css", "live.js": "text/javascript"}
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self'; connect-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # Not no-referrer: with it browsers send `Origin: null` on the forms' own POSTs.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
_PAGES = [
    (routes.UI_NODES.path, "Nodes"),
    (routes.UI_JOBS.path, "Jobs"),
    (routes.UI_CHECKPOINTS.path, "Checkpoints"),
    (routes.UI_POLICIES.path, "Policies"),
    (routes.UI_ACTIONS.path, "Actions"),
    (routes.UI_EVENTS.path, "Events"),
    (routes.UI_SAVINGS.path, "Savings"),
]
_MAX_FLASH = 5


def _seconds(seconds: float | None) -> str:
    """An interval as a person reads it: 4.2 s, 12 min, 1.5 h."""
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s < 600:
        return f"{s:.1f} s"
    if s < 3 * 3600:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    s = max(0.0, float(seconds))
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 5400:
        return f"{s / 60:.0f} min ago"
    if s < 172800:
        return f"{s / 3600:.1f} h ago"
    return f"{s / 86400:.0f} d ago"


# What may go into a form's URL as one path segment: characters with no meaning in a URL, and
# never a dot segment ("..", which a browser resolves, even as "%2e%2e"): a job id a node made
# up cannot aim an admin's click at another job's or another page's action.
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,199}")


def _segment(value: object) -> bool:
    return isinstance(value, str) and _SEGMENT.fullmatch(value) is not None


def _seg(value: object) -> str:
    """One path segment, every reserved character escaped ('/' too, unlike `urlencode`)."""
    return quote(str(value), safe="")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)
    env.filters["age"] = _age
    env.filters["seconds"] = _seconds
    env.filters["size"] = human_size
    env.filters["seg"] = _seg
    env.tests["segment"] = _segment
    return env


Gather = Callable[[Session], dict[str, Any]]


def _number(f: dict[str, str], key: str) -> int | None:
    """A whole number from a form field; None when it is empty."""
    raw = f.get(key, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
        raise UsageError(f"{key}: a whole number, not {raw[:40]!r}")
    return int(raw)


def _every(f: dict[str, str]) -> int | str:
    """A policy's period from its form: seconds, 0 (webhook only) or auto."""
    if f.get("every_s", "").strip().lower() == policies.AUTO:
        return policies.AUTO
    return _number(f, "every_s") or 0


def _share(f: dict[str, str], key: str) -> float | None:
    """A percentage from a form field (50, 12.5); None when it is empty."""
    raw = f.get(key, "").strip()
    if not raw:
        return None
    whole, _, part = raw.partition(".")
    if not (raw.isascii() and whole.isdigit() and (not part or part.isdigit())) or len(raw) > 20:
        raise UsageError(f"{key}: a number, not {raw[:40]!r}")
    return float(raw)


class Dashboard:
    """The handlers of the dashboard's pages and forms (stasis.controlplane.routes.UI), one
    method per route, of its name. A page needs a session (else: the log-in page); a form, its
    session's CSRF token and, when the browser sends one, an Origin of this host."""

    def __init__(self, registry: Registry, options: ServerOptions) -> None:
        self.registry = registry
        self.options = options
        self._env = _environment()
        self._flashes: dict[str, list[tuple[str, str]]] = {}

    # -- what every page and form does --------------------------------------------------------

    def _flash(self, session: Session, kind: str, text: str) -> None:
        said = self._flashes.setdefault(session.key, [])
        said.append((kind, text[:500]))
        del said[:-_MAX_FLASH]

    async def _session_of(self, request: web.Request) -> Session | None:
        try:
            found: Session = await _run(
                sessions.find, self.registry, request.cookies.get(COOKIE, "")
            )
        except UnauthenticatedError:
            return None
        return found

    def _render(
        self,
        name: str,
        request: web.Request,
        session: Session | None,
        status: int = 200,
        **values: Any,
    ) -> web.StreamResponse:
        template = self._env.get_template(name)
        values.update(
            pages=_PAGES,
            path=request.path,
            session=session,
            now=time.strftime("%H:%M:%S", time.gmtime()),
            flashes=self._flashes.pop(session.key, []) if session else [],
        )
        if request.headers.get("X-Stasis-Fragment") == "1" and "live" in template.blocks:
            ctx = template.new_context(values)
            text = "".join(template.blocks["live"](ctx))
        else:
            text = template.render(values)
        return _headers(web.Response(text=text, content_type="text/html", status=status))

    async def _page(self, name: str, gather: Gather, request: web.Request) -> web.StreamResponse:
        session = await self._session_of(request)
        if session is None:
            if request.headers.get("X-Stasis-Fragment") == "1":
                return _headers(web.Response(status=401, text="log in again"))
            return _to_login()
        try:
            values = await _run(gather, session)
        except StasisError as e:
            return self._render(name, request, session, status=e.http_status, error=str(e))
        return self._render(name, request, session, error=None, **values)

    async def _form_of(
        self, request: web.Request
    ) -> tuple[Session, dict[str, str]] | web.StreamResponse:
        """A POST's session and fields, or the answer that refuses it."""
        origin = request.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc != request.host:
            return _headers(web.Response(status=403, text="cross-site request refused"))
        session = await self._session_of(request)
        if session is None:
            return _to_login()
        data = await request.post()
        fields = {k: v for k, v in data.items() if isinstance(v, str)}
        if not session.csrf_ok(fields.get("csrf", "")):
            return _headers(
                web.Response(
                    status=403, text="the form's CSRF token is missing or wrong: reload the page"
                )
            )
        return session, fields

    async def _action(self, do: Action, back: AnyRoute, request: web.Request) -> web.StreamResponse:
        got = await self._form_of(request)
        if isinstance(got, web.StreamResponse):
            return got
        session, fields = got
        try:
            self._flash(session, "ok", await _run(do, session, request, fields))
        except StasisError as e:
            self._flash(session, "error", str(e))
        return _headers(web.HTTPSeeOther(back.path))

    # -- the routes (stasis.controlplane.routes.UI) -------------------------------------------

    async def ui_home(self, request: web.Request) -> web.StreamResponse:
        return _headers(web.HTTPSeeOther(routes.UI_NODES.path))

    async def ui_bare(self, request: web.Request) -> web.StreamResponse:
        return _headers(web.HTTPSeeOther(routes.UI_NODES.path))

    async def ui_login_page(self, request: web.Request) -> web.StreamResponse:
        return self._render("login.html", request, None, error=None)

    async def ui_login(self, request: web.Request) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc != request.host:
            return _headers(web.Response(status=403, text="cross-site request refused"))
        data = await request.post()
        token = data.get("token")
        try:
            if not isinstance(token, str) or not token.strip():
                raise UnauthenticatedError("give a token")
            sid, _ = await _run(sessions.start, self.registry, token, self.options.session_ttl_s)
        except StasisError as e:
            return self._render("login.html", request, None, status=401, error=str(e))
        response = web.HTTPSeeOther(routes.UI_NODES.path)
        # Behind a TLS-terminating proxy the request arrives here over plain HTTP, but the
        # browser speaks HTTPS: the cookie must still never go out over plain HTTP.
        response.set_cookie(
            COOKIE,
            sid,
            max_age=self.options.session_ttl_s,
            path=routes.UI_BARE.path,
            httponly=True,
            samesite="Strict",
            secure=request.secure or self.options.behind_tls,
        )
        return _headers(response)

    async def ui_logout(self, request: web.Request) -> web.StreamResponse:
        got = await self._form_of(request)
        if isinstance(got, web.StreamResponse):
            return got
        await _run(sessions.end, self.registry, got[0])
        response = web.HTTPSeeOther(routes.UI_LOGIN_PAGE.path)
        response.del_cookie(COOKIE, path=routes.UI_BARE.path)
        return _headers(response)

    async def ui_static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in _STATIC:
            raise web.HTTPNotFound()
        return _headers(
            web.Response(body=(HERE / "static" / name).read_bytes(), content_type=_STATIC[name])
        )

    async def ui_nodes(self, request: web.Request) -> web.StreamResponse:
        return await self._page("nodes.html", self._nodes, request)

    async def ui_jobs(self, request: web.Request) -> web.StreamResponse:
        return await self._page("jobs.html", self._jobs, request)

    async def ui_checkpoint_job(self, request: web.Request) -> web.StreamResponse:
        return await self._action(self._checkpoint_now, routes.UI_JOBS, request)

    async def ui_migrate_job(self, request: web.Request) -> web.StreamResponse:
        return await self._action(self._migrate, routes.UI_JOBS, request)

    async def ui_checkpoints(self, request: web.Request) -> web.StreamResponse:
        return await self._page("checkpoints.html", self._checkpoints, request)

    async def ui_verify(self, request: web.Request) -> web.StreamResponse:
        return await self._action(self._verify, routes.UI_CHECKPOINTS, request)

    async def ui_policies(self, request: web.Request) -> web.StreamResponse:
        return await self._page("policies.html", self._policy_page, request)

    async def ui_add_policy(self, request: web.Request) -> web.StreamResponse:
        return await self._action(self._add_policy, routes.UI_POLICIES, request)

    async def ui_run_policy(self, request: web.Request) -> web.StreamResponse:
        return await self._action(self._run_policy, routes.UI_POLICIES, request)

    async def ui_remove_policy(self, request: web.Request) -> web.StreamResponse:
        return await self._action(self._remove_policy, routes.UI_POLICIES, request)

    async def ui_policy_edit_page(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]

        def one(s: Session) -> dict[str, Any]:
            found = [p for p in policies.listed(self.registry, s.principal) if p["name"] == name]
            if not found:
                raise NotFoundError(f"no policy {name}")
            return {
                "p": found[0],
                "filters": policies.FILTERS,
                "min_interval_s": self.options.min_interval_s,
            }

        return await self._page("policy_edit.html", one, request)

    async def ui_edit_policy(self, request: web.Request) -> web.StreamResponse:
        return await self._action(self._edit_policy, routes.UI_POLICIES, request)

    async def ui_actions(self, request: web.Request) -> web.StreamResponse:
        return await self._page("actions.html", self._actions, request)

    async def ui_events(self, request: web.Request) -> web.StreamResponse:
        return await self._page("events.html", self._events, request)

    async def ui_savings(self, request: web.Request) -> web.StreamResponse:
        return await self._page("savings.html", self._savings, request)

    # -- what the pages show ------------------------------------------------------------------

    def _nodes(self, s: Session) -> dict[str, Any]:
        who = s.principal
        clusters = (
            self.registry.access.list_clusters()
            if who.kind == "admin"
            else [self.registry.access.cluster(who.cluster_id)]
            if who.cluster_id
            else []
        )
        return {
            "clusters": clusters,
            "nodes": self.registry.nodes.list_nodes(who, self.options.lost_after_s),
        }

    def _jobs(self, s: Session) -> dict[str, Any]:
        listed = self.registry.nodes.list_jobs(s.principal)
        policies.annotate_intervals(self.registry, listed, self.options.bounds)
        listed = jobgroups.grouped(listed)
        ready = [
            n
            for n in self.registry.nodes.list_nodes(s.principal, self.options.lost_after_s)
            if n["state"] == "ready"
        ]
        return {
            "jobs": [
                {
                    **j,
                    "targets": [
                        n["name"]
                        for n in ready
                        if n["cluster_id"] == j["cluster_id"]
                        and n["name"] != j["node"]
                        # A job on several nodes moves by its scheduler's requeue (a drain
                        # of one of its nodes), never by a migration of one part.
                        and "parts" not in j
                    ],
                }
                for j in listed
            ]
        }

    def _checkpoints(self, s: Session) -> dict[str, Any]:
        return {"checkpoints": self.registry.reports.list_checkpoints(s.principal, 300)}

    def _policy_page(self, s: Session) -> dict[str, Any]:
        return {
            "policies": policies.listed(self.registry, s.principal),
            "min_interval_s": self.options.min_interval_s,
        }

    def _actions(self, s: Session) -> dict[str, Any]:
        return {"commands": self.registry.commands.list_commands(s.principal)[::-1][:300]}

    def _events(self, s: Session) -> dict[str, Any]:
        return {"events": self.registry.list_events(s.principal, 300)[::-1]}

    def _savings(self, s: Session) -> dict[str, Any]:
        saved = savings_of(self.registry, s.principal)
        # Per day (UTC), the last 30 with restores or checkpoints: kept beside spent, both on
        # one scale.
        kept = {d["day"]: d["node_hours"] for d in saved["days"]}
        spent = {d["day"]: d["node_hours"] for d in saved["spent_days"]}
        days = sorted(set(kept) | set(spent))[-30:]
        top = max([kept.get(d, 0.0) for d in days] + [spent.get(d, 0.0) for d in days] + [1e-9])
        bars = [
            {
                "day": d,
                "node_hours": kept.get(d, 0.0),
                "spent_node_hours": spent.get(d, 0.0),
                "height": round(150 * kept.get(d, 0.0) / top, 1),
                "spent_height": round(150 * spent.get(d, 0.0) / top, 1),
            }
            for d in days
        ]
        return {"saved": {**saved, "bars": bars}}

    # -- what the forms do --------------------------------------------------------------------

    def _checkpoint_now(self, s: Session, request: web.Request, f: dict[str, str]) -> str:
        job, cluster, node = _job_of(request, f)
        cmd = self.registry.queue(
            s.principal,
            "checkpoint",
            job,
            {"leave_running": True, "reason": "dashboard"},
            cluster,
            node,
        )
        return f"checkpoint of job {job} on node {cmd['node']} asked ({cmd['id']})"

    def _verify(self, s: Session, request: web.Request, f: dict[str, str]) -> str:
        cmd = self.registry.verify_checkpoint(
            s.principal, request.match_info["checkpoint"], self.options.lost_after_s
        )
        return (
            f"verify of checkpoint {cmd['args']['checkpoint']} asked on node "
            f"{cmd['node']} ({cmd['id']})"
        )

    def _migrate(self, s: Session, request: web.Request, f: dict[str, str]) -> str:
        job, cluster, node = _job_of(request, f)
        to = f.get("to", "")
        if not to:
            raise UsageError("choose the node to migrate to")
        cmd = self.registry.migrate_job(
            s.principal, job, to, None, cluster, node, self.options.lost_after_s
        )
        return f"job {job} is being moved from {cmd['node']} to {to} ({cmd['id']})"

    def _add_policy(self, s: Session, request: web.Request, f: dict[str, str]) -> str:
        p = policies.add(
            self.registry,
            s.principal,
            f.get("name", ""),
            _every(f),
            f.get("action", ""),
            {k: f[k] for k in policies.FILTERS if f.get(k)},
            _number(f, "keep"),
            _number(f, "older_than_s"),
            f.get("trigger") or "every",
            _share(f, "threshold_pct"),
            f.get("stop") == "1",
            min_interval_s=self.options.min_interval_s,
        )
        if p.get("hook_token"):
            return (
                f"policy {p['name']} added; its hook token (shown once, it runs this "
                f"policy only): {p['hook_token']}"
            )
        return f"policy {p['name']} added"

    def _edit_policy(self, s: Session, request: web.Request, f: dict[str, str]) -> str:
        name = request.match_info["name"]
        changes: dict[str, Any] = {
            "every_s": _every(f),
            "action": f.get("action", ""),
            "trigger": f.get("trigger") or "every",
            "keep": _number(f, "keep"),
            "older_than_s": _number(f, "older_than_s"),
            "threshold_pct": _share(f, "threshold_pct"),
            "stop": f.get("stop") == "1",
            "completed": f.get("completed") == "1",
            "enabled": f.get("enabled") == "1",
            "filters": {k: f.get(k, "").strip() for k in policies.FILTERS},
        }
        p = policies.edit(self.registry, s.principal, name, changes, self.options.min_interval_s)
        if p.get("hook_token"):
            return (
                f"policy {name} saved; its hook token (shown once, it runs this policy "
                f"only): {p['hook_token']}"
            )
        return f"policy {name} saved"

    def _run_policy(self, s: Session, request: web.Request, f: dict[str, str]) -> str:
        done = policies.run_now(
            self.registry, s.principal, request.match_info["name"], self.options.lost_after_s
        )
        return f"policy {done['name']} ran: {done['queued']} command(s)"

    def _remove_policy(self, s: Session, request: web.Request, f: dict[str, str]) -> str:
        policies.remove(self.registry, s.principal, request.match_info["name"])
        return f"policy {request.match_info['name']} removed"


Action = Callable[[Session, web.Request, dict[str, str]], str]


def _run(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
    return asyncio.to_thread(fn, *args)


def _headers(response: web.StreamResponse) -> web.StreamResponse:
    response.headers.update(_HEADERS)
    return response


def _to_login() -> web.StreamResponse:
    return _headers(web.HTTPSeeOther(routes.UI_LOGIN_PAGE.path))


def _job_of(request: web.Request, f: dict[str, str]) -> tuple[str, str | None, str | None]:
    """The job a form acts on: its id, and the cluster and node whose row it was (a job id is
    a node's to choose: two clusters may report the same one)."""
    job = request.match_info["job"]
    if not _segment(job):
        raise UsageError(f"job id {job[:100]!r} has characters a job id cannot have")
    return job, f.get("cluster") or None, f.get("node") or None


def add_routes(app: web.Application, declared: Sequence[AnyRoute], dashboard: Dashboard) -> None:
    """Serve each declared page or form with the method of `dashboard` of its name."""
    for route in declared:
        fn = getattr(dashboard, route.name, None)
        if not callable(fn):
            raise ValueError(f"route {route.name} ({route.method} {route.path}): no handler")
        if route.method == "GET":  # (HEAD too, as aiohttp's own web.get has it)
            app.router.add_get(route.path, fn)
        else:
            app.router.add_route(route.method, route.path, fn)
