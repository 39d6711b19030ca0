"""The control plane's API and admin CLI, the same tests on SQLite and on PostgreSQL: the admin
token made once, clusters and their tokens, who may call what, hostile input, restarts."""

from __future__ import annotations

import json
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import STASIS
from tests.controlplane.conftest import SQLITE_ONLY, ControlPlane

NODE = {
    "name": "n1",
    "host": "n1.example",
    "stasis_version": "0.1.0",
    "criu_version": "4.2.1",
    "check_ok": True,
    "problems": [],
}


def test_the_admin_token_is_made_once_kept_hashed_and_the_data_survives_a_restart(
    controlplane: ControlPlane,
) -> None:
    cp = controlplane
    token = cp.admin
    assert token.startswith("stasis_") and len(token) > 40
    assert stat.S_IMODE(cp.token_file.stat().st_mode) == 0o600
    assert token not in cp.log.read_text()
    added = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    assert added["cluster_id"].startswith("cl_") and added["token"].startswith("stasis_")
    cp.stop()
    cp.token_file.unlink()
    cp.start()  # migrations again (nothing to do), no second admin token
    assert not cp.token_file.exists()
    status, clusters = cp.call("GET", "/api/v1/clusters", token)
    assert status == 200 and [c["name"] for c in clusters] == ["hpc"]
    # Only hashes are stored: neither token is in the database, which is root's alone.
    if "://" not in cp.db:
        assert stat.S_IMODE(Path(cp.db).stat().st_mode) == 0o600
        data = Path(cp.db).read_bytes()
        assert token.encode() not in data and added["token"].encode() not in data


def test_clusters_and_tokens_from_the_cli(controlplane: ControlPlane) -> None:
    cp = controlplane
    a = cp.json("clusters", "add", "a", "--kind", "slurm")
    b = cp.json("clusters", "add", "b", "--kind", "kubernetes")
    listed = cp.json("clusters", "list")
    assert [(c["name"], c["kind"]) for c in listed] == [("a", "slurm"), ("b", "kubernetes")]
    r = cp.cli("clusters", "add", "a", "--kind", "slurm")
    assert (r.returncode, r.stderr.strip()) == (
        2,
        "stasis: error: a cluster named 'a' " "exists already",
    )
    r = cp.cli("clusters", "add", "c", "--kind", "lsf")
    assert r.returncode == 2 and "invalid choice: 'lsf'" in r.stderr
    tokens = cp.json("tokens", "list")
    assert {t["kind"] for t in tokens} == {"admin", "cluster"}
    assert all("token" not in t and "sha256" not in t for t in tokens)

    rotated = cp.json("clusters", "rotate", a["cluster_id"])
    assert cp.call("POST", "/api/v1/nodes/register", rotated["token"], NODE)[0] == 200
    status, err = cp.call("POST", "/api/v1/nodes/register", a["token"], NODE)
    assert status == 401 and err["error"].startswith(f"token {a['token_id']} was revoked on ")
    done = cp.json("tokens", "revoke", b["token_id"])
    assert done == {"token_id": b["token_id"], "revoked": True}
    assert cp.call("GET", "/api/v1/nodes", b["token"])[0] == 401
    r = cp.cli("tokens", "revoke", "tok_nope")
    assert (r.returncode, r.stderr.strip()) == (2, "stasis: error: no live token tok_nope")


