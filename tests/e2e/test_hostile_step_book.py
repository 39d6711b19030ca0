"""A Slurm job that attacks the node daemon through its step book (issue 27, item 3).

The job of the unprivileged test user, opted in, plants in its own IPC namespace a one-page
SysV segment under the book's key whose header claims 256 KiB of records
(tests/workloads/hostile_book.py), then counts. The node daemon (root) reads every protected
job's book each second: it must refuse that one, keep serving (the same process), and the job
must stay protected: warned as Slurm warns at preemption, it is checkpointed, requeued and
resumes its count.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from stasis.daemon import detached
from stasis.engine import proctree
from stasis.slurm import mirrors
from tests.conftest import TEST_USER, WORKLOADS
from tests.e2e.conftest import Cluster, close_cluster, early_checks, new_cluster, until, wait_gone

MARKER = "stasis: restored checkpoint"
# The first test waits for every check (each of the others has its outcome at once).
pytestmark = pytest.mark.timeout(600)
REFUSED = (
    "its step book is refused: its header claims 262128 bytes of records, the segment " "holds "
)


# A cluster of its own, not the shared one: the daemon records thousands of steps of the
# flooding book in Slurm, work another module's tests should not wait behind.
def _setup(environ: dict[str, str]) -> Cluster:
    c = new_cluster("book", environ=environ)
    shutil.copy(WORKLOADS / "hostile_book.py", c.work / "hostile_book.py")
    return c


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^(\d+)$", text, re.M)]


def _a_one_page_book_claiming_256_KiB_leaves_the_daemon_serving_and_the_job_protected(
    cluster: Cluster,
) -> None:
    home = cluster.lay.config_of("n1").parent
    daemon_pid = detached.read_pid(home / "daemon.pid")
    assert daemon_pid is not None and detached.alive(daemon_pid)
    log = home / "daemon.log"

    def daemon_log() -> str:
        return log.read_text(errors="replace")

    script = cluster.script(
        "hostile",
        f"exec python3 -u {cluster.work}/hostile_book.py 0.5",
        "--export=ALL,STASIS_ENABLE=1",
        f"--output={cluster.work}/hostile-%j.out",
    )
    job = cluster.sbatch(script, user=TEST_USER)
    until(lambda: "planted " in cluster.output(job), 90, "the planted segment")
    cluster.wait_number(job, 4)
    # The daemon read the book (it polls every second), refused it, and is the same process.
    until(
        lambda: f"Slurm job {job}: {REFUSED}" in daemon_log(),
        30,
        f"the refusal in the daemon's log: {daemon_log()[-2000:]}",
    )
    assert detached.alive(daemon_pid), daemon_log()[-3000:]
    assert cluster.stasis("ps").returncode == 0
    assert detached.read_pid(home / "daemon.pid") == daemon_pid

    # Still protected: preempted (URG to the batch step), it is checkpointed and resumes.
    pids = cluster.pids(job)
    cluster.run("scancel", "--batch", "--signal=URG", job)
    wait_gone(pids)
    until(lambda: MARKER in cluster.output(job), 90, "the restore")
    out = cluster.output(job)
    at_dump = _numbers(out[: out.index(MARKER)])[-1]
    until(
        lambda: len(_numbers(cluster.output(job).split(MARKER, 1)[1])) >= 3,
        60,
        "counting after the restore",
    )
    out = cluster.output(job)
    assert _numbers(out.split(MARKER, 1)[1])[0] == at_dump + 1, out
    assert "SIGURG: taking a checkpoint" in out
    # The restored job's namespace holds the same segment: refused again, the daemon unharmed.
    until(
        lambda: daemon_log().count(f"Slurm job {job}: {REFUSED}") >= 2,
        30,
        "the refusal after the restore",
    )
    assert detached.alive(daemon_pid) and cluster.stasis("ps").returncode == 0
    assert detached.read_pid(home / "daemon.pid") == daemon_pid
    cluster.run("scancel", job)
    cluster.wait_state(job, ("CANCELLED", "COMPLETED", "FAILED"), 60)


def _a_book_listing_thousands_of_steps_holds_up_no_other_job(cluster: Cluster) -> None:
    """A well-formed book of the job's user listing 4000 ended steps: the daemon records each
    in Slurm with an srun of its own, a few per poll. Another job started meanwhile is
    registered (and so protected) at once, and the hostile job itself is checkpointed as
    quickly as any: neither waits behind thousands of sruns."""
    home = cluster.lay.config_of("n1").parent
    daemon_pid = detached.read_pid(home / "daemon.pid")
    flood = cluster.script(
        "flood",
        f"exec python3 -u {cluster.work}/hostile_book.py 0.5 0 4000",
        "--export=ALL,STASIS_ENABLE=1",
        f"--output={cluster.work}/flood-%j.out",
    )
    job = cluster.sbatch(flood, user=TEST_USER)
    until(lambda: "planted " in cluster.output(job), 90, "the planted book")
    cluster.wait_number(job, 4)  # the daemon has been starting Slurm records for a while
    other = cluster.sbatch(
        cluster.counter_script("other", "--export=ALL,STASIS_ENABLE=1", stop=600, interval=0.5)
    )
    cluster.wait_number(other, 2)
    until(
        lambda: "is protected" in cluster.output(other) or "WITHOUT" in cluster.output(other),
        60,
        "the other job's registration",
    )
    assert "WITHOUT checkpoint protection" not in cluster.output(other), cluster.output(other)
    pids = cluster.pids(job)
    asked = time.monotonic()
    cluster.run("scancel", "--batch", "--signal=URG", job)
    until(
        lambda: re.search(r"^stasis: checkpoint \S+ taken", cluster.output(job), re.M),
        60,
        "the checkpoint",
    )
    took_s = time.monotonic() - asked
    assert took_s < 20, f"the checkpoint took {took_s:.1f} s"
    wait_gone(pids)
    until(lambda: MARKER in cluster.output(job), 90, "the restore")
    assert detached.alive(daemon_pid) and cluster.stasis("ps").returncode == 0
    cluster.run("scancel", job, other)
    cluster.wait_state(job, ("CANCELLED", "COMPLETED", "FAILED"), 60)


VICTIM, VICTIMS = "stasis-victim", "stasis-victims"


def _victim() -> pwd.struct_passwd:
    """Another user, member of a group the test user is not in."""
    if subprocess.run(["getent", "group", VICTIMS], capture_output=True).returncode != 0:
        subprocess.run(["groupadd", VICTIMS], check=True)
    try:
        return pwd.getpwnam(VICTIM)
    except KeyError:
        subprocess.run(
            ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", VICTIMS, VICTIM],
            check=True,
        )
        return pwd.getpwnam(VICTIM)


def _a_job_name_forging_its_user_gives_step_records_no_other_groups(cluster: Cluster) -> None:
    """`scontrol show job -o` prints the job name as given, so a name holding
    "UserId=<another user>(<own uid>)" would read as the real field. Such a record is refused
    whole (stasis/slurm/scontrol.py): the job runs unprotected and says so, and the daemon never
    starts a Slurm record of its steps, least of all one with the groups of the user the name
    gave (which the test user could then use through their own srun). Were a record read, the
    mirror's identity would still be the launcher's peer credentials (tests/slurm)."""
    user = pwd.getpwnam(TEST_USER)
    victim = _victim()
    victims_gid = grp.getgrnam(VICTIMS).gr_gid
    assert victims_gid not in os.getgrouplist(TEST_USER, user.pw_gid)
    home = cluster.lay.config_of("n1").parent
    daemon_pid = detached.read_pid(home / "daemon.pid")
    assert daemon_pid is not None
    script = cluster.script(
        "forged",
        "srun sleep 60",
        "--export=ALL,STASIS_ENABLE=1",
        f"--output={cluster.work}/forged-%j.out",
    )
    job = cluster.sbatch(script, "-J", f"x UserId={victim.pw_name}({user.pw_uid})", user=TEST_USER)
    out = cluster.work / f"forged-{job}.out"

    def mirroring() -> list[int]:
        found = []
        for pid in proctree.children(daemon_pid):
            try:
                if (
                    os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "srun"
                    and f"--jobid={job}" in Path(f"/proc/{pid}/cmdline").read_text()
                ):
                    found.append(pid)
            except OSError:
                continue
        return found

    until(
        lambda: out.exists() and "the job is refused" in out.read_text(),
        60,
        f"job {job} to say it is refused",
    )
    assert "WITHOUT checkpoint protection" in out.read_text()
    # Its step runs (squeue's numeric and state fields: no name in them)...
    until(
        lambda: cluster.run("squeue", "-h", "-s", "-j", job, "-o", "%i").stdout.strip(),
        60,
        f"job {job}'s step",
    )
    # ...and over several of the daemon's polls, no record of it is started.
    deadline = time.monotonic() + 5 * mirrors.POLL_S
    while time.monotonic() < deadline:
        assert mirroring() == [], "the daemon mirrors a step of a refused job"
        time.sleep(0.2)
    cluster.run("scancel", job)
    until(
        lambda: cluster.run("squeue", "-h", "-t", "all", "-j", job, "-o", "%T").stdout.strip()
        in ("CANCELLED", "COMPLETED", "FAILED"),
        60,
        f"job {job} ended",
    )


CHECKS: list[Callable[[Cluster], None]] = [
    _a_one_page_book_claiming_256_KiB_leaves_the_daemon_serving_and_the_job_protected,
    _a_book_listing_thousands_of_steps_holds_up_no_other_job,
    _a_job_name_forging_its_user_gives_step_records_no_other_groups,
]
# Minutes of waiting on Slurm (requeues, restores): the checks run early, on their cluster
# (conftest.early_checks); each test raises its check's own error, if any.
_outcome = early_checks("test_hostile_step_book.py", _setup, close_cluster, CHECKS)


def test_a_one_page_book_claiming_256_KiB_leaves_the_daemon_serving_and_the_job_protected() -> None:
    _outcome(_a_one_page_book_claiming_256_KiB_leaves_the_daemon_serving_and_the_job_protected)


def test_a_book_listing_thousands_of_steps_holds_up_no_other_job() -> None:
    _outcome(_a_book_listing_thousands_of_steps_holds_up_no_other_job)


def test_a_job_name_forging_its_user_gives_step_records_no_other_groups() -> None:
    _outcome(_a_job_name_forging_its_user_gives_step_records_no_other_groups)
