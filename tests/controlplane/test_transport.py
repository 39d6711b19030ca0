"""How a token travels to and sits beside the control plane (issue 27, item 7), each played as
the attacker would: someone on the network between a node and a control plane reached over plain
http:// (a listener on this host's non-loopback address records every byte it is sent); a user
who planted a link where `serve --admin-token-file` writes; a dashboard behind a TLS-terminating
proxy, whose session cookie must not go out over plain HTTP."""

from __future__ import annotations

import http.client
import json
import os
import pwd
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import STASIS, new_daemon, wait_for
from tests.controlplane.conftest import ControlPlane
from tests.s3server import free_ports

SECRET = "stasis_" + "s3cr3t" * 8  # what the eavesdropper hopes to read


def outside_address() -> str:
    """An IPv4 address of this host that is not loopback (what a node on the network uses)."""
    out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True)
    for link in json.loads(out.stdout):
        for a in link.get("addr_info", []):
            if not a["local"].startswith("127.") and a.get("scope") == "global":
                return str(a["local"])
    pytest.fail("this host has no non-loopback IPv4 address to play the network on")


class Eavesdropper:
    """A TCP listener on the network address: every connection and byte sent to it."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.2)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.heard = b""
        self.connections = 0
        self._stop = False
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.settimeout(1.0)
            try:
                self.heard += conn.recv(65536)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close()


def test_a_node_refuses_plain_http_off_loopback_and_joins_when_the_site_allows_it(
    world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    host = outside_address()
    ear = Eavesdropper(host)
    refused = new_daemon(
        world_tmp,
        "node-plain",
        env={
            "STASIS_CONTROLPLANE_URL": ear.url,
            "STASIS_CLUSTER_ID": "cl_0123456789",
            "STASIS_AUTH_TOKEN": SECRET,
            "STASIS_NODE_NAME": "node-plain",
            "STASIS_CONTROLPLANE_HEARTBEAT_S": "0.2",
        },
    )
    try:
        refused.start()
        time.sleep(2.0)  # ten heartbeats' time: a joining node would have sent its token
        assert ear.connections == 0 and SECRET.encode() not in ear.heard, ear.heard[:300]
        log = (refused.root / "daemon.log").read_text()
        (line,) = [x for x in log.splitlines() if "not joining the control plane" in x]
        assert f"refused control plane URL {ear.url}: plain http:// to {host}" in line
        assert "https://" in line and "STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP=1" in line
        assert SECRET not in log
        refused.cli("ps")  # the node still serves its users, unjoined
        # The admin CLI, which sends the admin token, refuses the same URL.
        r = subprocess.run(
            [STASIS, "controlplane", "nodes"],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **os.environ,
                "STASIS_CONFIG": "",
                "STASIS_CONTROLPLANE_URL": ear.url,
                "STASIS_AUTH_TOKEN": SECRET,
            },
        )
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "refused control plane URL" in r.stderr
        assert ear.connections == 0
    finally:
        refused.stop()
        ear.close()

    # Said so (a site's own network): the node joins over plain HTTP.
    cp = ControlPlane(Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)), "")
    cp.db = str(cp.root / "cp.db")
    cp.start("--listen", f"0.0.0.0:{cp.port}", "--allow-plain-http")
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    allowed = new_daemon(
        world_tmp,
        "node-allowed",
        env={
            "STASIS_CONTROLPLANE_URL": f"http://{host}:{cp.port}",
            "STASIS_CLUSTER_ID": hpc["cluster_id"],
            "STASIS_AUTH_TOKEN": hpc["token"],
            "STASIS_NODE_NAME": "node-allowed",
            "STASIS_CONTROLPLANE_HEARTBEAT_S": "0.5",
            "STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP": "1",
        },
    )
    try:
        allowed.start()
        wait_for(
            lambda: [n["name"] for n in cp.json("nodes")] == ["node-allowed"],
            30,
            "the allowed node to join",
        )
    finally:
        allowed.stop()
        cp.stop()


def test_join_refuses_plain_http_off_loopback_unless_told(world_tmp: Path) -> None:
    config = world_tmp / "join" / "config.toml"
    env = {**os.environ, "STASIS_CONFIG": "", "STASIS_AUTH_TOKEN": SECRET}

    def join(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                STASIS,
                "controlplane",
                "join",
                "--config",
                str(config),
                "--url",
                url,
                "--cluster-id",
                "cl_1",
                "--node",
                "n1",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )

    r = join("http://192.0.2.77:8470")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "refused control plane URL http://192.0.2.77:8470" in r.stderr
    assert not config.exists()
    for url in (
        "http://127.0.0.1:8470",
        "http://[::1]:8470",
        "http://localhost:8470",
        "https://cp.example:8470",
    ):
        r = join(url)
        assert r.returncode == 0, (url, r.stderr)
        assert "allow_plain_http" not in config.read_text()
    r = join("http://192.0.2.77:8470", "--allow-plain-http")
    assert r.returncode == 0, r.stderr
    written = config.read_text()
    assert "controlplane_allow_plain_http = true" in written
    assert 'controlplane_url = "http://192.0.2.77:8470"' in written
    config.unlink()
    env["STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP"] = "1"  # the setting says so instead
    r = join("http://192.0.2.77:8470")
    assert r.returncode == 0, r.stderr
    assert "controlplane_allow_plain_http = true" in config.read_text()
    assert os.stat(config).st_mode & 0o777 == 0o600


def _serve(cp: ControlPlane, token_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            STASIS,
            "controlplane",
            "serve",
            "--db",
            cp.db,
            "--listen",
            f"127.0.0.1:{cp.port}",
            "--admin-token-file",
            str(token_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "STASIS_CONFIG": "", "STASIS_STATE_DIR": str(cp.root)},
    )


def test_a_planted_admin_token_file_is_refused_and_the_token_is_not_lost(world_tmp: Path) -> None:
    cp = ControlPlane(Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)), "")
    cp.db = str(cp.root / "cp.db")
    victim = world_tmp / "victim"
    victim.write_text("root's own file\n")
    os.chmod(victim, 0o644)
    planted = cp.root / "admin.token"
    dangling = cp.root / "dangling.token"
    regular = cp.root / "existing.token"
    planted.symlink_to(victim)
    dangling.symlink_to(world_tmp / "created-through-the-link")
    regular.write_text("someone's\n")
    for path in (planted, dangling, regular):
        r = _serve(cp, path)
        assert r.returncode == 2, (path, r.stdout, r.stderr)
        # The log lines of the start (its migrations) before it, then the one refusal.
        assert r.stderr.strip().splitlines()[-1] == (
            f"stasis: error: refused --admin-token-file {path}: "
            "something is there already (a file or a link, not "
            "followed); remove it, or name a new path"
        ), r.stderr
        assert "stasis_" not in r.stdout + r.stderr
    assert victim.read_text() == "root's own file\n" and os.stat(victim).st_mode & 0o777 == 0o644
    assert not (world_tmp / "created-through-the-link").exists()
    assert regular.read_text() == "someone's\n"
    # Nothing lost: no admin token was made for the refused starts; the next one makes it.
    cp.token_file = cp.root / "fresh.token"
    cp.start("--admin-token-file", str(cp.token_file))
    try:
        assert os.stat(cp.token_file).st_mode & 0o777 == 0o600
        assert cp.call("GET", "/api/v1/clusters", cp.admin)[0] == 200
        # A restart with the same file there: no new token, no refusal.
        cp.stop()
        cp.start("--admin-token-file", str(cp.token_file))
        assert cp.call("GET", "/api/v1/clusters", cp.admin)[0] == 200
    finally:
        cp.stop()


def _login_cookie(host: str, port: int, token: str, context: ssl.SSLContext | None = None) -> str:
    conn: http.client.HTTPConnection = (
        http.client.HTTPSConnection(host, port, context=context, timeout=20)
        if context
        else http.client.HTTPConnection(host, port, timeout=20)
    )
    body = urllib.parse.urlencode({"token": token})
    conn.request(
        "POST",
        "/ui/login",
        body=body,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    r = conn.getresponse()
    assert r.status == 303, (r.status, r.read())
    cookie = r.getheader("Set-Cookie") or ""
    conn.close()
    assert cookie.startswith("stasis_session="), cookie
    return cookie


def _attributes(cookie: str) -> set[str]:
    return {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}


def test_the_dashboard_behind_a_tls_proxy_sends_secure_cookies(world_tmp: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp))
    cp = ControlPlane(root, str(root / "cp.db"))
    cp.start()
    try:  # plain HTTP, no proxy said: a cookie a plain-HTTP browser can send back
        assert "secure" not in _attributes(_login_cookie("127.0.0.1", cp.port, cp.admin))
    finally:
        cp.stop()
    cp.start("--behind-tls")
    try:
        cookie = _login_cookie("127.0.0.1", cp.port, cp.admin)
        assert {"secure", "httponly", "samesite"} <= _attributes(cookie), cookie
        # The installers name the URL the nodes reach: the proxy's https://.
        slurm = cp.json("clusters", "add", "hpc", "--kind", "slurm")
        req = urllib.request.Request(
            cp.url + "/install/slurm", headers={"Authorization": f"Bearer {slurm['token']}"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            script = r.read().decode()
        assert f"\nurl=https://127.0.0.1:{cp.port}\n" in script
    finally:
        cp.stop()

    # Over HTTPS itself.
    cert, key = root / "cert.pem", root / "key.pem"
    r = subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    tls = ControlPlane(root, str(root / "cp.db"))
    tls.port = free_ports(1)[0]
    tls.url = f"https://127.0.0.1:{tls.port}"
    tls.cafile = cert  # this process's own calls trust it
    try:
        tls.start("--cert", str(cert), "--key", str(key), "--listen", f"127.0.0.1:{tls.port}")
        context = ssl.create_default_context(cafile=str(cert))
        assert "secure" in _attributes(_login_cookie("127.0.0.1", tls.port, tls.admin, context))
    finally:
        tls.stop()
