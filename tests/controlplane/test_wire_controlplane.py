"""The control plane's routes (stasis.controlplane.routes) held to the rest, the way
tests/test_wire.py holds the node daemon's: every route declared once, registered by the server
from its declaration, called by the client method of its name (recorded over real HTTP), its
request typed dict the same as the pydantic model the server validates it with, and its caller
rule enforced by a real control plane; no module of the control plane, nor its CLI, spells an
API path; errors travel in the one envelope and come back as the class they left as."""

from __future__ import annotations

import ast
import http.server
import inspect
import json
import re
import threading
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from stasis.controlplane import commands, models, routes, wire
from stasis.controlplane.client import ControlPlaneClient
from stasis.errors import (
    ConflictError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    UsageError,
)
from stasis.routes import AnyRoute
from tests.conftest import ROOT
from tests.controlplane.conftest import SQLITE_ONLY, ControlPlane
from tests.test_wire import comment_required, json_kind, model_required

CALLERS = {"public", "admin", "user", "cluster", "node", "hook"}
REQUEST_PAIRS = [(td, m) for td, m in {**models.MODELS, **models.NESTED}.items()]
IDS = [getattr(td, "__name__", str(td)) for td, _ in REQUEST_PAIRS]
# Values for the path parameters, by name.
PARAMS = {"id": "x1", "name": "n1"}


def test_every_route_is_declared_once() -> None:
    names = [r.name for r in routes.API]
    assert len(set(names)) == len(names)
    where = [(r.method, r.path) for r in routes.API]
    assert len(set(where)) == len(where)
    declared = [v for v in vars(routes).values() if isinstance(v, type(routes.HEALTH))]
    assert set(map(id, declared)) == set(map(id, routes.API + routes.UI)), "a route left out"
    every = [(r.method, r.path) for r in routes.API + routes.UI]
    assert len(set(every)) == len(every)
    assert len({r.name for r in routes.API + routes.UI}) == len(every)
    for r in routes.API:
        assert r.caller in CALLERS, r
        assert r.path.startswith(("/api/v1/", "/install/", "/metrics")), r
        if r.caller == "node":
            assert r.denied and not r.denied.startswith("only root"), r
        assert r.request is None or r.request in models.MODELS, r


def test_the_server_registers_every_route_from_its_declaration(tmp_path: Path) -> None:
    from stasis.controlplane.dashboard import Dashboard
    from stasis.controlplane.options import ServerOptions
    from stasis.controlplane.registry import Registry
    from stasis.controlplane.server import Api, app

    registry = Registry(str(tmp_path / "cp.db"))
    try:
        served = {
            (r.method, r.resource.canonical)
            for r in app(registry, ServerOptions(lost_after_s=60.0)).router.routes()
            if r.resource is not None and r.method != "HEAD"
        }
    finally:
        registry.close()
    assert served == {(r.method, r.path) for r in routes.API + routes.UI}
    handlers = {n for n, f in inspect.getmembers(Api) if not n.startswith("_") and callable(f)}
    assert handlers == {r.name for r in routes.API}
    pages = {n for n, f in inspect.getmembers(Dashboard) if not n.startswith("_") and callable(f)}
    assert pages == {r.name for r in routes.UI}


@pytest.mark.parametrize(("td", "model"), REQUEST_PAIRS, ids=IDS)
def test_request_dicts_are_the_models(td: Any, model: type[BaseModel]) -> None:
    hints = typing.get_type_hints(td)
    assert set(hints) == set(model.model_fields)
    for name, field in model.model_fields.items():
        assert json_kind(hints[name]) == json_kind(field.annotation), name
    required: frozenset[str] = td.__required_keys__
    if td.__total__:
        assert model_required(model) == required == set(hints)
    else:
        assert model_required(model) == comment_required(td)


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, str, Any]] = []

    def _answer(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(size)) if size else None
        self.seen.append((self.command, self.path, body))
        data = b"null"
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[tuple[str, str, Any]]]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    _Recorder.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _Recorder.seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("route", routes.API, ids=[r.name for r in routes.API])
def test_the_client_method_of_each_route_calls_it(
    route: AnyRoute, recorder: tuple[str, list[tuple[str, str, Any]]]
) -> None:
    url, seen = recorder
    client = ControlPlaneClient(url, "stasis_t")
    method = getattr(client, route.name)
    params = list(inspect.signature(method).parameters.values())
    # (the client's annotations are strings: `from __future__ import annotations`)
    method(*[PARAMS["id"] if p.annotation == "str" else {} for p in params if p.default is p.empty])
    assert len(seen) == 1, seen
    asked_method, asked_path, body = seen[0]
    pattern = re.sub(r"\\\{\w+\\\}", "[^/?]+", re.escape(route.path))
    assert asked_method == route.method and re.fullmatch(pattern + r"(\?.*)?", asked_path), (
        route,
        seen[0],
    )
    assert (body is not None) == (route.request is not None or route.name == "lease"), seen[0]


