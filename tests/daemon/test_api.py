"""The daemon's HTTP API over its raw unix socket (http.client, not stasis.client): every route
of stasis/daemon/api.py and of the Slurm integration answers JSON; unknown routes and wrong
methods get the one-line error shape; an integration's routes live under /<name>/."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from stasis import wire
from stasis.config import Settings
from stasis.daemon.api import make_app
from stasis.daemon.db import JobDB
from stasis.daemon.integration import Integration
from stasis.daemon.jobs import JobManager
from stasis.routes import AnyRoute, Route
from stasis.slurm.integration import SlurmIntegration
from stasis.store import Store, node_keyring
from tests.conftest import Daemon, wait_for
from tests.test_wire import conforms

UNKNOWN_SLURM_JOB = "987654321"


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("stasis", timeout=120)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(120)
        sock.connect(str(self.unix_path))
        self.sock = sock


class Answer(typing.NamedTuple):
    status: int
    content_type: str
    raw: bytes

    def json(self) -> Any:
        return json.loads(self.raw)

    def lines(self) -> list[Any]:
        return [json.loads(line) for line in self.raw.splitlines() if line.strip()]


def call(sock: Path, method: str, path: str, body: Any = None, raw: bytes | None = None) -> Answer:
    conn = UnixHTTPConnection(sock)
    try:
        payload = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, path, body=payload, headers=headers)
        resp = conn.getresponse()
        return Answer(resp.status, resp.getheader("Content-Type", ""), resp.read())
    finally:
        conn.close()


def keys(td: type) -> set[str]:
    return set(typing.get_type_hints(td))


def assert_error(answer: Answer, status: int, kind: str) -> str:
    """The one-line error shape; returns the message."""
    assert answer.status == status, answer
    assert answer.content_type.startswith("application/json"), answer
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == keys(wire.WireError), body
    assert body["error"]["type"] == kind, body
    message: str = body["error"]["message"]
    assert message and "\n" not in message
    return message


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[JobManager]:
    """A real JobManager on a private state directory (no daemon): to build the app's routes."""
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


def app_routes(app: web.Application) -> set[tuple[str, str]]:
    return {
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }


class Recorder:
    """Calls routes and remembers which of the app's route templates each call reached."""

    def __init__(self, sock: Path, routes: set[tuple[str, str]]) -> None:
        self.sock = sock
        self.patterns = {
            (m, t): re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", t) + "$") for m, t in routes
        }
        self.seen: set[tuple[str, str]] = set()

    def __call__(self, method: str, path: str, body: Any = None) -> Answer:
        answer = call(self.sock, method, path, body)
        bare = path.split("?")[0]
        self.seen |= {
            route
            for route, pattern in self.patterns.items()
            if route[0] == method and pattern.match(bare)
        }
        return answer


def json_answer(answer: Answer, status: int = 200) -> Any:
    assert answer.status == status, answer
    assert answer.content_type.startswith("application/json"), answer
    return answer.json()


def stream_result(answer: Answer) -> Any:
    assert answer.status == 200, answer
    assert answer.content_type.startswith("application/x-ndjson"), answer
    lines = answer.lines()
    for line in lines[:-1]:
        assert set(line) == {"progress"} and set(line["progress"]) == keys(wire.Progress), line
    assert set(lines[-1]) == {"result"}, lines[-1]
    return lines[-1]["result"]