# SQLite only: roles and scopes are checked in Python.
@SQLITE_ONLY
def test_who_may_call_what(controlplane: ControlPlane) -> None:
    cp = controlplane
    a = cp.json("clusters", "add", "a", "--kind", "slurm")
    b = cp.json("clusters", "add", "b", "--kind", "slurm")
    for token, status in (
        (None, 401),
        ("", 401),
        ("stasis_wrong", 401),
        ("garbage", 401),
        (a["token"], 403),
    ):
        got, err = cp.call("GET", "/api/v1/clusters", token)
        assert got == status and err["error"], (token, got, err)
    assert cp.call("POST", "/api/v1/clusters", a["token"], {"name": "x", "kind": "slurm"})[0] == 403
    assert cp.call("POST", f"/api/v1/clusters/{b['cluster_id']}/rotate", a["token"])[0] == 403
    # A cluster's token sees its own nodes only, and joins them: each gets its own credential.
    status, n1 = cp.call("POST", "/api/v1/nodes/register", a["token"], NODE)
    assert status == 200 and n1["node_token"].startswith("stasis_node_"), n1
    status, m1 = cp.call("POST", "/api/v1/nodes/register", b["token"], {**NODE, "name": "m1"})
    assert status == 200
    assert [n["name"] for n in cp.call("GET", "/api/v1/nodes", a["token"])[1]] == ["n1"]
    assert [n["name"] for n in cp.call("GET", "/api/v1/nodes", cp.admin)[1]] == ["n1", "m1"]
    status, err = cp.call(
        "POST", "/api/v1/nodes/register", a["token"], {**NODE, "cluster_id": b["cluster_id"]}
    )
    assert status == 403 and f"belongs to cluster {a['cluster_id']}" in err["error"]
    status, err = cp.call("POST", "/api/v1/nodes/m1/heartbeat", a["token"], {"jobs": []})
    assert status == 403 and err["error"] == (
        "a heartbeat needs the node's own credential (it got one when it joined): a cluster "
        "token may not act as node m1"
    ), err
    status, err = cp.call("POST", "/api/v1/nodes/m1/heartbeat", n1["node_token"], {"jobs": []})
    assert status == 403 and err["error"] == (
        "this credential is node n1's: it may not act " "as node m1"
    ), err
    assert cp.call("POST", "/api/v1/nodes/n1/heartbeat", n1["node_token"], {"jobs": []})[0] == 200
    # Nor does a node credential do an admin's work.
    assert cp.call("GET", "/api/v1/clusters", n1["node_token"])[0] == 403
    r = cp.cli("nodes", token="stasis_wrong")
    assert (r.returncode, r.stderr.strip()) == (2, "stasis: error: unknown token")


def test_hostile_input_is_refused_in_one_line_and_changes_nothing(
    controlplane: ControlPlane,
) -> None:
    cp = controlplane
    a = cp.json("clusters", "add", "a", "--kind", "slurm")
    for name in (
        "x'; DROP TABLE clusters;--",
        "<script>alert(1)</script>",
        "../etc",
        "",
        "a" * 101,
        "n\x00ul",
    ):
        status, err = cp.call("POST", "/api/v1/clusters", cp.admin, {"name": name, "kind": "slurm"})
        assert status == 400 and "\n" not in err["error"], (name, err)
        status, err = cp.call("POST", "/api/v1/nodes/register", a["token"], {**NODE, "name": name})
        assert status == 400, (name, err)
    for raw in (b"{", b"[1, 2]", b'{"name": "x", "kind": "slurm", "extra": 1}'):
        status, err = cp.call("POST", "/api/v1/clusters", cp.admin, raw=raw)
        assert status == 400 and err["error"].startswith("bad request"), (raw, err)
    status, err = cp.call("POST", "/api/v1/clusters", cp.admin, raw=b"x" * (2 << 20))
    assert status == 413, err
    assert [c["name"] for c in cp.call("GET", "/api/v1/clusters", cp.admin)[1]] == ["a"]
    status, err = cp.call("POST", "/api/v1/tokens/'%20OR%201=1--/revoke", cp.admin)
    assert status == 404
    assert len(cp.call("GET", "/api/v1/tokens", cp.admin)[1]) == 2