def test_the_node_side_carries_out_every_kind_of_command() -> None:
    from stasis.controlplane.node import ControlPlaneNode

    source = inspect.getsource(ControlPlaneNode.__init__)
    carried = set(re.findall(r'^\s+"(\w+)": self\._\w+,$', source, re.M))
    assert carried == set(commands.KINDS)
    assert commands.kind_of("checkpoint") == "checkpoint" and commands.kind_of("x") is None


# What each kind of caller is refused with, when it calls a route it may not (a real server).
@SQLITE_ONLY
def test_each_routes_caller_rule_holds(controlplane: ControlPlane) -> None:
    cp = controlplane
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    status, joined = cp.call(
        "POST",
        routes.REGISTER.path,
        cluster["token"],
        {"name": "n1", "host": "n1", "stasis_version": "x", "check_ok": True},
    )
    assert status == 200, joined
    node = joined["node_token"]
    for r in routes.API:
        path = r.url(**{p: PARAMS[p] for p in r.params})
        body: dict[str, Any] | None = {} if r.method != "GET" else None
        if r.caller == "public":
            assert cp.call(r.method, path, None, body)[0] == 200, r
            continue
        status, said = cp.call(r.method, path, None, body)
        assert status == 401, (r, status, said)
        if r.caller == "admin":
            for token in (cluster["token"], node):
                status, said = cp.call(r.method, path, token, body)
                assert status == 403 and "needs the admin token" in said["error"], (r, said)
        if r.caller == "node":
            status, said = cp.call(r.method, path, cp.admin, body)
            assert (
                status == 403 and f"{r.denied} needs the node's own credential" in (said["error"])
            ), (r, said)


@SQLITE_ONLY
def test_errors_come_back_as_the_class_they_left_as(controlplane: ControlPlane) -> None:
    cp = controlplane
    admin = ControlPlaneClient(cp.url, cp.admin)
    with pytest.raises(NotFoundError, match="no command cmd_none"):
        admin.get_command("cmd_none")
    with pytest.raises(UsageError, match=r"bad request: kind: "):
        admin.add_cluster({"name": "x", "kind": "mainframe"})  # type: ignore[typeddict-item]
    with pytest.raises(UnauthenticatedError, match="unknown token"):
        ControlPlaneClient(cp.url, "stasis_nothing").list_nodes()
    cluster = admin.add_cluster({"name": "hpc", "kind": "slurm"})
    with pytest.raises(PermissionDeniedError, match="needs the admin token"):
        ControlPlaneClient(cp.url, cluster["token"]).list_tokens()
    report: wire.NodeReport = {"name": "n1", "host": "n1", "stasis_version": "x", "check_ok": True}
    ControlPlaneClient(cp.url, cluster["token"]).register(report)
    with pytest.raises(ConflictError):
        ControlPlaneClient(cp.url, cluster["token"]).register(report)
    status, said = cp.call("GET", routes.GET_COMMAND.url(id="cmd_none"), cp.admin)
    assert status == 404 and said == {"error": "no command cmd_none"}


# A path of the API or the dashboard anywhere but in the declarations: a string constant (not
# a docstring).
API_PATH = re.compile(r"/api/v1\b|/install/|^/metrics\b|^/ui\b")


def _path_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:80]!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and API_PATH.search(node.value)
    ]


def test_no_api_path_outside_the_declarations() -> None:
    scanned = [
        p for p in (ROOT / "stasis" / "controlplane").glob("*.py") if p.name != "routes.py"
    ] + [ROOT / "stasis" / "cli" / "controlplane.py"]
    found = [hit for p in scanned for hit in _path_literals(p)]
    assert found == []
    # The scan sees what it looks for.
    assert _path_literals(ROOT / "stasis" / "controlplane" / "routes.py")
