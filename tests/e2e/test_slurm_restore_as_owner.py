"""A Slurm job's restore, which runs as root in the job's task, opens the job's files with its
owner's rights (issue 9, item 1, for Slurm): a user who swaps a file their job holds open for a
symlink to a root-only file between the checkpoint and the requeue gets a failed restore and a
fresh start, never root's file behind the job's descriptor."""

from __future__ import annotations

import os
import pwd
import secrets

import pytest

from tests.conftest import TEST_USER
from tests.e2e.conftest import Cluster, until


@pytest.fixture(scope="module")
def cluster(shared_cluster: Cluster) -> Cluster:
    """The session's shared cluster (conftest): this module leaves it as it found it."""
    return shared_cluster


# Holds held.txt open read-write, then prints what it reads through that descriptor each second.
_PROGRAM = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
print("opened", flush=True)
for i in range(600):
    print("read:", os.pread(fd, 64, 0).decode(errors="replace").strip(), flush=True)
    time.sleep(1)
"""


def test_a_file_swapped_for_a_symlink_to_roots_file_is_not_opened_as_root(cluster: Cluster) -> None:
    user = pwd.getpwnam(TEST_USER)
    token = secrets.token_hex(4)
    secret_dir = cluster.work / f"root-only-{token}"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "secret.txt"
    secret.write_text(f"ROOT-SECRET-{token}\n")
    os.chmod(secret, 0o600)
    own = cluster.work / f"own-{token}"
    own.mkdir()
    os.chown(own, user.pw_uid, user.pw_gid)
    held = own / "held.txt"
    held.write_text("mine\n")
    os.chown(held, user.pw_uid, user.pw_gid)
    program = own / "holder.py"
    program.write_text(_PROGRAM)
    script = cluster.script(
        f"holder-{token}",
        f"exec python3 -u {program} {held}",
        "--export=STASIS_ENABLE=1",
        f"--output={own}/out-%j.txt",
    )
    job = cluster.sbatch(script, user=TEST_USER)
    until(lambda: "read: mine" in cluster.output(job), 90, "the job reading its file")
    cluster.stasis("dump", "--slurm-job", job, "--leave-running", user=TEST_USER)
    # The user's move: their own file becomes a link to what only root may read.
    os.unlink(held)
    os.symlink(secret, held)
    os.lchown(held, user.pw_uid, user.pw_gid)
    cluster.run("scontrol", "requeue", job)
    until(
        lambda: "the job runs from the start" in cluster.output(job),
        120,
        "the requeued job to give up on its checkpoint",
    )
    # Its fresh start opens held.txt as the user too, which fails: the job ends.
    cluster.wait_state(job, ("FAILED", "COMPLETED", "CANCELLED"), 60)
    out = cluster.output(job)
    assert f"ROOT-SECRET-{token}" not in out
    assert "stasis: warning: restoring checkpoint" in out and "Permission denied" in out, out
    assert "stasis: restored checkpoint" not in out, out
    assert cluster.job(job)["Restarts"] == "1"
    assert secret.read_text() == f"ROOT-SECRET-{token}\n"  # nor written through