def test_every_route_answers_json(daemon: Daemon, manager: JobManager) -> None:
    routes = app_routes(make_app(manager, [SlurmIntegration(manager)]))
    assert len(routes) == 25  # stasis/routes.py: CORE and SLURM
    req = Recorder(daemon.socket, routes)

    ran = json_answer(
        req("POST", "/jobs", {"command": ["sleep", "600"], "cwd": "/", "label": "api-sleep"})
    )
    assert conforms(ran, wire.RunAnswer) and ran["label"] == "api-sleep"
    job_id = ran["job"]
    listed = json_answer(req("GET", "/jobs"))
    assert job_id in [j["job"] for j in listed]
    job = json_answer(req("GET", f"/jobs/{job_id}"))
    assert conforms(job, wire.Job) and job["state"] == "running"

    # sleep's timed wait is what a restore cuts short: said, not an obstacle (once sleep got
    # there: on a loaded machine the job may still be starting at the first look).
    def noted() -> Any:
        found = json_answer(req("GET", f"/jobs/{job_id}/dump-check"))
        return found if found["notes"] else None

    checked: Any = wait_for(noted, 15, "sleep in its timed wait")
    assert conforms(checked, wire.DumpCheckAnswer)
    assert checked["job"] == job_id and checked["obstacles"] == []
    assert len(checked["notes"]) == 1 and "clock_nanosleep" in checked["notes"][0]

    # A job outside a job network is no part to freeze for a cut across nodes, and none is
    # frozen to thaw (tests/e2e/test_jobnet_daemon.py freezes and thaws parts).
    refused = assert_error(req("POST", f"/jobs/{job_id}/freeze", {}), 400, "UsageError")
    assert "cgroup of its own" in refused
    refused = assert_error(req("POST", f"/jobs/{job_id}/thaw", {}), 400, "UsageError")
    assert f"job {job_id} is not frozen" in refused

    dumped = stream_result(req("POST", f"/jobs/{job_id}/dump", {}))
    assert conforms(dumped, wire.DumpAnswer) and dumped["job"] == job_id
    cp = dumped["checkpoint"]
    assert json_answer(req("GET", f"/jobs/{job_id}"))["state"] == "checkpointed"
    cps = json_answer(req("GET", "/checkpoints?label=api-sleep"))
    assert [c["id"] for c in cps] == [cp]
    assert cp in [c["id"] for c in json_answer(req("GET", "/checkpoints"))]

    checked = json_answer(req("GET", f"/checkpoints/{cp}/check"))
    assert conforms(checked, wire.CheckpointCheck) and checked["restorable"] is True
    assert all(conforms(f, wire.CompatFact) for f in checked["facts"])
    restored = stream_result(req("POST", "/restore", {"checkpoint": cp}))
    assert conforms(restored, wire.RestoreAnswer) and restored["checkpoint"] == cp
    killed = json_answer(req("POST", f"/jobs/{restored['job']}/kill", {"timeout_s": 0}))
    assert conforms(killed, wire.KillAnswer)
    assert killed["state"] == "exited" and killed["ended_by"] == "SIGKILL"
    verdict = json_answer(req("POST", f"/checkpoints/{cp}/verify", {}))
    assert conforms(verdict, wire.VerifyVerdict) and verdict["checkpoint"] == cp, verdict
    assert verdict["ok"], verdict
    assert json_answer(req("DELETE", f"/checkpoints/{cp}")) == {"deleted": cp}
    assert json_answer(req("GET", "/checkpoints?label=api-sleep")) == []

    gc = json_answer(req("POST", "/checkpoints/gc", {"idle_s": 3600}))
    assert conforms(gc, wire.GcAnswer) and gc["partial"] == []
    # This daemon has no encryption key: nothing to re-wrap with (tests/daemon/test_encryption.py
    # has the answer of one that has).
    assert "encryption" in assert_error(req("POST", "/checkpoints/rekey"), 400, "UsageError")

    report = json_answer(req("GET", "/check"))
    assert conforms(report, wire.CheckReport) and report["kernel"] == os.uname().release
    locks = json_answer(req("GET", "/network-locks"))
    assert isinstance(locks, list) and all(conforms(n, wire.NetworkLock) for n in locks)
    # No Slurm job asked for an interval here: none listed (tests/e2e/test_slurm_intervals.py).
    assert json_answer(req("GET", "/intervals")) == []

    assert json_answer(req("GET", "/slurm/health")) == {"ok": True}
    assert "not a child" in assert_error(
        req(
            "POST",
            "/slurm/jobs",
            {"slurm_job": UNKNOWN_SLURM_JOB, "pid": os.getpid(), "label": UNKNOWN_SLURM_JOB},
        ),
        403,
        "PermissionDeniedError",
    )
    assert_error(req("GET", f"/slurm/jobs/{UNKNOWN_SLURM_JOB}"), 404, "NotFoundError")
    assert_error(
        req("POST", f"/slurm/jobs/{UNKNOWN_SLURM_JOB}/checkpoint", {}), 404, "NotFoundError"
    )
    assert_error(
        req("POST", f"/slurm/jobs/{UNKNOWN_SLURM_JOB}/finish", {"exit_code": 0}),
        404,
        "NotFoundError",
    )
    assert_error(
        req("POST", f"/slurm/jobs/{UNKNOWN_SLURM_JOB}/interval", {"requested": "auto"}),
        404,
        "NotFoundError",
    )
    assert isinstance(json_answer(req("GET", "/slurm/intervals")), list)

    assert req.seen == routes, routes - req.seen


