"""Slurm's job_container/tmpfs on a local cluster (one real slurmd node: the local cluster's
nodes in namespaces of their own cannot run job containers): each job has a /tmp of its own (a
directory of its node's bound in the job's mount namespace, removed when the job ends) and a
/dev/shm of its own. A job checkpointed and requeued resumes in its new job container with both
as they were: the files it held open or had closed, a link it planted as a link
(stasis/engine/boundtmp.py, privatetmp.py; tests/engine/test_privatetmp.py restores into a
container whose /tmp is another directory, as on another node)."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from stasis.daemon import detached
from tests.conftest import TEST_USER
from tests.e2e.conftest import Cluster, close_cluster, new_cluster, until

JOB = """\
import os, sys, time
stop, marker = int(sys.argv[1]), "/tmp/marker-" + sys.argv[2]
if not os.path.exists(marker):
    with open(marker, "w") as f:
        f.write("made-by-run-" + os.environ.get("SLURM_RESTART_COUNT", "0"))
    os.makedirs("/tmp/d/e")
    with open("/tmp/d/e/f", "w") as f:
        f.write("deep")
    os.symlink("/etc/shadow", "/tmp/link")
    with open("/dev/shm/shm-file", "w") as f:
        f.write("shm-data")
held = open("/tmp/held", "a+")  # open all along, as a JVM's perf data file is
for i in range(stop):
    held.write(f"{i}\\n")
    held.flush()
    with open(marker) as m, open("/tmp/d/e/f") as d, open("/dev/shm/shm-file") as s:
        print(i, m.read(), d.read(), s.read(), flush=True)
    time.sleep(0.5)
