"""stasis/wire.py (what the client reads and sends) held to the pydantic models the daemon
validates requests with, field by field: the same keys, the same required keys, the same JSON
types. Answers are the wire's typed dicts on both sides: the check report and the Slurm
registrations are checked here value by value as the daemon makes them (the other answers in
tests/test_client.py and tests/daemon/test_api.py, from a real daemon). And the wire and the
client stay cheap to import (no pydantic, typing_extensions, aiohttp)."""

from __future__ import annotations

import ast
import datetime
import inspect
import json
import os
import re
import socket
import subprocess
import sys
import threading
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union

import pydantic
import pytest
from pydantic import BaseModel

from stasis import routes, wire
from stasis.daemon import models as daemon_models
from stasis.errors import NotFoundError
from stasis.k8s import models as k8s_models
from stasis.slurm import models as slurm_models
from stasis.store import Manifest
from tests.conftest import ROOT, TEST_USER

# (the wire's TypedDict, the pydantic model the daemon validates the request with): every pair
# the daemon's adapter looks models up in (each surface's BY_WIRE).
MODELS: dict[object, type[BaseModel]] = {
    **daemon_models.BY_WIRE,
    **slurm_models.BY_WIRE,
    **k8s_models.BY_WIRE,
}
REQUEST_PAIRS: list[tuple[type, type[BaseModel]]] = [
    (td, model) for td, model in MODELS.items() if isinstance(td, type)
]
assert {
    (wire.RunRequest, daemon_models.RunRequest),
    (wire.KillRequest, daemon_models.KillRequest),
    (wire.GcRequest, daemon_models.GcRequest),
    (wire.DumpRequest, daemon_models.DumpRequest),
    (wire.RestoreRequest, daemon_models.RestoreRequest),
    (wire.RegisterRequest, slurm_models.RegisterRequest),
    (wire.FinishRequest, slurm_models.FinishRequest),
    (wire.SlurmCheckpointRequest, slurm_models.CheckpointRequest),
} <= set(REQUEST_PAIRS)
# The answers: the daemon builds them as the wire's typed dicts themselves (mypy holds each
# construction to the wire); what a real daemon sends is checked value by value (`conforms`) in
# tests/test_client.py and tests/daemon/test_api.py, and here where named.
WIRE_ONLY = {
    "WireError",  # test_error_shape
    "Progress",  # the dump and restore streams (tests/daemon/test_api.py)
    "Deleted",  # tests/test_client.py
    "GcAnswer",  # tests/daemon/test_gc.py
    "CheckpointCheck",
    "CompatFact",  # tests/daemon/test_api.py, test_restore_facts.py
    "RekeyAnswer",  # tests/daemon/test_encryption.py
    "Checkpoint",  # a part of the store's Manifest: test_checkpoint_is_part_of_the_manifest
    "VerifyVerdict",  # tests/daemon/test_verify.py (the verify helper holds it to its store record)
    "CheckReport",
    "Problem",
    "NetworkLock",  # test_check_report_is_the_wires
    "Registration",  # test_registration_rows_are_the_wires
    "Health",
    "FinishAnswer",
    "SlurmCheckpointAnswer",  # mypy; Health: tests/test_client.py
    "RunAnswer",
    "Job",
    "JobInterval",  # mypy (the integrations build it); tests/k8s/test_auto_interval.py
    "KillAnswer",
    "DumpAnswer",
    "DumpCheckAnswer",
    "RestoreAnswer",
    "RestoreFacts",
    "OpenFile",  # the manifest's restore_facts: test_restore_facts_are_recorded
    # The /k8s answers and Slurm's drain: the daemon builds them as these typed dicts (mypy);
    # tests/k8s, tests/slurm/test_remote.py and the e2e tests read them from a real daemon.
    "NodeInfo",
    "ContainerCheckpointAnswer",
    "RestorePlan",
    "ContainerInfo",
    "RestoreDone",
    "Forgotten",
    "ExportAnswer",
    "EvictedContainer",
    "K8sDrainAnswer",
    "Requeued",
    "SlurmDrainAnswer",
    # A cut across nodes: tests/e2e/test_jobnet_daemon.py reads them from real daemons.
    "FreezeAnswer",
    "ThawAnswer",
    # A part started by the remote listener: tests/e2e/test_mpi_rsh.py, through stasis-rsh.
    "SlurmPartOutput",
    "SlurmPartSignalled",
    # A cut's parts listed, a job's network held, on requeue: tests/e2e/test_mpi_cut.py
    # (through the batch node's daemon and taskinit).
    "SlurmPartList",
    "SlurmPartRef",
    "SlurmPartNet",
}

