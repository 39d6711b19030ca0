"""The node's default interval (the `interval` setting) on a real local cluster: an opted-in job
that sets no STASIS_INTERVAL is checkpointed at the node's interval (seconds, or `auto`), one with
STASIS_INTERVAL=off is not, and a job's own STASIS_INTERVAL wins; `stasis slurm intervals` says
which applied and why."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from stasis.dev import slurmcluster
from tests.conftest import TEST_USER
from tests.e2e.conftest import Cluster, until

pytestmark = pytest.mark.timeout(300)

NODE = "n1"
_ORIGINAL: dict[str, str] = {}  # the node's config file before this module


@pytest.fixture(scope="module")
def cluster(shared_cluster: Cluster) -> Iterator[Cluster]:
    """The shared cluster; its node's config file as it was, and its daemon restarted with it,
    when the module ends."""
    config = shared_cluster.lay.config_of(NODE)
    _ORIGINAL[NODE] = config.read_text()
    yield shared_cluster
    for job in shared_cluster.run("squeue", "-h", "-o", "%i").stdout.split():
        shared_cluster.run("scancel", job, check=False)
    configure(shared_cluster, "")


def configure(c: Cluster, more: str) -> None:
    """The node daemon started again with its config file as it was, and `more`."""
    slurmcluster.stop_daemon(c.root)
    c.lay.config_of(NODE).write_text(_ORIGINAL[NODE] + more)
    slurmcluster.start_daemon(c.root)


def job(c: Cluster, name: str, *env: str) -> str:
    """An opted-in counter (1 line per 0.5 s), with the job environment `env` only."""
    return c.sbatch(
        c.script(
            name,
            f"exec python3 -u {c.work}/counter.py 600 0.5 0",
            f"--output={c.work}/{name}-%j.out",
            f"--export={','.join(('STASIS_ENABLE=1', f'STASIS_CHECKPOINT={name}', *env))}",
        ),
        user=TEST_USER,
    )


def intervals(c: Cluster) -> dict[str, dict[str, Any]]:
    found = json.loads(c.stasis("slurm", "intervals", "--json").stdout)
    return {e["slurm_job"]: e for e in found}


def test_jobs_without_an_interval_get_the_node_s_seconds_and_off_gets_none(
    cluster: Cluster,
) -> None:
    c, tag = cluster, secrets.token_hex(3)
    configure(c, 'interval = "2"\n')
    plain, off = f"dflt-{tag}", f"off-{tag}"
    plain_id = job(c, plain)
    off_id = job(c, off, "STASIS_INTERVAL=off")
    try:
        until(
            lambda: len(c.checkpoints(plain, user=TEST_USER)) >= 3,
            90,
            "three periodic checkpoints of the job that asked for no interval",
        )
        c.wait_number(off_id, 4)
        found = intervals(c)
        entry = found[plain_id]
        assert (entry["requested"], entry["interval_s"]) == ("2", 2.0), entry
        assert "the node's default" in entry["why"] and "interval = '2'" in entry["why"], entry
        # off: no interval, no checkpoint, not listed, whatever the node's default.
        assert off_id not in found
        assert c.checkpoints(off, user=TEST_USER) == []
        assert "stasis: checkpoint interval 2.0 s" in c.output(plain_id)
        assert "periodic checkpoint" not in c.output(off_id)
    finally:
        c.run("scancel", plain_id, off_id)


def test_the_node_s_auto_applies_and_a_job_s_own_interval_wins(cluster: Cluster) -> None:
    c, tag = cluster, secrets.token_hex(3)
    # No accounting on this cluster: no interruption rate, so `auto` gives the ceiling.
    configure(c, 'interval = "auto"\ninterval_min_s = 1\ninterval_max_s = 3\n')
    auto, own = f"auto-{tag}", f"own-{tag}"
    auto_id = job(c, auto)
    own_id = job(c, own, "STASIS_INTERVAL=600")
    try:
        until(
            lambda: len(c.checkpoints(auto, user=TEST_USER)) >= 2,
            90,
            "two periodic checkpoints at the node's auto interval",
        )

        def both() -> dict[str, dict[str, Any]] | None:
            f = intervals(c)
            return f if own_id in f and auto_id in f else None

        found = until(both, 30, "both jobs")
        entry = found[auto_id]
        assert (entry["requested"], entry["interval_s"], entry["bound"]) == ("auto", 3.0, "ceiling")
        assert entry["why"].startswith("auto (this node's default: interval = 'auto'): "), entry
        mine = found[own_id]
        assert (mine["requested"], mine["interval_s"]) == ("600", 600.0)
        assert mine["why"] == "asked: STASIS_INTERVAL=600"
        assert c.checkpoints(own, user=TEST_USER) == []
        text = c.stasis("slurm", "intervals", user=TEST_USER).stdout
        assert auto_id in text and "this node's default" in text
    finally:
        c.run("scancel", auto_id, own_id)
