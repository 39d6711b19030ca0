"""stasis.client against a real daemon: every method answers what stasis/wire.py says (its keys,
the JSON type of every value, and meaning), and the daemon's refusals come back as the right
StasisError subclass."""

from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis import wire
from stasis.client import Client
from stasis.engine import proctree
from stasis.errors import NotFoundError, PermissionDeniedError, StasisError, UsageError
from tests.conftest import ROOT, TEST_USER, Daemon, wait_for, workload
from tests.test_wire import conforms

UNKNOWN_JOB = "000000000000"
UNKNOWN_SLURM_JOB = "987654321"


def keys(td: type) -> set[str]:
    return set(typing.get_type_hints(td))


def is_wire(value: object, td: type) -> bool:
    """The answer has the wire's keys, each value of the wire's JSON type."""
    assert isinstance(value, dict) and set(value) == keys(td), (value, keys(td))
    return conforms(value, td)


def numbers(path: str) -> list[int]:
    return [int(m) for m in re.findall(r"^(\d+)$", Path(path).read_text(), re.M)]


def last_number(path: str) -> int:
    found = numbers(path)
    return found[-1] if found else -1


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.socket, timeout_s=120) as c:
        yield c


def test_job_lifecycle_through_the_client(client: Client) -> None:
    ran = client.run(
        command=workload("counter.py"), cwd="/", label="client-counter", env={"COUNTER_NOTE": "x"}
    )
    assert is_wire(ran, wire.RunAnswer)
    assert ran["label"] == "client-counter" and re.fullmatch(r"[0-9a-f]{12}", ran["job"])
    assert proctree.alive(ran["pid"], None)
    job_id = ran["job"]

    job = client.job(job_id)
    assert is_wire(job, wire.Job)
    assert job["job"] == job_id and job["pid"] == ran["pid"] and job["state"] == "running"
    assert job["command"] == workload("counter.py") and job["cwd"] == "/"
    assert job["uid"] == 0 and job["user"] == "root" and job["checkpoint"] is None
    assert job["exit_code"] is None
    listed = client.jobs()
    assert all(is_wire(j, wire.Job) for j in listed)
    assert [j for j in listed if j["job"] == job_id] == [job]

    checked = client.dump_check(job_id)
    assert is_wire(checked, wire.DumpCheckAnswer)
    assert checked["job"] == job_id and checked["obstacles"] == []

    log = job["log"]
    wait_for(lambda: last_number(log) >= 3, what="counting")
    seen: list[tuple[int, int]] = []
    dumped = client.dump(
        job_id, progress=lambda done, total: seen.append((done, total)), leave_running=True
    )
    mark = last_number(log)
    assert is_wire(dumped, wire.DumpAnswer)
    assert dumped["job"] == job_id and dumped["label"] == "client-counter"
    assert dumped["size_bytes"] > 0
    assert isinstance(dumped["notes"], list) and all(isinstance(n, str) for n in dumped["notes"])
    assert 0 < dumped["duration_s"] <= dumped["elapsed_s"]
    cp_id = dumped["checkpoint"]
    wait_for(lambda: last_number(log) >= mark + 3, what="the original still counting")
    assert client.job(job_id)["state"] == "running"

    listed_cps = client.checkpoints(label="client-counter")
    assert [c["id"] for c in listed_cps] == [cp_id]
    cp = listed_cps[0]
    manifest: dict[str, object] = dict(cp)  # the manifest: more than the wire reads
    assert keys(wire.Checkpoint) <= set(manifest)
    assert is_wire({k: manifest[k] for k in keys(wire.Checkpoint)}, wire.Checkpoint)
    assert cp["job"] == job_id and cp["label"] == "client-counter" and cp["uid"] == 0
    assert cp["command"] == workload("counter.py") and cp["log_path"] == log
    assert cp["size_bytes"] == dumped["size_bytes"] and cp["compression"] == "none"
    assert [c["id"] for c in client.checkpoints()].count(cp_id) == 1
    assert client.checkpoints(label="client-nothing-here") == []

    killed = client.kill(job_id, signal="TERM", timeout_s=5)
    assert is_wire(killed, wire.KillAnswer)
    assert killed["job"] == job_id and killed["state"] == "exited"
    assert killed["signal"] == "SIGTERM" and killed["ended_by"] == "SIGTERM"
    assert killed["timeout_s"] == 5
    assert client.job(job_id)["state"] == "exited" and not proctree.alive(ran["pid"], None)
    before = numbers(log)

    restored = client.restore(checkpoint=cp_id)
    assert is_wire(restored, wire.RestoreAnswer)
    assert restored["checkpoint"] == cp_id and restored["job"] != job_id
    assert restored["skipped"] == [] and restored["lazy"] is False
    new = client.job(restored["job"])
    assert new["state"] == "restored" and new["checkpoint"] == cp_id
    assert new["pid"] == restored["pid"] and new["log"] == log
    wait_for(lambda: len(numbers(log)) > len(before) + 3, what="the restored job counting")
    after = numbers(log)[len(before) :]
    # It goes on from the checkpoint (at most `mark`), behind where the original got, not at 0.
    assert 1 <= after[0] <= mark + 1 < before[-1]
    assert after[:4] == list(range(after[0], after[0] + 4))

    again = client.kill(restored["job"], timeout_s=0)
    assert again["state"] == "exited" and again["ended_by"] == "SIGKILL"
    deleted = client.delete_checkpoint(cp_id)
    assert deleted == {"deleted": cp_id} and is_wire(deleted, wire.Deleted)
    assert client.checkpoints(label="client-counter") == []
    with pytest.raises(NotFoundError):
        client.restore(checkpoint=cp_id)