_PAIR_IDS = [td.__name__ for td, _ in REQUEST_PAIRS]
_NONE = type(None)


def json_kind(annotation: Any) -> Any:
    """What a value of `annotation` is in JSON: a comparable description, the same for a
    TypedDict's annotation and a pydantic field's of the same shape."""
    if annotation is Any:
        return "any"
    if annotation is _NONE or annotation is None:
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return ("literal", frozenset(args))
    if origin is Union or origin is types.UnionType:
        kinds: set[Any] = set()
        for arg in args:
            kind = json_kind(arg)
            kinds |= kind[1] if isinstance(kind, tuple) and kind[0] == "union" else {kind}
        return ("union", frozenset(kinds))
    if origin is list:
        return ("list", json_kind(args[0]))
    if origin is dict:
        return ("dict", json_kind(args[0]), json_kind(args[1]))
    if origin is typing.Annotated:
        return json_kind(args[0])
    if isinstance(annotation, type):
        if annotation is bool:  # before int: bool is an int in Python, not in JSON
            return "bool"
        if annotation in (str, int, float):
            return annotation.__name__
        # pydantic writes datetimes as ISO strings (mode="json"), as the wire reads them.
        if issubclass(annotation, (datetime.datetime, pydantic.AwareDatetime)):
            return "str"
        if issubclass(annotation, BaseModel):
            return (
                "object",
                tuple(
                    sorted(
                        (name, json_kind(f.annotation))
                        for name, f in annotation.model_fields.items()
                    )
                ),
            )
        if typing.is_typeddict(annotation):
            return (
                "object",
                tuple(
                    sorted(
                        (name, json_kind(hint))
                        for name, hint in typing.get_type_hints(annotation).items()
                    )
                ),
            )
    raise AssertionError(f"no JSON kind for {annotation!r}: teach json_kind about it")


