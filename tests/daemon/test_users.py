"""Jobs of an ordinary user: checkpointed and restored by the root daemon, still unprivileged."""

from __future__ import annotations

import pwd
from pathlib import Path

from stasis.engine import proctree
from tests.conftest import Daemon, wait_for, workload
from tests.daemon.test_restore_state import last_number, numbers


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_user_job_round_trip(daemon: Daemon, test_user: pwd.struct_passwd) -> None:
    # Asked for by the user themselves: no --user needed, the socket says who they are.
    job = daemon.json("run", "--", *workload("counter.py"), user=test_user.pw_name)
    wait_for(lambda: last_number(daemon, job["job"]) >= 5, what="counting")
    for pid in proctree.tree(job["pid"]):
        assert _status(pid)["Uid"].split()[0] == str(test_user.pw_uid)
    cp = daemon.json("dump", job["job"], user=test_user.pw_name)
    at_dump = last_number(daemon, job["job"])
    restored = daemon.json("restore", cp["checkpoint"], user=test_user.pw_name)
    wait_for(lambda: last_number(daemon, restored["job"]) >= at_dump + 5, what="counting on")
    values = numbers(daemon.log_of(restored["job"]))
    assert values == list(range(len(values)))
    for pid in proctree.tree(restored["pid"]):
        status = _status(pid)
        assert status["Uid"].split() == [str(test_user.pw_uid)] * 4
        assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    daemon.cli("kill", restored["job"], user=test_user.pw_name)


def test_root_runs_a_job_as_a_user(daemon: Daemon, test_user: pwd.struct_passwd) -> None:
    job = daemon.run(*workload("counter.py"), user=test_user.pw_name)
    wait_for(lambda: last_number(daemon, job["job"]) >= 3, what="counting")
    assert _status(job["pid"])["Uid"].split()[0] == str(test_user.pw_uid)
    # The user sees and may checkpoint it: it is theirs.
    assert job["job"] in [j["job"] for j in daemon.json("ps", user=test_user.pw_name)]
    cp = daemon.json("dump", job["job"], "--leave-running", user=test_user.pw_name)
    mine = daemon.json("checkpoints", user=test_user.pw_name)
    assert cp["checkpoint"] in [c["id"] for c in mine]
    daemon.cli("kill", job["job"])
