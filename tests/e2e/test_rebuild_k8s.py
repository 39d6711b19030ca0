"""A node daemon whose job database is found corrupt at its start keeps protecting the
containers registered before (issue 28): the database is moved aside and rebuilt, and the
registrations come back from the files the node keeps of them (stasis/daemon/records.py). A
container with an interval, the daemon stopped, its database overwritten with garbage, started
again: its interval checkpoints go on, and `stasis dump --container` still finds it. (Before:
the rebuilt database knew no container, and it ran unprotected until it was created again.)

Through containerd's real runc shim with the stasis runtime (the node of test_k8s_faults)."""

from __future__ import annotations

import os
import secrets

from stasis.daemon import detached
from tests.conftest import wait_for
from tests.e2e.containerd_node import numbers
from tests.e2e.test_k8s_faults import (  # noqa: F401 - the fixture
    COUNTER,
    FaultNode,
    node,
    started,
)


def test_a_registered_container_keeps_its_intervals_after_a_rebuild(node: FaultNode) -> None:
    label, cid = f"rebuilt-{secrets.token_hex(3)}", "c-rebuilt"
    log = started(node, cid, COUNTER, {"STASIS_CHECKPOINT": label, "STASIS_INTERVAL": "2"})
    wait_for(lambda: node.checkpoint_ids(label), 30, "an interval checkpoint")
    state = node.lay.stasis / "state"
    detached.stop(node.pid)
    (state / "jobs.db").write_bytes(os.urandom(64 << 10))
    for extra in ("jobs.db-wal", "jobs.db-shm"):
        (state / extra).unlink(missing_ok=True)
    node.restart_daemon()
    assert list(state.glob("jobs.db.corrupt-*")), "the database was not rebuilt"
    had = set(node.checkpoint_ids(label))
    wait_for(
        lambda: set(node.checkpoint_ids(label)) - had,
        30,
        "an interval checkpoint after the rebuild",
    )
    # By hand too, by the container's id alone (its runc root is the registration's).
    by_hand = node.stasis("dump", "--container", cid, "--leave-running", "--json")
    assert by_hand.returncode == 0, by_hand.stderr
    counted = len(numbers(log))
    wait_for(lambda: len(numbers(log)) > counted + 3, 10, "the counter to go on")
    node.stop(cid)
    node.remove(cid)