def conforms(value: Any, annotation: Any) -> bool:
    """Whether a JSON value (as the daemon builds it) is of the wire's `annotation`."""
    if annotation is Any:
        return True
    if annotation is _NONE or annotation is None:
        return value is None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return value in args
    if origin is Union or origin is types.UnionType:
        return any(conforms(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items()
        )
    if typing.is_typeddict(annotation):
        hints = typing.get_type_hints(annotation)
        return (
            isinstance(value, dict)
            and set(value) == set(hints)
            and all(conforms(value[k], hints[k]) for k in hints)
        )
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    raise AssertionError(f"cannot check a value of {annotation!r}")


def comment_required(td: type) -> set[str]:
    """The fields wire.py's comments call required in a total=False TypedDict."""
    source = inspect.getsource(td)
    return {m.group(1) for m in re.finditer(r"^\s+(\w+):[^#\n]*#[^\n]*\brequired\b", source, re.M)}


def model_required(model: type[BaseModel]) -> set[str]:
    return {name for name, f in model.model_fields.items() if f.is_required()}


def test_json_kind_tells_shapes_apart() -> None:
    # The comparisons below mean something only if different shapes get different kinds.
    assert json_kind(int) != json_kind(bool) != json_kind(float)
    assert json_kind(str | None) == json_kind(typing.Optional[str]) != json_kind(str)
    assert json_kind(list[str]) != json_kind(list[int])
    assert json_kind(Literal["a", "b"]) != json_kind(Literal["a"])
    assert json_kind(dict[str, bool]) != json_kind(dict[str, str])
    assert json_kind(wire.Problem) != json_kind(wire.Health)
    assert json_kind(wire.KillRequest) == json_kind(daemon_models.KillRequest)
    assert json_kind(wire.KillRequest) != json_kind(daemon_models.DumpRequest)


@pytest.mark.parametrize(("td", "model"), REQUEST_PAIRS, ids=_PAIR_IDS)
def test_same_keys(td: type, model: type[BaseModel]) -> None:
    assert set(typing.get_type_hints(td)) == set(model.model_fields)


@pytest.mark.parametrize(("td", "model"), REQUEST_PAIRS, ids=_PAIR_IDS)
def test_same_json_types(td: type, model: type[BaseModel]) -> None:
    hints = typing.get_type_hints(td)
    for name, field in model.model_fields.items():
        assert json_kind(hints[name]) == json_kind(field.annotation), name


@pytest.mark.parametrize(
    ("td", "model"), REQUEST_PAIRS, ids=[td.__name__ for td, _ in REQUEST_PAIRS]
)
def test_required_keys_of_requests(td: type, model: type[BaseModel]) -> None:
    required: frozenset[str] = td.__required_keys__  # type: ignore[attr-defined]
    if td.__total__:  # type: ignore[attr-defined]
        assert required == set(typing.get_type_hints(td))
        assert model_required(model) == required
    else:
        # total=False lets a client leave any field out; the comments say which it may not.
        assert required == frozenset()
        assert model_required(model) == comment_required(td)


def test_required_keys_the_comments_name() -> None:
    # The parse of the comments finds what is there (and only that).
    assert comment_required(wire.RunRequest) == {"command", "cwd"}
    assert comment_required(wire.RegisterRequest) == {"slurm_job", "pid", "label"}
    assert comment_required(wire.DumpRequest) == set()


def test_conforms_tells_values_apart() -> None:
    problem = {"what": "w", "fix": "f"}
    assert conforms(problem, wire.Problem)
    assert not conforms({**problem, "extra": 1}, wire.Problem)
    assert not conforms({"what": "w"}, wire.Problem)
    assert not conforms({"what": 1, "fix": "f"}, wire.Problem)
    assert conforms(None, str | None) and not conforms(None, str)
    assert not conforms(True, int) and conforms(2, float) and not conforms("2", int)
    assert conforms("running", wire.JobState) and not conforms("gone", wire.JobState)


def test_check_report_is_the_wires() -> None:
    from stasis.config import Settings
    from stasis.engine import check

    report = check.run_check(Settings())
    assert conforms(report, wire.CheckReport), report
    assert report["ok"] is (report["problems"] == [])
    assert all(conforms(lock, wire.NetworkLock) for lock in check.network_locks())


def test_registration_rows_are_the_wires(tmp_path: Path) -> None:
    from stasis.daemon.db import JobDB
    from stasis.slurm.registrations import Registrations, slurm_jobs_table

    hints = typing.get_type_hints(wire.Registration)
    # The table holds a registration's fields, no more, no fewer.
    assert {c.name for c in slurm_jobs_table.columns} == set(hints)
    nullable = {c.name for c in slurm_jobs_table.columns if c.nullable}
    assert nullable == {name for name, hint in hints.items() if conforms(None, hint)}
    reg = wire.Registration(
        slurm_job="12",
        pid=40,
        pid_start=None,
        launcher_pid=39,
        uid=1,
        gid=2,
        user="u",
        label="l",
        explicit_label=False,
        token="t",
        stdout="/o",
        stderr="/e",
        work_dir="/w",
        command=["a", "b"],
        state="running",
        registered="2026-01-01T00:00:00+00:00",
        stop_asked=False,
        final_failed=False,
        stop_checkpoint=None,
        restarts=0,
        restored_from=None,
    )
    db = JobDB(tmp_path / "jobs.db")
    try:
        db.create_tables([slurm_jobs_table])
        regs = Registrations(db)
        regs.save(reg)
        got = regs.get("12")
        assert got == reg and got is not None and conforms(got, wire.Registration)
        assert all(conforms(r, wire.Registration) for r in regs.running())
    finally:
        db.engine.dispose()


def test_checkpoint_is_part_of_the_manifest() -> None:
    hints = typing.get_type_hints(wire.Checkpoint)
    fields = Manifest.model_fields
    assert set(hints) <= set(fields), set(hints) - set(fields)
    for name, hint in hints.items():
        assert json_kind(hint) == json_kind(fields[name].annotation), name
    assert wire.Checkpoint.__required_keys__ == set(hints)
    # Every field the wire reads is always in a manifest's JSON (required or defaulted).
    assert "signature" not in hints and "files" not in hints


def test_restore_facts_are_recorded_as_the_wire_has_them() -> None:
    # The engine gathers and compares wire.RestoreFacts; the manifest stores them as its model.
    from stasis.store import RecordedFacts

    field = Manifest.model_fields["restore_facts"]
    assert json_kind(field.annotation) == json_kind(wire.RestoreFacts | None)
    assert json_kind(RecordedFacts) == json_kind(wire.RestoreFacts)
    assert not field.is_required()  # manifests written before them still read


def test_every_wire_shape_is_held_to_something() -> None:
    shapes = {
        name
        for name, value in vars(wire).items()
        if isinstance(value, type) and typing.is_typeddict(value)
    }
    paired = {td.__name__ for td, _ in REQUEST_PAIRS}
    assert shapes == paired | WIRE_ONLY, shapes ^ (paired | WIRE_ONLY)
    # Every request the daemon reads is validated by a model: none is only a typed dict.
    assert paired >= {name for name in shapes if name.endswith("Request")}


def test_error_shape() -> None:
    from stasis.daemon.http import error_body

    body = error_body(NotFoundError("no job x"))
    assert set(body) == {"error"}
    assert set(body["error"]) == set(typing.get_type_hints(wire.WireError))
    assert body["error"] == {"type": "NotFoundError", "message": "no job x"}


def test_a_private_error_travels_as_the_public_one_it_refines() -> None:
    """A half put-back container root (rootfs.PartlyWritten) must reach the runtime as what it
    is, so that the create fails instead of starting fresh on that root."""
    from stasis.daemon.http import error_body
    from stasis.errors import ContainerRootDamagedError, error_from_wire
    from stasis.k8s.rootfs import PartlyWritten

    body = error_body(PartlyWritten("cannot put back the writable layer: disk full"))
    assert body["error"]["type"] == "ContainerRootDamagedError"
    back = error_from_wire(body["error"]["type"], body["error"]["message"])
    assert type(back) is ContainerRootDamagedError


def test_literals_are_the_daemons() -> None:
    assert json_kind(wire.JobState) == json_kind(daemon_models.JobState)
    compress = daemon_models.DumpRequest.model_fields["compress"].annotation
    assert json_kind(wire.CompressionRequest) == json_kind(compress)
    from stasis.store import manifest

    assert json_kind(wire.CompressionRequest) == json_kind(manifest.CompressionRequest)
    assert json_kind(wire.Compression) == json_kind(manifest.Compression)


def _modules_after(statement: str) -> set[str]:
    code = f"{statement}; import sys, json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
        timeout=60,
    )
    return set(json.loads(out.stdout))


