"""`stasis controlplane serve` takes its options from the one Settings object (file and
STASIS_CONTROLPLANE_* environment), a flag given overriding its setting."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from stasis.controlplane import routes
from tests.conftest import STASIS, wait_for
from tests.controlplane.conftest import said
from tests.s3server import free_ports


def _call(url: str, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode() if body is not None else None,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, said(json.loads(e.read()))


def _healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> bool:
    assert proc.poll() is None, log.read_text()
    try:
        return bool(_call(url, "GET", routes.HEALTH.path, "")[1] == {"ok": True})
    except OSError:
        return False


def test_serve_reads_its_settings_and_a_flag_wins(world_tmp: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="cp-settings-", dir=world_tmp))
    env_port, flag_port = free_ports(2)
    config = root / "stasis.toml"
    # From the file: the floor of policies' periods; from the environment: the rest.
    config.write_text("controlplane_min_interval_s = 120\n")
    env = {
        **os.environ,
        "STASIS_CONFIG": str(config),
        "STASIS_STATE_DIR": str(root),
        "STASIS_CONTROLPLANE_DB": str(root / "from-env.db"),
        "STASIS_CONTROLPLANE_LISTEN": f"127.0.0.1:{env_port}",
        "STASIS_CONTROLPLANE_ADMIN_TOKEN_FILE": str(root / "admin.token"),
    }
    for flags, port in (([], env_port), (["--listen", f"127.0.0.1:{flag_port}"], flag_port)):
        log = root / f"serve-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [STASIS, "controlplane", "serve", *flags], stdout=out, stderr=out, env=env
            )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: _healthy(url, proc, log), 30, f"the control plane on {port}")
            assert (root / "from-env.db").exists()
            admin = (root / "admin.token").read_text().strip()
            policy = {"name": "often", "every_s": 90, "action": "checkpoint"}
            status, answer = _call(url, "POST", routes.ADD_POLICY.path, admin, policy)
            assert status == 400 and "floor of 120 s" in answer["error"], answer
        finally:
            proc.terminate()
            proc.wait(timeout=20)
