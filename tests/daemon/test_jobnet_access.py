"""A local user against the routes of a job that spans nodes, through the daemon's real socket:
a part runs in a job's network only when root asks (a part reaches the job's other parts, on
other nodes), and nobody freezes or thaws a job that is not theirs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import Daemon, wait_for, workload
from tests.daemon.test_restore_state import last_number

ROOT = Path(__file__).resolve().parents[2]

# Run as the test user: each call through the typed client, its refusal printed as JSON.
ATTEMPT = """
import json, sys
from pathlib import Path
from stasis.client import Client
from stasis.errors import StasisError
client = Client(Path(sys.argv[1]), timeout_s=30)
kind, job = sys.argv[2], sys.argv[3]
try:
    if kind == "run":
        client.run(command=["true"], cwd="/", job_net=4242)
    elif kind == "freeze":
        client.freeze(job, timeout_s=30)
    else:
        client.thaw(job, stop=True)
    print(json.dumps({"ok": True}))
except StasisError as e:
    print(json.dumps({"refused": type(e).__name__, "message": str(e)}))
"""


def _as_user(daemon: Daemon, kind: str, job: str = "-") -> dict[str, str]:
    r = subprocess.run(
        [
            "runuser",
            "-u",
            "stasis-test",
            "--",
            "env",
            f"PYTHONPATH={ROOT}",
            sys.executable,
            "-c",
            ATTEMPT,
            str(daemon.socket),
            kind,
            job,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    answer: dict[str, str] = json.loads(r.stdout)
    return answer


def test_a_user_cannot_run_a_part_in_a_job_network(daemon: Daemon) -> None:
    answer = _as_user(daemon, "run")
    assert answer["refused"] == "PermissionDeniedError", answer
    assert "only root may run a job in a job network" in answer["message"], answer
    assert all(j["state"] not in ("running", "restored") for j in daemon.json("ps"))


def test_a_user_cannot_freeze_or_stop_another_users_job(daemon: Daemon) -> None:
    job = daemon.run(*workload("counter.py"))
    try:
        wait_for(lambda: last_number(daemon, job["job"]) >= 1, 20, "the counter")
        for kind in ("freeze", "thaw"):
            answer = _as_user(daemon, kind, job["job"])
            assert answer.get("refused") == "PermissionDeniedError", (kind, answer)
        # Not frozen, not stopped: the counter goes on.
        seen = last_number(daemon, job["job"])
        wait_for(lambda: last_number(daemon, job["job"]) > seen, 20, "the counter to go on")
        assert daemon.job(job["job"])["state"] == "running"
    finally:
        daemon.cli("kill", job["job"])
