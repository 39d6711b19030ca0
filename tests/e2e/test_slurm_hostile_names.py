"""A user names their opted-in job so that `scontrol show job -o` reads as someone else's record
(Slurm prints the name raw): `x UserId=root(<their uid>) StdOut=<elsewhere> AdminComment=...`.
Read naively, the job registers as user "root", with output and token of the name's choosing.
The record is refused whole: the job runs, unprotected and told so, its output where Slurm puts
it; nothing is registered for it, no checkpoint is taken or labelled under a forged name."""

from __future__ import annotations

import hashlib
import pwd
import re
import secrets
from pathlib import Path

import pytest

from tests.conftest import TEST_USER
from tests.e2e.conftest import Cluster, until


@pytest.fixture(scope="module")
def cluster(shared_cluster: Cluster) -> Cluster:
    """The session's shared cluster (conftest): this module leaves it as it found it."""
    return shared_cluster


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# Keys written after the name; or a whole record, the real one's rest made a second line.
NAMES = {
    "keys": "x UserId=root({uid}) StdOut={out} WorkDir=/root AdminComment=stasis-token=abc",
    "record": "x UserId=root({uid}) GroupId=root(0) JobState=RUNNING StdOut={out} "
    "StdErr={out} WorkDir=/root AdminComment=stasis-token=abc\nJobId=99 JobName=y",
}


@pytest.mark.parametrize("forgery", sorted(NAMES))
def test_a_job_named_with_forged_keys_is_refused_and_runs_as_itself(
    cluster: Cluster, forgery: str
) -> None:
    uid = pwd.getpwnam(TEST_USER).pw_uid
    label = f"hostile-{secrets.token_hex(3)}"
    forged_out = cluster.work / f"forged-{label}.out"
    name = NAMES[forgery].format(uid=uid, out=forged_out)
    shadow = _digest("/etc/shadow")
    script = cluster.script(
        "hostile",
        f"exec python3 -u {cluster.work}/counter.py 16 0.5 0",
        f"--output={cluster.work}/hostile-%j.out",
        f"--export=STASIS_ENABLE=1,STASIS_CHECKPOINT={label}",
    )
    job = cluster.sbatch(script, "-J", name, user=TEST_USER)
    real_out = cluster.work / f"hostile-{job}.out"  # where Slurm really writes it

    def counted() -> bool:
        return real_out.exists() and "\n3\n" in real_out.read_text()

    until(counted, 90, f"job {job}'s counter in {real_out}")
    # Its owner asks for a checkpoint: refused in one line, the record read by no one.
    dump = cluster.stasis(
        "dump", "--slurm-job", job, "--leave-running", user=TEST_USER, check=False
    )
    assert dump.returncode != 0, dump.stdout
    assert dump.stderr.count("\n") == 1 and "the job is refused" in dump.stderr, dump.stderr
    # (Not cluster.state: the test's own reading of scontrol would take the forged JobState.)
    until(
        lambda: cluster.run("squeue", "-h", "-t", "all", "-j", job, "-o", "%T").stdout.strip()
        == "COMPLETED",
        90,
        f"job {job} completed",
    )
    out = real_out.read_text()
    assert re.findall(r"^(\d+)$", out, re.M) == [str(i) for i in range(16)], out
    refusals = [line for line in out.splitlines() if "the job is refused" in line]
    assert len(refusals) == 1 and "WITHOUT checkpoint protection" in out, out
    assert not forged_out.exists()
    assert _digest("/etc/shadow") == shadow
    # No checkpoint of the job anywhere, whoever lists, and none under the name "root".
    assert cluster.checkpoints(label, user=TEST_USER) == []
    assert cluster.checkpoints(label) == []
    everything = cluster.checkpoints() + cluster.checkpoints(user=TEST_USER)
    assert not [c for c in everything if c.get("job") == job or c.get("label") == label]


def test_every_task_of_an_opted_in_array_is_protected(cluster: Cluster) -> None:
    """scontrol prints every task of an array for the task whose job id is the array's own:
    that task is read alone (as ARRAY_TASK, from squeue's numeric fields), not refused as a
    record with a line break in it."""
    label = f"array-{secrets.token_hex(3)}"
    script = cluster.script(
        "array",
        f"exec python3 -u {cluster.work}/counter.py 60 0.5 0",
        f"--output={cluster.work}/array-%A_%a.out",
        "--array=0-1",
        f"--export=STASIS_ENABLE=1,STASIS_CHECKPOINT={label}",
    )
    array = cluster.sbatch(script, user=TEST_USER)
    outs = [cluster.work / f"array-{array}_{task}.out" for task in (0, 1)]
    until(
        lambda: all(o.exists() and "\n3\n" in o.read_text() for o in outs),
        90,
        f"both tasks of array {array} counting",
    )
    tasks = dict(
        line.split()
        for line in cluster.run(
            "squeue", "-h", "-r", "-j", array, "-o", "%A %K"
        ).stdout.splitlines()
    )
    assert array in tasks, tasks  # the task that has the array's own job id
    for job in tasks:
        dump = cluster.stasis(
            "dump", "--slurm-job", job, "--leave-running", user=TEST_USER, check=False
        )
        assert dump.returncode == 0, dump.stderr
    taken = {c["job"] for c in cluster.checkpoints(label, user=TEST_USER)}
    assert len(taken) == 2, taken
    for out in outs:
        assert "WITHOUT checkpoint protection" not in out.read_text()
    cluster.run("scancel", array)
