"""The control plane as its users run it: `stasis controlplane serve` as a process, on SQLite and
on a real PostgreSQL (tests/pgserver.py), driven with the admin CLI and plain HTTP."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import nodes
from tests.conftest import STASIS, wait_for
from tests.pgserver import PostgresServer
from tests.s3server import free_ports


@pytest.fixture(scope="session")
def postgres(world_tmp: Path) -> Iterator[PostgresServer]:
    server = PostgresServer(Path(tempfile.mkdtemp(prefix="pg-", dir=world_tmp)))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class ControlPlane:
    """`host`: the address it listens on; nodes of their own (`new_daemon(separate=True)`) reach
    it on `tests.nodes.site_address()` (plain http off loopback, allowed: a test's private
    network)."""

    def __init__(self, root: Path, db: str, host: str = "127.0.0.1") -> None:
        self.root = root
        self.db = db
        self.host = host
        self.port = free_ports(1)[0]
        self.url = f"http://{host}:{self.port}"
        # What a node and the CLI need to talk to it (plain http off loopback is refused).
        self.client_env = (
            {} if host == "127.0.0.1" else {"STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP": "true"}
        )
        self.token_file = root / "admin.token"
        self.log = root / "controlplane.log"
        # A certificate (PEM) this process's own calls trust: not SSL_CERT_FILE set meanwhile,
        # which urllib under Python 3.13 (Debian 13) no longer reads once it has made its
        # default opener (its HTTPS context is made with it, at this process's first urlopen).
        self.cafile: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._last = "none"

    def start(self, *extra: str) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    STASIS,
                    "controlplane",
                    "serve",
                    "--db",
                    self.db,
                    "--listen",
                    f"{self.host}:{self.port}",
                    "--admin-token-file",
                    str(self.token_file),
                    *(["--allow-plain-http"] if self.client_env else []),
                    # Policies every second: the floor is lowered (a test may raise it again).
                    "--lost-after",
                    "3",
                    "--min-interval",
                    "1",
                    *extra,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "STASIS_CONFIG": "", "STASIS_STATE_DIR": str(self.root)},
            )
        try:
            wait_for(self._healthy, 30, "the control plane")
        except AssertionError as e:
            raise AssertionError(
                f"{e}; {self.log} ends: {self.log.read_text()[-2000:]}"
                f"; last health check: {self._last}"
            ) from None

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"control plane exited: {self.log.read_text()}")
        try:
            return bool(self.call("GET", "/api/v1/health")[1].get("ok"))
        except OSError as e:
            self._last = f"{type(e).__name__}: {e}"
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)

    @property
    def admin(self) -> str:
        return self.token_file.read_text().strip()

    def call(
        self,
        method: str,
        path: str,
        token: str | None = None,
        body: Any = None,
        raw: bytes | None = None,
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        context = ssl.create_default_context(cafile=str(self.cafile)) if self.cafile else None
        try:
            with urllib.request.urlopen(req, timeout=20, context=context) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, said(json.loads(e.read()))

    def cli(self, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            **self.client_env,
            "STASIS_CONFIG": "",
            "STASIS_CONTROLPLANE_URL": self.url,
            "STASIS_AUTH_TOKEN": self.admin if token is None else token,
        }
        return subprocess.run(
            [STASIS, "controlplane", *args], capture_output=True, text=True, timeout=60, env=env
        )

    def json(self, *args: str, token: str | None = None) -> Any:
        r = self.cli(*args, "--json", token=token)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


def said(answer: Any) -> Any:
    """An error answer as the tests read it, {"error": its message}, once its envelope is
    checked: {"error": {"type": a class of stasis.errors, "message": str}}."""
    from stasis.errors import StasisError, error_from_wire

    error = answer["error"]
    assert set(error) == {"type", "message"}, answer
    assert error["type"] == "StasisError" or type(error_from_wire(error["type"], "")) is not (
        StasisError
    ), answer
    assert isinstance(error["message"], str), answer
    return {**answer, "error": error["message"]}


# Every test of the control plane runs on both databases unless marked SQLITE_ONLY: one whose
# outcome the database does not decide (it is computed in Python, or the same statements run on
# PostgreSQL in a test kept on both). Migrations, leases, locking (FOR UPDATE), unique
# constraints, time comparisons in SQL, aggregates and hostile bytes stored stay on both.
SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, world_tmp: Path) -> str:
    if request.param == "sqlite":
        return str(Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)) / "controlplane.db")
    server: PostgresServer = request.getfixturevalue("postgres")
    return server.new_database()


@pytest.fixture
def controlplane(db_url: str, world_tmp: Path) -> Iterator[ControlPlane]:
    cp = ControlPlane(Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)), db_url)
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def site_controlplane(db_url: str, world_tmp: Path) -> Iterator[ControlPlane]:
    """The control plane on the network of the nodes of their own (tests/nodes.py)."""
    cp = ControlPlane(
        Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)), db_url, host=nodes.site_address()
    )
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()
