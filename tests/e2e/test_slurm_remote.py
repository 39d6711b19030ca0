"""Slurm commands from another node, on a real cluster: `stasis dump --slurm-job` and
`stasis slurm drain` run as on a login node (no stasis daemon there, another node name), so
they reach the job's node daemon over its remote listener (slurm_remote_port on loopback),
munge saying who asks. A user checkpoints their own job, which resumes from it (its counter
goes on); another user is refused; each error is one line; the admin drains the node: its
protected job is checkpointed and requeued, an unprotected one runs to its end, the node ends
DRAIN and empty, and the job goes on from its checkpoint once the node is back."""

from __future__ import annotations

import json
import re
import socket
import subprocess
from collections.abc import Callable

import pytest

from tests.conftest import STASIS, TEST_USER
from tests.e2e.conftest import Cluster, close_cluster, early_checks, new_cluster, until, wait_gone

ENABLE = "--export=STASIS_ENABLE=1"
RESTORED = "stasis: restored checkpoint"
# The first test waits for every check (each of the others has its outcome at once).
pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


class Remote:
    """The cluster, its node daemon listening on `port`, and a CLI as on a login node."""

    def __init__(self, cluster: Cluster, port: int) -> None:
        self.cluster = cluster
        self.port = port

    def login(
        self, *args: str, user: str | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`stasis ARGS` where no daemon runs and the node is not n1."""
        values = {
            "STASIS_SOCKET": str(self.cluster.root / "no-daemon-here.sock"),
            "STASIS_SLURM_NODE_NAME": "login",
            **(env or {}),
        }
        return self.cluster.run(
            "env", *(f"{k}={v}" for k, v in values.items()), STASIS, *args, user=user, check=False
        )

    def daemon_log(self) -> str:
        return (self.cluster.lay.stasis / "daemon.log").read_text()


def _remote(c: Cluster) -> Remote:
    # The local cluster gives every node's daemon one remote port (its config.toml says which).
    found = re.search(r"^slurm_remote_port = (\d+)$", c.lay.stasis_config.read_text(), re.M)
    assert found, c.lay.stasis_config.read_text()
    port = int(found.group(1))
    until(lambda: _connects(port), 30, "the remote listener")
    return Remote(c, port)


def _setup(environ: dict[str, str]) -> Remote:
    c = new_cluster("remote", environ=environ)
    try:
        return _remote(c)
    except BaseException:
        close_cluster(c)
        raise


def _one_line(result: subprocess.CompletedProcess[str], code: int, text: str) -> str:
    assert result.returncode == code, (result.returncode, result.stderr, result.stdout)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], result.stderr
    return lines[0]


def _a_user_checkpoints_their_job_from_another_node_and_it_resumes(remote: Remote) -> None:
    c = remote.cluster
    job = c.sbatch(c.counter_script("mine", ENABLE, stop=30, interval=0.5), user=TEST_USER)
    c.wait_number(job, 4)
    pids = c.pids(job)
    answer = remote.login("dump", "--slurm-job", job, "--json", user=TEST_USER)
    assert answer.returncode == 0, answer.stderr
    done = json.loads(answer.stdout)
    assert done["slurm_job"] == job and done["requeued"] is True, done
    uid = int(subprocess.run(["id", "-u", TEST_USER], capture_output=True, text=True).stdout)
    assert re.search(
        rf"remote Slurm checkpoint job={job} .* asked by uid {uid} from " r"127\.0\.0\.1",
        remote.daemon_log(),
    ), remote.daemon_log()
    wait_gone(pids)
    until(lambda: RESTORED in c.output(job), 90, "the restore")
    c.wait_state(job, ("COMPLETED",), 120)
    out = c.output(job)
    at_dump = [int(n) for n in re.findall(r"^(\d+)$", out[: out.index(RESTORED)], re.M)]
    went_on = [int(n) for n in re.findall(r"^(\d+)$", out[out.index(RESTORED) :], re.M)]
    assert went_on[0] == at_dump[-1] + 1, out  # from the checkpoint, not from 0
    assert re.findall(r"^(\d+)$", out, re.M) == [str(i) for i in range(30)], out
    assert f"{RESTORED} {done['checkpoint']}" in out
    assert c.job(job)["Restarts"] == "1"


def _another_user_is_refused_and_errors_are_one_line(remote: Remote) -> None:
    c = remote.cluster
    job = c.sbatch(c.counter_script("roots", ENABLE, stop=400, interval=0.5))
    c.wait_number(job, 2)
    refused = remote.login("dump", "--slurm-job", job, user=TEST_USER)
    line = _one_line(refused, 2, "permission denied")
    assert f"node n1 at 127.0.0.1:{remote.port}" in line, line
    assert c.state(job) == "RUNNING"
    # Root, from the login node: any job; leave-running keeps it going.
    kept = remote.login("dump", "--slurm-job", job, "--leave-running", "--json")
    assert kept.returncode == 0 and json.loads(kept.stdout)["requeued"] is False, kept.stderr
    assert c.state(job) == "RUNNING"

    _one_line(remote.login("dump", "--slurm-job", "99999"), 2, "no Slurm job 99999")
    _one_line(remote.login("dump", "--slurm-job", "../1"), 2, "not a Slurm job id")
    held = c.sbatch(c.counter_script("held", ENABLE, stop=3), "--hold")
    _one_line(
        remote.login("dump", "--slurm-job", held), 2, f"Slurm job {held} is not running (PENDING)"
    )
    c.run("scancel", held)
    nowhere = _free_port()
    _one_line(
        remote.login("dump", "--slurm-job", job, env={"STASIS_SLURM_REMOTE_PORT": str(nowhere)}),
        1,
        f"cannot reach the stasis daemon of node n1 at 127.0.0.1:{nowhere} (connection " "refused)",
    )
    _one_line(
        remote.login("dump", "--slurm-job", job, env={"STASIS_SLURM_REMOTE_PORT": "0"}),
        2,
        "remote Slurm commands are off here",
    )
    _one_line(remote.login("slurm", "drain", "n9"), 2, "no Slurm node n9")
    # On the job's own node, a job not under stasis: said so, nothing sent anywhere.
    plain = c.sbatch(c.counter_script("plain", stop=400, interval=0.5))
    c.wait_number(plain, 1)
    _one_line(
        c.stasis("dump", "--slurm-job", plain, check=False),
        2,
        f"Slurm job {plain} runs on this node (n1) but not under its stasis daemon",
    )
    # On the job's node with no daemon answering: that is the error, not a remote call.
    gone = c.run(
        "env", f"STASIS_SOCKET={c.root}/gone.sock", STASIS, "dump", "--slurm-job", job, check=False
    )
    _one_line(gone, 1, f"cannot reach the stasis daemon at {c.root}/gone.sock")
    c.run("scancel", job, plain)
    c.wait_state(job, ("CANCELLED",))


def _drain_requeues_protected_jobs_and_waits_for_the_node_to_be_empty(remote: Remote) -> None:
    c = remote.cluster
    job = c.sbatch(c.counter_script("drained", ENABLE, stop=40, interval=0.5))
    plain = c.sbatch(c.script("unprotected", "sleep 8"))
    c.wait_number(job, 3)
    c.wait_state(plain, ("RUNNING",))
    # Only root drains; the node says so (munge's uid), and nothing changed.
    _one_line(
        remote.login("slurm", "drain", "n1", user=TEST_USER),
        2,
        "permission denied: only root drains a node",
    )
    assert "DRAIN" not in c.run("scontrol", "show", "node", "n1").stdout

    result = remote.login(
        "slurm", "drain", "n1", "--reason", "kernel update", "--json", "--timeout", "60"
    )
    assert result.returncode == 0, result.stderr + result.stdout
    report = json.loads(result.stdout)
    assert [r["job"] for r in report["requeued"]] == [job], report
    assert report["unprotected"] == [plain] and report["failed"] == [], report
    assert report["empty"] is True and report["running"] == [], report
    assert report["empty_after_s"] >= 0
    node = c.run("scontrol", "show", "node", "n1").stdout
    assert "DRAIN" in node and "kernel update" in node, node
    assert c.run("squeue", "-h", "-w", "n1").stdout.strip() == ""
    assert c.state(plain) == "COMPLETED"  # ran to its end, untouched
    c.wait_state(job, ("PENDING",), 60)  # requeued; the only node takes no job
    at_dump = c.numbers(job)[-1]

    c.run("scontrol", "update", "NodeName=n1", "State=RESUME")
    c.wait_state(job, ("COMPLETED",), 120)
    out = c.output(job)
    assert f"{RESTORED} {report['requeued'][0]['checkpoint']}" in out, out
    assert re.findall(r"^(\d+)$", out, re.M) == [str(i) for i in range(40)], out
    assert c.numbers(job)[-1] > at_dump


def _drain_gives_up_waiting_after_its_timeout(remote: Remote) -> None:
    c = remote.cluster
    plain = c.sbatch(c.script("long", "sleep 300"))
    c.wait_state(plain, ("RUNNING",))
    try:
        result = remote.login("slurm", "drain", "n1", "--timeout", "1")
        assert result.returncode == 1, result.stderr + result.stdout
        assert (
            f"not under stasis, running until they end: Slurm job(s) {plain}" in result.stdout
        ), result.stdout
        assert (
            f"node n1 is not empty after 1 s: Slurm job(s) {plain} still run there" in result.stderr
        ), result.stderr
        assert c.state(plain) == "RUNNING"
    finally:
        c.run("scancel", plain)
        c.run("scontrol", "update", "NodeName=n1", "State=RESUME")


CHECKS: list[Callable[[Remote], None]] = [
    _a_user_checkpoints_their_job_from_another_node_and_it_resumes,
    _another_user_is_refused_and_errors_are_one_line,
    _drain_requeues_protected_jobs_and_waits_for_the_node_to_be_empty,
    _drain_gives_up_waiting_after_its_timeout,
]
# Minutes of waiting on Slurm (requeues, a drain): the checks run early, on a cluster of their
# own (conftest.early_checks); each test raises its check's own error, if any.
_outcome = early_checks("test_slurm_remote.py", _setup, lambda r: close_cluster(r.cluster), CHECKS)


def test_a_user_checkpoints_their_job_from_another_node_and_it_resumes() -> None:
    _outcome(_a_user_checkpoints_their_job_from_another_node_and_it_resumes)


def test_another_user_is_refused_and_errors_are_one_line() -> None:
    _outcome(_another_user_is_refused_and_errors_are_one_line)


def test_drain_requeues_protected_jobs_and_waits_for_the_node_to_be_empty() -> None:
    _outcome(_drain_requeues_protected_jobs_and_waits_for_the_node_to_be_empty)


def test_drain_gives_up_waiting_after_its_timeout() -> None:
    _outcome(_drain_gives_up_waiting_after_its_timeout)
