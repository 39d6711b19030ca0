"""A node whose daemon cannot protect jobs (JobManager.readiness_problems: here its store is
one it must not trust, writable by everyone) reports itself not ready, with the reason, at once
(not at its next periodic check); the control plane makes it no migration target until it is
ready again, which it reports as soon as it is."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tests.conftest import new_daemon, wait_for
from tests.controlplane.conftest import ControlPlane
from tests.controlplane.fakenode import FakeNode
from tests.controlplane.test_node import node_env, nodes


def test_a_node_that_cannot_protect_jobs_is_not_ready_and_no_migration_target(
    world_tmp: Path,
) -> None:
    root = Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp))
    cp = ControlPlane(root, str(root / "cp.db"))
    cp.start("--lost-after", "30")
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    store = Path(tempfile.mkdtemp(prefix="store-", dir=world_tmp))
    d = new_daemon(world_tmp, "node-r", store=str(store), env=node_env(cp, hpc, "node-r"))
    src = FakeNode(cp, hpc, "src")
    # Anyone may plant a checkpoint there: the daemon, started, says it cannot trust it.
    os.chmod(store, 0o777)
    try:
        d.start()
        src.register()

        def not_ready() -> dict[str, object] | None:
            n = nodes(cp)["node-r"]
            return n if n["state"] == "not-ready" else None

        n = wait_for(not_ready, 30, "node-r to join, not ready")
        assert any("writable by other users" in p for p in n["problems"]), n  # type: ignore
        src.heartbeat([{"job": "j-1"}])
        status, refused = cp.call(
            "POST", "/api/v1/migrations", cp.admin, {"job": "j-1", "to": "node-r"}
        )
        assert status == 409 and refused["error"].startswith("node node-r is not ready ("), refused
        assert "writable by other users" in refused["error"] and "\n" not in refused["error"]

        os.chmod(store, 0o755)
        wait_for(lambda: nodes(cp)["node-r"]["state"] == "ready", 30, "node-r ready again")
        src.heartbeat([{"job": "j-1"}])
        status, moved = cp.call(
            "POST", "/api/v1/migrations", cp.admin, {"job": "j-1", "to": "node-r"}
        )
        assert status == 201, moved
    finally:
        d.stop()
        cp.stop()
