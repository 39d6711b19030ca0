"""A Slurm job requeued while its node's store is an empty mount point (the shared filesystem
not mounted) is held, not started from the beginning, and resumes from its checkpoint once the
filesystem is back (issue 28; stasis/store/marker.py).

The store is the local cluster's shared directory; "not mounted" is a root-owned 0755 tmpfs
mounted over it, as an NFS export missing from its mount point leaves an empty directory:
every read of it succeeds, and finds nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from stasis.dev import slurmcluster
from stasis.dev.slurmdirs import read_state
from tests.e2e.conftest import Cluster, until

STORE_WAIT_S = 3


@pytest.fixture
def quick(shared_cluster: Cluster) -> Iterator[Cluster]:
    """The shared cluster with a short store wait (a held job within seconds), then as before."""
    c = shared_cluster
    conf = c.lay.stasis_config
    before = conf.read_text()
    conf.write_text(before + f"store_wait_s = {STORE_WAIT_S}\n")
    slurmcluster.stop_daemon(c.root)
    slurmcluster.start_daemon(c.root)
    try:
        yield c
    finally:
        conf.write_text(before)
        slurmcluster.stop_daemon(c.root)
        slurmcluster.start_daemon(c.root)


@contextmanager
def unmounted(c: Cluster) -> Iterator[None]:
    """On this machine and, where the one node has a mount namespace of its own (cgroup Slurm:
    a copy of this machine's, which a later mount here does not reach), in the node's."""
    holder = read_state(c.lay).get("holders", {}).get("n1") if c.nodes == 1 else None
    where = [[], *([["nsenter", "-t", str(holder), "-m", "--"]] if holder else [])]
    mount = ["mount", "-t", "tmpfs", "-o", "mode=0755,size=4m", "stasis-unmounted"]
    done = []
    try:
        for prefix in where:
            subprocess.run([*prefix, *mount, str(c.lay.store)], check=True)
            done.append(prefix)
        yield
    finally:
        for prefix in reversed(done):
            subprocess.run([*prefix, "umount", str(c.lay.store)], check=True)


def numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^(\d+)$", text, re.M)]


def test_a_job_requeued_while_its_store_is_not_mounted_is_held_then_resumes(quick: Cluster) -> None:
    c = quick
    script = c.counter_script(
        "unmounted",
        "--export=ALL,STASIS_ENABLE=1," "STASIS_CHECKPOINT=unmounted",
        stop=600,
        interval=0.5,
    )
    job = c.sbatch(script)
    try:
        c.wait_number(job, 3)
        c.stasis("dump", "--slurm-job", job, "--leave-running")
        kept = [m["id"] for m in c.checkpoints("unmounted")]
        assert len(kept) == 1
        with unmounted(c):
            c.run("scontrol", "requeue", job)

            def settled() -> dict[str, str] | None:
                j = c.job(job)
                if numbers(c.output(job)).count(0) > 1:
                    return j  # started from the beginning: what must not happen
                held = j.get("JobState") == "PENDING" and "stasis: held" in j.get("Comment", "")
                return j if held else None

            j = until(settled, 120, f"job {job} held or started again")
            out = c.output(job)
            assert numbers(out).count(0) == 1, f"the job started over:\n{out}"
            assert "is its filesystem mounted?" in j.get("Comment", ""), j
            # The node says it, where an admin looks: not ready, and no empty listing.
            for asked in (("check",), ("checkpoints", "--label", "unmounted")):
                r = c.stasis(*asked, check=False)
                said = " ".join((r.stdout + r.stderr).split())  # `check` wraps its lines
                assert r.returncode != 0 and "is its filesystem mounted?" in said, r
            # Nothing was written onto the disk under the mount point meanwhile.
            assert os.listdir(c.lay.store) == []
        assert [m["id"] for m in c.checkpoints("unmounted")] == kept
        # Back: the node that held it releases it, and it resumes from its checkpoint.
        until(
            lambda: "stasis: restored checkpoint" in c.output(job),
            120,
            "the job to be released and to resume",
        )
        last = numbers(c.output(job))[-1]
        c.wait_number(job, last + 2)
        counted = numbers(c.output(job))
        assert counted.count(0) == 1, c.output(job)
        assert counted[-1] > last
    finally:
        c.run("scancel", job, check=False)
