"""A job holding what no checkpoint can carry is refused at its first dump, before CRIU freezes
it (issue 31): one line naming the process, what it holds and why, what to do instead; the job
goes on running and no checkpoint is listed. Real `stasis run` + `stasis dump` through the real
daemon; the program is tests/workloads/holdfd.c. The io_uring is real; the RDMA device is a
stand-in (no adapter here: a file at /dev/infiniband/uverbs0 in the job's own mount namespace,
tests/engine/test_obstacles.py says more)."""

from __future__ import annotations

import json
import pwd
import re
from pathlib import Path

from tests.conftest import Daemon, wait_for


def _ticks(d: Daemon, job: str) -> int:
    return len(re.findall(r"^tick \d+$", d.log_of(job), re.M))


def _refused(d: Daemon, job: str, user: str | None) -> str:
    """`stasis dump JOB`'s one-line refusal, after which the job still runs, listed nowhere."""
    wait_for(lambda: _ticks(d, job) >= 2, what="the job's ticks")
    result = d.cli("dump", job, user=user, check=False)
    assert result.returncode == 1, result.stdout
    error = result.stderr.strip()
    assert "\n" not in error
    assert error.startswith(f"stasis: error: checkpoint of job {job} refused, job still running: ")
    # Going on: more ticks, still running, and nothing in the store.
    seen = _ticks(d, job)
    wait_for(lambda: _ticks(d, job) > seen + 2, what="ticks after the refusal")
    assert d.job(job)["state"] == "running"
    assert d.json("checkpoints") == []  # this module's daemon never took one
    # `dump --check` says the same before trying.
    check = json.loads(d.cli("dump", "--check", "--json", job, user=user, check=False).stdout)
    assert len(check["obstacles"]) == 1 and check["obstacles"][0] in error
    return error


def test_io_uring_refused(daemon: Daemon, holdfd: Path, test_user: pwd.struct_passwd) -> None:
    user = test_user.pw_name
    job = daemon.run(str(holdfd), "io_uring", user=user)["job"]
    error = _refused(daemon, job, user)
    assert re.search(r"pid \d+ \(holdfd io_uring\) holds an io_uring \(fd 3\)", error), error
    assert "which CRIU cannot checkpoint" in error and "run it without io_uring" in error
    daemon.cli("kill", job, user=user)


def test_rdma_device_refused(daemon: Daemon, holdfd: Path) -> None:
    job = daemon.run(
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        "mount -t tmpfs stand-in /dev && mkdir /dev/infiniband && : >/dev/infiniband/uverbs0 "
        f"&& exec {holdfd} /dev/infiniband/uverbs0",
    )["job"]
    error = _refused(daemon, job, None)
    assert re.search(
        r"pid \d+ \(holdfd /dev/infiniband/uverbs0\) holds the RDMA device "
        r"/dev/infiniband/uverbs0 \(fd 3\), which CRIU cannot checkpoint",
        error,
    ), error
    assert "run it over TCP" in error
    daemon.cli("kill", job)