def test_check_and_network_locks(client: Client) -> None:
    report = client.check()
    assert is_wire(report, wire.CheckReport)
    assert report["kernel"] == os.uname().release
    assert report["ok"] is (report["problems"] == [])
    assert report["criu_path"] and report["criu_version"]
    assert set(report["features"]) == {"mem_track", "lazy_pages"}
    assert all(is_wire(p, wire.Problem) for p in report["problems"])
    assert all(is_wire(n, wire.NetworkLock) for n in report["network_locks"])
    locks = client.network_locks()
    assert isinstance(locks, list)
    assert all(is_wire(n, wire.NetworkLock) for n in locks)


def test_errors_come_back_as_their_classes(client: Client) -> None:
    def error_of(call: typing.Callable[[], object]) -> StasisError:
        with pytest.raises(StasisError) as caught:
            call()
        return caught.value

    for call in (
        lambda: client.job(UNKNOWN_JOB),
        lambda: client.kill(UNKNOWN_JOB),
        lambda: client.dump_check(UNKNOWN_JOB),
        lambda: client.dump(UNKNOWN_JOB),  # the NDJSON stream's error line
        lambda: client.restore(label="client-no-such-label"),
        lambda: client.delete_checkpoint("20000101T000000Z-000000"),
    ):
        e = error_of(call)
        assert type(e) is NotFoundError, (type(e), e)
    bad = error_of(lambda: client.job("not-a-job"))
    assert type(bad) is UsageError and "not a job id" in str(bad)
    assert type(error_of(lambda: client.run(command=[], cwd="/"))) is UsageError
    assert type(error_of(lambda: client.run(command=["true"], cwd="relative"))) is UsageError
    assert type(error_of(lambda: client.restore())) is UsageError
    # An id with a slash stays one path segment: the daemon sees no other route.
    assert type(error_of(lambda: client.job("../check"))) is UsageError


def test_network_locks_are_roots(daemon: Daemon, test_user: pwd.struct_passwd) -> None:
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from stasis.client import Client\n"
        "c = Client(Path(sys.argv[1]), timeout_s=60)\n"
        "out = {'jobs': len(c.jobs())}\n"
        "try:\n"
        "    c.network_locks()\n"
        "    out['error'] = None\n"
        "except Exception as e:\n"
        "    out['error'] = [type(e).__module__, type(e).__name__, str(e)]\n"
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
            f"STASIS_SOCKET={daemon.socket}",
            sys.executable,
            "-c",
            code,
            str(daemon.socket),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=True,
    )
    out = json.loads(result.stdout)
    # It reached the daemon (its own jobs: none of root's), and was refused the locks.
    assert out["jobs"] == 0
    assert out["error"][:2] == ["stasis.errors", PermissionDeniedError.__name__]
    assert "only root" in out["error"][2]


def test_slurm_routes_refuse(client: Client) -> None:
    health = client.slurm_health()
    assert health == {"ok": True} and is_wire(health, wire.Health)

    with pytest.raises(NotFoundError) as e:
        client.slurm_job(UNKNOWN_SLURM_JOB)
    assert "not under stasis" in str(e.value)
    with pytest.raises(UsageError) as bad:
        client.slurm_job("abc")
    assert type(bad.value) is UsageError
    with pytest.raises(NotFoundError):
        client.slurm_checkpoint(UNKNOWN_SLURM_JOB, leave_running=True)
    with pytest.raises(NotFoundError):
        client.slurm_finish(UNKNOWN_SLURM_JOB, 0)

    # Our own pid is not our child: refused before Slurm is ever asked.
    with pytest.raises(PermissionDeniedError) as denied:
        client.slurm_register(slurm_job=UNKNOWN_SLURM_JOB, pid=os.getpid(), label=UNKNOWN_SLURM_JOB)
    assert "not a child of the caller" in str(denied.value)
    # A child of ours passes that check and is refused for the next one (no PID namespace).
    child = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(UsageError) as not_init:
            client.slurm_register(
                slurm_job=UNKNOWN_SLURM_JOB, pid=child.pid, label=UNKNOWN_SLURM_JOB
            )
        assert "not the init of a PID namespace" in str(not_init.value)
    finally:
        child.kill()
        child.wait()
    with pytest.raises(UsageError):
        client.slurm_register(slurm_job=UNKNOWN_SLURM_JOB, pid=1, label=UNKNOWN_SLURM_JOB)
    # Nothing was registered on the way.
    with pytest.raises(NotFoundError):
        client.slurm_job(UNKNOWN_SLURM_JOB)
