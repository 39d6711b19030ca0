"""A Slurm cluster of two real nodes (each its own host) whose stasis daemons have joined a
control plane served on this machine's bridge address: the set-up the cross-node tests share."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stasis.dev import slurmcluster
from tests.conftest import wait_for
from tests.controlplane.conftest import ControlPlane
from tests.e2e.conftest import Cluster, close_cluster, new_cluster


@contextmanager
def joined_site(name: str, node_ready: bool = False) -> Iterator[tuple[Cluster, ControlPlane]]:
    """`node_ready`: also wait until both nodes reported their Slurm state."""
    c = new_cluster(name, nodes=2)
    cp = ControlPlane(Path(tempfile.mkdtemp(prefix="cp-", dir=c.root)), "")
    cp.db = str(cp.root / "controlplane.db")
    try:
        # The nodes reach this machine at the bridge's address, not at its loopback.
        cp.start("--listen", f"0.0.0.0:{cp.port}", "--allow-plain-http")
        hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
        url = f"http://{c.lay.host_address()}:{cp.port}"
        for node in ("n1", "n2"):
            config = c.lay.config_of(node)
            config.write_text(
                config.read_text() + f'controlplane_url = "{url}"\n'
                f'cluster_id = "{hpc["cluster_id"]}"\n'
                f'auth_token = "{hpc["token"]}"\n'
                "controlplane_heartbeat_s = 0.5\n"
                # the bridge is this test's own: plain HTTP, said so
                "controlplane_allow_plain_http = true\n"
            )
            os.chmod(config, 0o600)  # it holds the cluster's token now
            slurmcluster.stop_daemon(c.root, node)
            slurmcluster.start_daemon(c.root, node)
        wait_for(
            lambda: sorted(
                n["name"]
                for n in cp.json("nodes")
                if n["state"] == "ready" and (n.get("scheduler_state") or not node_ready)
            )
            == ["n1", "n2"],
            60,
            "both nodes ready in the control plane",
        )
        yield c, cp
    finally:
        cp.stop()
        close_cluster(c)
