"""`stasis-dev local-cluster up` that does not come up leaves nothing running: ended half way
(SIGTERM, as a harness's timeout or a closed terminal ends it) after it started munged, MariaDB
and slurmdbd, every daemon of the cluster is stopped again, seen by what runs on the machine
(every process naming the cluster's directory), not by the command's exit status."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from stasis.dev.commands import SESSION_MARK
from tests.conftest import STASIS_DEV, TEST_USER, ensure_test_user, wait_for

pytestmark = pytest.mark.timeout(300)


def naming(root: Path) -> list[str]:
    """Every process whose command line or environment names a file under `root` (munged
    --socket=, mariadbd --datadir=, slurmdbd's SLURM_CONF, slurmctld -f, the stasis daemons'
    STASIS_CONFIG), as "pid argv"."""
    mark = f"{root}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if mark in argv or mark in env:
            words = argv.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name} {words}")
    return found


def pids_recorded(root: Path) -> dict[str, int]:
    try:
        pids: dict[str, int] = json.loads((root / "cluster.json").read_text())["pids"]
    except (OSError, ValueError, KeyError):
        return {}
    return pids


def test_up_ended_half_way_stops_what_it_started() -> None:
    ensure_test_user()
    root = Path(tempfile.mkdtemp(prefix="stasis-e2e-halfway-"))
    os.chmod(root, 0o755)
    up = subprocess.Popen(
        [
            STASIS_DEV,
            "local-cluster",
            "up",
            "--dir",
            str(root),
            "--json",
            "--socket-group",
            TEST_USER,
            "--accounting",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "STASIS_CONFIG": ""},
    )
    try:
        # Half way: munged, MariaDB and slurmdbd run, slurmctld not yet.
        wait_for(
            lambda: "slurmdbd" in pids_recorded(root) or up.poll() is not None,
            120,
            "up to start slurmdbd",
        )
        assert up.poll() is None, up.communicate()
        started = pids_recorded(root)
        assert {"munged", "mariadb", "slurmdbd"} <= set(started), started
        assert naming(root), "nothing of the cluster seen running"
        # The daemons carry this session's mark (tests/leftovers.py finds one left running,
        # whatever process it became).
        mark = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode()
        for name in ("mariadb", "slurmdbd"):
            environ = Path(f"/proc/{started[name]}/environ").read_bytes().split(b"\0")
            assert mark in environ, name
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=120)
        assert up.returncode != 0, err
        left = naming(root)
        assert left == [], left
        assert not (root / "cluster.json").exists()  # `down` ran: nothing is recorded as up
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        subprocess.run(
            [STASIS_DEV, "local-cluster", "down", "--dir", str(root)],
            capture_output=True,
            timeout=120,
        )
        shutil.rmtree(root, ignore_errors=True)