print("done", flush=True)
"""
LINE = re.compile(r"^(\d+) (\S+) (\S+) (\S+)$", re.M)


@pytest.fixture(scope="module")
def contained() -> Iterator[Cluster]:
    c = new_cluster("jobcontainer", nodes=1, job_container=True)
    yield c
    close_cluster(c)


def _lines(c: Cluster, job: str) -> list[tuple[int, str, str, str]]:
    return [(int(n), m, d, s) for n, m, d, s in LINE.findall(c.output(job))]


def test_job_container_tmp_and_shm_move_with_the_job(contained: Cluster) -> None:
    c = contained
    (c.work / "tmpjob.py").write_text(JOB)
    token = secrets.token_hex(4)
    script = c.script(
        "tmpjob",
        f"exec /usr/bin/python3 -u {c.work}/tmpjob.py 36 {token}",
        f"--output={c.work}/tmpjob-%j.out",
        "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=tmpjob",
    )
    shadow = hashlib.sha256(Path("/etc/shadow").read_bytes()).hexdigest()
    job = c.sbatch(script, user=TEST_USER)
    c.wait_state(job, ("RUNNING",))
    until(lambda: len(_lines(c, job)) >= 4, 90, f"job {job} counting")
    assert _lines(c, job)[-1][1:] == ("made-by-run-0", "deep", "shm-data")
    # Its /tmp is its own: not its node's.
    assert not Path(f"/tmp/marker-{token}").exists()
    out = c.stasis("dump", "--slurm-job", job, user=TEST_USER).stdout
    assert "requeued" in out
    try:
        until(lambda: "stasis: restored checkpoint" in c.output(job), 90, f"job {job} restored")
    except AssertionError as e:
        raise AssertionError(f"{e}; {c.why(job)}; its output:\n{c.output(job)}") from None
    # The link it planted came back as a link, in the new job container's directory.
    links = list((c.root / "job-containers").rglob("link"))
    assert links and all(os.readlink(p) == "/etc/shadow" for p in links), links
    # And the file it holds open, with what it had written before the checkpoint.
    held = [p for p in (c.root / "job-containers").rglob("held")]
    until(
        lambda: held and held[0].read_text().split()[:3] == ["0", "1", "2"],
        30,
        "the held file back",
    )
    # Checkpointed again in its new container (its output, opened there by the restorer before
    # CRIU rebuilt the job's mounts, goes as an external file: engine/privatetmp.py) and
    # requeued again: it goes on once more.
    at = _lines(c, job)[-1][0]
    c.wait_state(job, ("RUNNING",))
    assert "requeued" in c.stasis("dump", "--slurm-job", job, user=TEST_USER).stdout
    try:
        until(lambda: c.output(job).count("stasis: restored checkpoint") >= 2, 90, "restored again")
    except AssertionError as e:
        raise AssertionError(f"{e}; {c.why(job)}; its output:\n{c.output(job)}") from None
    c.wait_state(job, ("COMPLETED",), 90)
    lines = _lines(c, job)
    assert lines[-1][0] == 35 and at < 35
    # Each count once, in order: it went on from where it was, in its new container, and read
    # the /tmp and /dev/shm it had made in the first (the job makes them only when missing).
    assert [n for n, *_ in lines] == list(range(36)), c.output(job)
    assert {(m, d, s) for _, m, d, s in lines} == {("made-by-run-0", "deep", "shm-data")}
    assert "done" in c.output(job)
    assert hashlib.sha256(Path("/etc/shadow").read_bytes()).hexdigest() == shadow
    # Each stopped run's batch step ended at Slurm's SIGTERM, not KillWait (5 s) later at its
    # SIGKILL: lingering there, it made Slurm 24.11 drain the node after 2 of 36 stops
    # (launcher.py).
    ends = _batch_step_ends(c, job)
    assert len(ends) == 2 and max(ends) < 3.0, ends


def _batch_step_ends(c: Cluster, job: str) -> list[float]:
    """From slurmd's log: the seconds from each requeue's cancel of `job`'s batch step to the
    end of that step."""
    log = (c.lay.slurm / "slurmd.log").read_text(errors="replace")
    ends, cancelled = [], None
    for at, what in re.findall(rf"^\[([\d:T.-]+)\] \[{job}\.batch\] (.*)$", log, re.M):
        t = datetime.fromisoformat(at).timestamp()
        if "DUE TO JOB REQUEUE" in what:
            cancelled = t
        elif cancelled is not None and re.match(r"(stepd_cleanup: )?done with (job|step)", what):
            ends.append(t - cancelled)
            cancelled = None
    return ends


def _stand_in(c: Cluster, job: str, user: str | None, seconds: float) -> subprocess.Popen[bytes]:
    """A process titled as job `job`'s extern slurmstepd, in slurmd's mount namespace, as root
    or as `user`."""
    slurmd = detached.read_pid(c.lay.slurm / "slurmd.pid")
    cmd = ["bash", "-c", f"exec -a 'slurmstepd: [{job}.extern]' sleep {seconds}"]
    # nsenter and setpriv exec (runuser would fork, and a kill would miss the stand-in).
    inside = ["nsenter", f"--mount=/proc/{slurmd}/ns/mnt", "--"]
    as_user = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--"]
    return subprocess.Popen([*inside, *as_user, *cmd] if user else [*inside, *cmd])


def test_the_epilog_waits_for_the_jobs_extern_step_to_be_gone(contained: Cluster) -> None:
    """Slurm 22.05 removes a job's container in its extern step after slurmd saw that step end,
    while the epilog runs: stasis' epilog holds the node's part of the job until that step is
    gone, so that the job requeued there at once (the same id) never finds its container half
    removed. Played with a stand-in titled as the job's extern step: root's holds the job
    COMPLETING until it exits; its user's holds nothing."""
    c = contained
    script = c.script("quick", "sleep 2", f"--output={c.work}/quick-%j.out")
    job = c.sbatch(script, user=TEST_USER)
    c.wait_state(job, ("RUNNING",))
    step = _stand_in(c, job, None, 8)
    try:
        c.wait_state(job, ("COMPLETING", "COMPLETED"), 30)
        for _ in range(4):  # while the stand-in lives, the job's epilog is not done
            assert step.poll() is None and c.state(job) == "COMPLETING", c.job(job)
            time.sleep(0.5)
        step.wait(30)
        c.wait_state(job, ("COMPLETED",), 20)
    finally:
        step.kill()
        step.wait()

    job = c.sbatch(script, user=TEST_USER)
    c.wait_state(job, ("RUNNING",))
    step = _stand_in(c, job, TEST_USER, 60)
    try:
        c.wait_state(job, ("COMPLETED",), 20)
        assert step.poll() is None  # it ended while the user's stand-in still ran
    finally:
        step.kill()
        step.wait()