_HEAVY = ("pydantic", "typing_extensions", "aiohttp")


def _heavy(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in _HEAVY}


def test_client_and_wire_import_nothing_heavy() -> None:
    loaded = _modules_after("import stasis.client, stasis.wire")
    assert {"stasis.client", "stasis.wire", "stasis.errors"} <= loaded
    assert _heavy(loaded) == set()
    # The check sees them when they are there: the daemon's models pull pydantic in.
    assert "pydantic" in _heavy(_modules_after("import stasis.daemon.models"))


# -- the routes: declared once (stasis/routes.py), served and called from the declarations ------

ALL_ROUTES = (*routes.SOCKET, *routes.SLURM_REMOTE)
# A path parameter's value in the tests below, and the client's arguments that are not the body.
_ID = "X-1"
_SAMPLE: dict[str, object] = {
    "job_id": _ID,
    "slurm_job": _ID,
    "checkpoint_id": _ID,
    "container_id": _ID,
    "exit_code": 0,
    "requested": "auto",
    "interval_s": 60,
    "path": "/tmp/x.tar",
}


def _declared() -> dict[str, routes.AnyRoute]:
    """Every Route of stasis.routes, by the name of its variable."""
    return {n: v for n, v in vars(routes).items() if isinstance(v, routes.Route)}


