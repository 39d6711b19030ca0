"""A checkpoint being restored is pinned (issue 28): keep-N retention, run by a newer dump of
its label while a lazy restore still reads its pages from the store, does not delete it."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import MakeDaemon, wait_for, workload


def test_retention_spares_a_checkpoint_whose_lazy_restore_reads_it(
    make_daemon: MakeDaemon, world_tmp: Path
) -> None:
    store = world_tmp / f"pinned-{os.urandom(4).hex()}"
    # Each page answer held back 200 ms: 64 MiB take some 45 answers (~9 s) to come back.
    d = make_daemon(store=f"dir::file://{store}", keep=1, env={"STASIS_TEST_PAGE_DELAY_MS": "200"})
    job = d.run(*workload("memhold.py", 64), label="pinned")
    wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
    first = d.json("dump", job["job"])["checkpoint"]
    restored = d.json("restore", "--lazy", first)
    assert restored["lazy"] is True
    memory = d.state_dir / "jobs" / restored["job"] / "memory.json"
    # A newer checkpoint of the label while the restore still reads the first: keep=1 would
    # delete the first one now.
    other = d.run(*workload("counter.py", 0.1), label="pinned")
    second = d.json("dump", other["job"])["checkpoint"]
    assert not memory.exists(), "the lazy restore finished too soon for this test"
    ids = [c["id"] for c in d.json("checkpoints", "--label", "pinned")]
    assert first in ids and second in ids, ids
    assert (store / first / "manifest.json").exists()
    # Once all its memory is back, the pin goes and retention may take it later.
    wait_for(memory.exists, 60, "lazy-pages done")
    d.cli("kill", restored["job"])
