"""A node whose clock is days ahead shares the store with a correct one (issue 28): the label's
order follows lineage, not the clocks. The skewed daemon runs under libfaketime (its CRIU and the
job it starts too); the store and its files are the kernel's, with the right time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_restore_state import last_number, numbers

FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")

pytestmark = pytest.mark.skipif(
    not FAKETIME.exists(), reason="libfaketime is missing: scripts/install-test-apps.sh"
)


def skewed_env(site_key: Path) -> dict[str, str]:
    return {
        "STASIS_SITE_KEY": str(site_key),
        "LD_PRELOAD": str(FAKETIME),
        "FAKETIME": "+2d",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


def dump(d: Daemon, job: str) -> tuple[str, int]:
    """Stop-dump `job` on `d`: the checkpoint's id and the last number the job printed."""
    checkpoint = str(d.json("dump", job)["checkpoint"])
    return checkpoint, last_number(d, job)


def test_a_node_with_its_clock_ahead_neither_wins_newest_nor_outlives_retention(
    make_daemon: MakeDaemon, site_key: Path
) -> None:
    skewed = make_daemon(keep=2, env=skewed_env(site_key))
    correct = make_daemon(store=skewed.store, keep=2, env={"STASIS_SITE_KEY": str(site_key)})
    # The job starts on the skewed node and is checkpointed there: its id and `created` are two
    # days in the future.
    job = skewed.json("run", "--label", "skew", "--", *workload("counter.py"))
    wait_for(lambda: last_number(skewed, job["job"]) >= 3, what="counting")
    first, _ = dump(skewed, job["job"])
    restored = correct.json("restore", "--label", "skew")
    assert restored["checkpoint"] == first
    wait_for(lambda: last_number(correct, restored["job"]) >= 3, what="counting on")
    second, at_second = dump(correct, restored["job"])
    assert first > second  # by the ids (the clocks), the skewed one is the newer
    listed = {c["id"]: c for c in correct.json("checkpoints")}
    assert set(listed) == {first, second}
    manifest = json.loads((Path(correct.store) / second / "manifest.json").read_text())
    assert manifest["parent"] == first
    # Restore by label takes the correct node's newer checkpoint, on either node.
    again = correct.json("restore", "--label", "skew")
    assert again["checkpoint"] == second
    wait_for(lambda: last_number(correct, again["job"]) >= at_second + 3, what="counting on")
    assert numbers(correct.log_of(again["job"]))[0] == 0  # the same counter, never restarted
    # Keep 2: the next dump rotates out the old skewed checkpoint, not the correct node's.
    third, _ = dump(correct, again["job"])
    assert {c["id"] for c in correct.json("checkpoints")} == {third, second}
    assert {c["id"] for c in skewed.json("checkpoints")} == {third, second}