def test_every_route_is_declared_once() -> None:
    declared = _declared()
    assert set(declared.values()) == set(ALL_ROUTES)
    # 36, FREEZE and THAW, and the remote part routes START, OUTPUT, SIGNAL, FREEZE, DUMP,
    # THAW, DELETE, LIST, NET and RESTORE (issue 31)
    assert len(ALL_ROUTES) == len(set(ALL_ROUTES)) == 48
    assert len({r.name for r in ALL_ROUTES}) == len(ALL_ROUTES)
    assert len({(r.method, r.path) for r in routes.SOCKET}) == len(routes.SOCKET)
    assert routes.SOCKET == routes.CORE + routes.SLURM + routes.K8S
    for r in routes.SLURM:
        assert r.path.startswith("/slurm/") and not r.path.startswith("/slurm/remote/")
    assert all(r.path.startswith("/k8s/") for r in routes.K8S)
    assert all(r.path.startswith("/slurm/remote/") for r in routes.SLURM_REMOTE)
    for r in ALL_ROUTES:
        assert r.caller in typing.get_args(routes.Caller), r
        assert r.method in typing.get_args(routes.Method), r
        # A body's shape is a typed dict of the wire; so is every answer, or a list of them.
        assert r.request is None or typing.is_typeddict(r.request), r
        # A route refused to all but root says so in its own words.
        assert (r.caller in ("root", "cluster-root")) == ("may call" not in r.denied), r


@pytest.mark.parametrize("name", sorted(_declared()))
def test_a_routes_annotation_is_its_types(name: str) -> None:
    """`X: Route[Req, Ans] = Route(request=..., answer=...)`: the annotation mypy types the
    client with says what the declaration does."""
    route = _declared()[name]
    hint = typing.get_type_hints(routes, localns={"wire": wire})[name]
    assert typing.get_origin(hint) is routes.Route
    req, ans = typing.get_args(hint)
    assert req is (_NONE if route.request is None else route.request)
    assert ans == route.answer


def test_a_route_url_is_one_segment_per_parameter() -> None:
    assert routes.KILL.url(job="abc") == "/jobs/abc/kill"
    assert routes.KILL.url(job="../check") == "/jobs/..%2Fcheck/kill"
    assert routes.K8S_EXPORT.params == ("checkpoint",)
    with pytest.raises(TypeError):
        routes.KILL.url()
    with pytest.raises(TypeError):
        routes.JOBS.url(job="x")
    with pytest.raises(AttributeError):
        routes.KILL.path = "/elsewhere"