def test_unknown_route_is_a_json_404(daemon: Daemon) -> None:
    for method, path in (
        ("GET", "/nope"),
        ("POST", "/jobs/0123456789ab/nope"),
        ("GET", "/slurm"),
        ("GET", "/slurm/nope"),
        ("GET", "/"),
    ):
        message = assert_error(call(daemon.socket, method, path), 404, "UsageError")
        assert "404" in message, message


def test_wrong_method_is_a_json_405(daemon: Daemon) -> None:
    for method, path in (
        ("DELETE", "/jobs"),
        ("PUT", "/check"),
        ("GET", "/restore"),
        ("POST", "/network-locks"),
        ("GET", "/slurm/jobs"),
        ("DELETE", "/slurm/health"),
        ("GET", "/jobs/0123456789ab/kill"),
    ):
        message = assert_error(call(daemon.socket, method, path), 405, "UsageError")
        assert "405" in message, message


def test_bad_bodies_and_stream_errors(daemon: Daemon) -> None:
    assert "not JSON" in assert_error(
        call(daemon.socket, "POST", "/jobs", raw=b"{nope"), 400, "UsageError"
    )
    assert_error(
        call(daemon.socket, "POST", "/jobs", {"command": ["true"], "cwd": "/", "extra": 1}),
        400,
        "UsageError",
    )
    # (An empty finish report is valid since issue 28: no exit status, which retires nothing.)
    assert_error(
        call(daemon.socket, "POST", "/slurm/jobs/1/finish", {"exit_code": "zero"}),
        400,
        "UsageError",
    )
    # A dump that cannot start: the stream has begun, its one line is the error.
    answer = call(daemon.socket, "POST", "/jobs/000000000000/dump", {})
    assert answer.status == 200 and answer.content_type.startswith("application/x-ndjson")
    lines = answer.lines()
    assert len(lines) == 1 and set(lines[0]) == {"error"}
    assert lines[0]["error"]["type"] == "NotFoundError"
    assert set(lines[0]["error"]) == keys(wire.WireError)


def test_slurm_routes_live_under_slurm(manager: JobManager) -> None:
    slurm = SlurmIntegration(manager)
    paths = [r.path for r in slurm.routes()]
    assert paths and all(p.startswith("/slurm/") for p in paths)
    slurm.check_routes()
    core = app_routes(make_app(manager))
    both = app_routes(make_app(manager, [slurm]))
    assert {t for _, t in both - core} == set(paths)
    assert not any(t.startswith("/slurm") for _, t in core)


class Toy(Integration):
    name = "toy"

    def __init__(self, manager: JobManager, paths: Sequence[str]) -> None:
        super().__init__(manager)
        self.paths = paths

    def routes(self) -> Sequence[AnyRoute]:
        return [
            Route(f"r{i}", "GET", p, answer=dict, caller="local") for i, p in enumerate(self.paths)
        ]

    def __getattr__(self, name: str) -> Any:
        return lambda call: {}  # every route's handler: an empty answer


def test_check_routes_refuses_a_route_outside_its_name(manager: JobManager) -> None:
    Toy(manager, ["/toy/a", "/toy/b/{x}"]).check_routes()
    Toy(manager, []).check_routes()
    for bad in ("/jobs", "/toys/a", "/toy", "/slurm/health", "toy/a"):
        with pytest.raises(ValueError, match="not under /toy/"):
            Toy(manager, ["/toy/ok", bad]).check_routes()
    # make_app asks: an integration cannot take a core route.
    with pytest.raises(ValueError, match="/jobs"):
        make_app(manager, [Toy(manager, ["/jobs"])])
    assert ("GET", "/toy/a") in app_routes(make_app(manager, [Toy(manager, ["/toy/a"])]))