def test_an_unreachable_database_and_a_public_plain_http_listen_fail_in_one_line() -> None:
    r = subprocess.run(
        [
            STASIS,
            "controlplane",
            "serve",
            "--db",
            "postgresql+psycopg://u:hunter2@127.0.0.1:1/x",
            "--listen",
            "127.0.0.1:8471",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert r.stderr.startswith(
        "stasis: error: cannot open the control plane's database "
        "postgresql+psycopg://u:***@127.0.0.1:1/x: OperationalError"
    )
    assert "hunter2" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(
        [STASIS, "controlplane", "serve", "--listen", "0.0.0.0:8470"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stderr.strip()) == (
        2,
        (
            "stasis: error: plain HTTP on 0.0.0.0 would send tokens in the clear: give --cert and "
            "--key, listen on 127.0.0.1, or --allow-plain-http"
        ),
    )
    r = subprocess.run(
        [STASIS, "controlplane", "nodes"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": "/usr/bin:/bin",
            "STASIS_CONFIG": "",
            "STASIS_CONTROLPLANE_URL": "http://127.0.0.1:1",
        },
    )
    assert r.returncode == 1 and r.stderr.startswith(
        "stasis: error: cannot reach the control plane at http://127.0.0.1:1 ("
    )
    assert json.dumps(r.stderr)  # one line
    assert len(r.stderr.strip().splitlines()) == 1


def test_https_with_a_certificate(world_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="cp-tls-", dir=world_tmp))
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
    cp = ControlPlane(root, str(root / "cp.db"))
    cp.url = cp.url.replace("http://", "https://")
    # The CLI trusts the certificate as a user's would (SSL_CERT_FILE); this process's calls
    # are given it (ControlPlane.cafile).
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    cp.cafile = cert
    try:
        cp.start("--cert", str(cert), "--key", str(key))
        added = cp.json("clusters", "add", "tls", "--kind", "kubernetes")
        assert added["token"].startswith("stasis_")
        r = cp.cli("clusters", "list")
        assert r.returncode == 0 and "tls" in r.stdout
        plain = subprocess.run(
            [STASIS, "controlplane", "nodes"],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **os.environ,
                "STASIS_CONFIG": "",
                "STASIS_CONTROLPLANE_URL": cp.url.replace("https", "http"),
                "STASIS_AUTH_TOKEN": cp.admin,
            },
        )
        assert plain.returncode != 0
    finally:
        cp.stop()


# SQLite only: the installer's text is made in Python.
@SQLITE_ONLY
def test_the_kubernetes_installer_is_the_helm_command_with_the_cluster_s_values(
    controlplane: ControlPlane,
) -> None:
    import urllib.error
    import urllib.request

    cp = controlplane
    k8s = cp.json("clusters", "add", "gpus", "--kind", "kubernetes")
    slurm = cp.json("clusters", "add", "hpc", "--kind", "slurm")

    def installer(token: str) -> str:
        req = urllib.request.Request(
            cp.url + "/install/kubernetes", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(req, timeout=20) as r:
            return str(r.read().decode())

    # The command as the admin pastes it (into a shell: bash's stdin), with a helm that records what it was given; every
    # exec traced: the token reaches helm on its stdin, on no command line.
    bin_dir = cp.root / "bin"
    bin_dir.mkdir()
    (bin_dir / "helm").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > {cp.root}/helm.args\n' f"cat > {cp.root}/helm.stdin\n"
    )
    (bin_dir / "helm").chmod(0o755)
    trace = cp.root / "execs.trace"
    r = subprocess.run(
        [
            "strace",
            "-f",
            "-qq",
            "-e",
            "trace=execve",
            "-s",
            "65536",
            "-o",
            str(trace),
            "bash",
            "-s",
        ],
        input=installer(k8s["token"]),
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    assert k8s["token"] not in trace.read_text() and "/helm" in trace.read_text()
    args = (cp.root / "helm.args").read_text().splitlines()
    assert args[:3] == ["upgrade", "-i", "stasis"]
    sets = dict(a.split("=", 1) for a, flag in zip(args[1:], args) if flag.startswith("--set"))
    assert sets == {
        "config.url": cp.url,
        "config.clusterId": k8s["cluster_id"],
        "config.authToken": "/dev/stdin",
    }
    assert (cp.root / "helm.stdin").read_text() == k8s["token"]
    for token in (slurm["token"], cp.admin):
        try:
            installer(token)
            raise AssertionError("an installer for the wrong token")
        except urllib.error.HTTPError as e:
            assert e.code == 400


def test_cluster_tokens_can_expire(controlplane: ControlPlane) -> None:
    cp = controlplane
    hpc = cp.json("clusters", "add", "short", "--kind", "slurm", "--expires-in", "2s")
    assert hpc["expires"] is not None
    report = {"name": "n1", "host": "n1", "stasis_version": "x", "check_ok": True}
    assert cp.call("POST", "/api/v1/nodes/register", hpc["token"], report)[0] == 200
    time.sleep(2.5)
    status, body = cp.call("POST", "/api/v1/nodes/register", hpc["token"], report)
    assert status == 401 and f"token {hpc['token_id']} expired on" in body["error"], body
    (listed,) = [t for t in cp.json("tokens", "list") if t["id"] == hpc["token_id"]]
    assert listed["expires"] == hpc["expires"]
    fresh = cp.json("clusters", "rotate", hpc["cluster_id"])  # no expiry
    assert fresh["expires"] is None
    assert (
        cp.call("POST", "/api/v1/nodes/register", fresh["token"], {**report, "name": "n2"})[0]
        == 200
    )
    r = cp.cli("clusters", "add", "bad", "--kind", "slurm", "--expires-in", "soon")
    assert r.returncode == 2