def test_every_request_has_its_model_and_every_model_its_route() -> None:
    requests = {r.request for r in ALL_ROUTES if r.request is not None}
    assert requests == set(MODELS), requests ^ set(MODELS)


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[Any]:
    """A real JobManager on a private state directory (no daemon): to build the apps."""
    from stasis.config import Settings
    from stasis.daemon.db import JobDB
    from stasis.daemon.jobs import JobManager
    from stasis.store import Store, node_keyring

    settings = Settings(state_dir=tmp_path / "state", store=str(tmp_path / "store"))
    settings.state_dir.mkdir()
    store = Store(
        settings.store_url,
        staging_root=settings.layout.staging,
        keep=settings.keep,
        keys=node_keyring(settings, create=True),
    )
    db = JobDB(settings.layout.db)
    m = JobManager(settings, store, db)
    yield m
    m.close()
    db.engine.dispose()


def _served(app: Any) -> set[tuple[str, str]]:
    return {
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }


def test_the_server_serves_exactly_the_declarations(manager: Any) -> None:
    from stasis.daemon.api import make_app
    from stasis.k8s.integration import K8sIntegration
    from stasis.slurm.integration import SlurmIntegration

    slurm, k8s = SlurmIntegration(manager), K8sIntegration(manager)
    try:
        socket_app = make_app(manager, [slurm, k8s])
        assert _served(socket_app) == {(r.method, r.path) for r in routes.SOCKET}
        assert _served(slurm.remote_app()) == {(r.method, r.path) for r in routes.SLURM_REMOTE}
        # Each is served by the handler of its name, an object's method (no closure of an app
        # factory), and no handler waits for a route.
        for integration, declared in (
            (slurm, routes.SLURM + routes.SLURM_REMOTE),
            (k8s, routes.K8S),
        ):
            for r in declared:
                assert inspect.ismethod(getattr(integration, r.name)), r
        from stasis.daemon.api import CoreRoutes

        handlers = {n for n, v in vars(CoreRoutes).items() if inspect.isfunction(v)} - {"__init__"}
        assert handlers == {r.name for r in routes.CORE}
    finally:
        k8s.close()
        slurm.close()


class _Recorder:
    """A unix socket that records each request (method, path, JSON body) and answers `{}` (a
    streamed route's result line): what the client sends, by a real socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.seen: list[tuple[str, str, Any]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, conn.makefile("rb") as f:
                method, target, _ = f.readline().decode().split(" ", 2)
                length = 0
                while (line := f.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.decode().partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                body = json.loads(f.read(length)) if length else None
                self.seen.append((method, target, body))
                conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n" + b'{"result": {}}\n')

    def close(self) -> None:
        self.sock.close()


def _args(method: Any) -> dict[str, object]:
    """The client method's arguments that are not the body, filled with samples."""
    return {
        name: _SAMPLE[name]
        for name, p in inspect.signature(method).parameters.items()
        if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty
    }


def test_the_client_calls_each_route_as_declared(tmp_path: Path) -> None:
    from stasis.client import Client

    recorder = _Recorder(tmp_path / "api.sock")
    client = Client(tmp_path / "api.sock", timeout_s=10)
    try:
        for r in routes.SOCKET:
            method = getattr(client, r.name)  # one method per route, named after it
            recorder.seen.clear()
            method(**_args(method))
            [(verb, target, body)] = recorder.seen
            assert verb == r.method, r
            assert target.split("?")[0] == r.url(**{p: _ID for p in r.params}), r
            if r.request is None:
                assert body is None, r
            else:
                assert isinstance(body, dict) and set(body) <= set(
                    typing.get_type_hints(r.request)
                ), (r, body)
        recorder.seen.clear()
        client.checkpoints(label="a b", user="u")
        assert recorder.seen == [("GET", "/checkpoints?label=a+b&user=u", None)]
        # Nothing but the routes' methods calls the daemon: every public method is one.
        public = {
            n for n, v in vars(Client).items() if inspect.isfunction(v) and not n.startswith("_")
        }
        assert public - {r.name for r in routes.SOCKET} == {"call", "close", "request", "stream"}
    finally:
        recorder.close()


_ROOT_ONLY = [r for r in routes.SOCKET if r.caller == "root"]


def test_root_routes_refuse_everyone_else_through_the_socket(daemon: Any, test_user: Any) -> None:
    """Each root-only route, called as another user by its client method through the daemon's
    socket: refused with the declaration's words, as PermissionDeniedError (the one envelope,
    mapped back to the one exception tree); a local route answers that user."""
    from stasis.client import Client

    probe = Client(Path("/nonexistent"))
    calls = {r.name: _args(getattr(probe, r.name)) for r in _ROOT_ONLY}
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from stasis.client import Client\n"
        "c = Client(Path(sys.argv[1]), timeout_s=60)\n"
        "out = {'check': c.check()['kernel'] != '', 'refused': {}}\n"
        "for name, args in json.loads(sys.argv[2]).items():\n"
        "    try:\n"
        "        getattr(c, name)(**args)\n"
        "        out['refused'][name] = None\n"
        "    except Exception as e:\n"
        "        out['refused'][name] = [type(e).__module__, type(e).__name__, str(e)]\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run(
        [
            "runuser",
            "-u",
            TEST_USER,
            "--",
            "env",
            f"PYTHONPATH={ROOT}",
            sys.executable,
            "-c",
            code,
            str(daemon.socket),
            json.dumps(calls),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=True,
    )
    out = json.loads(result.stdout)
    assert out["check"] is True
    assert len(out["refused"]) == len(_ROOT_ONLY) == 14
    for r in _ROOT_ONLY:
        assert out["refused"][r.name] == [
            "stasis.errors",
            "PermissionDeniedError",
            f"permission denied: {r.denied}",
        ], r


_PATH_PREFIXES = sorted({r.path.split("/")[1] for r in ALL_ROUTES})
_ROUTE_PATH = re.compile(rf"^/({'|'.join(map(re.escape, _PATH_PREFIXES))})(/|\?|$)")


def _route_literals(path: Path) -> list[str]:
    """The string literals of a module (f-strings' pieces too, docstrings and comment strings
    not) that look like an API path."""
    tree = ast.parse(path.read_text())
    skip = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return [
        f"{path}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in skip
        and _ROUTE_PATH.match(node.value)
    ]


def test_no_api_path_outside_the_declarations() -> None:
    package = ROOT / "stasis"
    skipped = {package / "routes.py"}
    found = [
        hit
        for path in sorted(package.rglob("*.py"))
        if path not in skipped and "controlplane" not in path.relative_to(package).parts
        for hit in _route_literals(path)
    ]
    assert found == [], "\n".join(found)
    # The scan sees a path where one is written.
    assert _route_literals(package / "routes.py")
    assert _ROUTE_PATH.match("/k8s/containers/") and not _ROUTE_PATH.match("/checkpointsx")


def test_k8s_errors_come_back_as_the_one_tree(daemon: Any) -> None:
    """/k8s answers its errors in the one envelope too: the client raises the class the
    daemon named, with its one line (validation, an unknown container, a bad id)."""
    from stasis.client import Client
    from stasis.errors import UsageError

    client = Client(daemon.socket, timeout_s=60)
    with pytest.raises(UsageError) as bad_body:
        client.k8s_interval("a" * 64, -5)
    assert type(bad_body.value) is UsageError and "interval_s" in str(bad_body.value)
    with pytest.raises(NotFoundError, match="no container .* under stasis on this node"):
        client.k8s_checkpoint("a" * 64, reason="manual")
    with pytest.raises(UsageError, match="invalid container id"):
        client.k8s_checkpoint("not/an id", reason="manual")
    assert "\n" not in str(bad_body.value)


def test_the_client_creates_no_typed_dict_at_its_start() -> None:
    # The routes' types are read from their annotations when the server or a test asks: a
    # command (`stasis ps`) imports the client and the routes, never the wire (~3 ms).
    loaded = _modules_after("import stasis.client, stasis.routes, stasis.cli.main")
    assert {"stasis.client", "stasis.routes"} <= loaded
    assert "stasis.wire" not in loaded and _heavy(loaded) == set()
