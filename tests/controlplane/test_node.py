"""Real node daemons joining the control plane (connecting out with their cluster's token):
registered with their versions and check, heartbeating their running jobs, shown as lost when
they stop, registered again when the control plane lost its database; the token never logged."""

from __future__ import annotations

import json
import pwd
import shutil
import tempfile
from pathlib import Path

from tests.conftest import Daemon, new_daemon, wait_for, workload
from tests.controlplane.conftest import ControlPlane


def node_env(
    cp: ControlPlane, cluster: dict[str, str], name: str, spelling: str = "STASIS"
) -> dict[str, str]:
    if spelling == "CEDANA":
        return {
            "CEDANA_URL": cp.url,
            "CEDANA_CLUSTER_ID": cluster["cluster_id"],
            "CEDANA_AUTH_TOKEN": cluster["token"],
            "STASIS_NODE_NAME": name,
            "STASIS_CONTROLPLANE_HEARTBEAT_S": "0.5",
            **cp.client_env,
        }
    return {
        "STASIS_CONTROLPLANE_URL": cp.url,
        "STASIS_CLUSTER_ID": cluster["cluster_id"],
        "STASIS_AUTH_TOKEN": cluster["token"],
        "STASIS_NODE_NAME": name,
        "STASIS_CONTROLPLANE_HEARTBEAT_S": "0.5",
        **cp.client_env,
    }


def node_credential(d: Daemon) -> str:
    """The credential the node got when it joined (kept in its state dir)."""
    return str(json.loads((d.state_dir / "controlplane-node.json").read_text())["token"])


def nodes(cp: ControlPlane) -> dict[str, dict[str, object]]:
    return {n["name"]: n for n in cp.json("nodes")}


def test_nodes_join_report_their_jobs_and_are_lost_when_they_stop(
    controlplane: ControlPlane, world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    cp = controlplane
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    a = new_daemon(world_tmp, "node-a", env=node_env(cp, cluster, "node-a"))
    b = new_daemon(world_tmp, "node-b", env=node_env(cp, cluster, "node-b", "CEDANA"))
    started: list[Daemon] = []
    try:
        for d in (a, b):
            d.start()
            started.append(d)
        wait_for(lambda: set(nodes(cp)) == {"node-a", "node-b"}, 30, "both nodes to join")
        n = nodes(cp)["node-a"]
        assert n["cluster"] == "hpc" and n["state"] == "ready", n
        assert str(n["criu_version"]).startswith("4.") and n["stasis_version"]
        job = a.run(*workload("counter.py"), label="cp-count")
        wait_for(lambda: nodes(cp)["node-a"]["jobs"] == 1, 30, "node-a's running job")
        assert nodes(cp)["node-b"]["jobs"] == 0
        a.cli("kill", job["job"])
        wait_for(lambda: nodes(cp)["node-a"]["jobs"] == 0, 30, "the job to be gone")

        b.stop()
        started.remove(b)
        wait_for(lambda: nodes(cp)["node-b"]["state"] == "lost", 30, "node-b to be lost")
        assert nodes(cp)["node-a"]["state"] == "ready"
        for d in (a, b):
            log = (d.root / "daemon.log").read_text()
            assert cluster["token"] not in log
        assert "joined the control plane at " in (a.root / "daemon.log").read_text()
    finally:
        for d in started:
            d.kill_all()
            d.stop()


def test_a_node_registers_again_with_a_control_plane_that_lost_its_database(
    world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    root = Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp))
    cp = ControlPlane(root, str(root / "cp.db"))
    cp.start()
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    d = new_daemon(world_tmp, "node-r", env=node_env(cp, cluster, "node-r"))
    try:
        d.start()
        wait_for(lambda: "node-r" in nodes(cp), 30, "the node to join")
        # The control plane is restarted from a copy taken before the node joined: it knows
        # the cluster and its token, not the node.
        cp.stop()
        shutil.copy(root / "cp.db", root / "with-node.db")
        from sqlalchemy import create_engine, text

        engine = create_engine(f"sqlite:///{root / 'cp.db'}")
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM nodes"))
        engine.dispose()
        cp.start()
        assert "node-r" not in {n["name"] for n in cp.call("GET", "/api/v1/nodes", cp.admin)[1]}
        wait_for(lambda: "node-r" in nodes(cp), 30, "the node to register again")
    finally:
        d.stop()
        cp.stop()


def test_a_node_that_lost_its_credential_is_refused_until_an_admin_resets_it(
    world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    root = Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp))
    cp = ControlPlane(root, str(root / "cp.db"))
    cp.start()
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    d = new_daemon(world_tmp, "node-l", env=node_env(cp, cluster, "node-l"))
    try:
        d.start()
        kept = d.state_dir / "controlplane-node.json"
        wait_for(kept.exists, 30, "the node to join and keep its credential")
        first = node_credential(d)
        # Its state dir is lost: with the cluster token alone it may not take the name back.
        d.stop()
        kept.unlink()
        d.start()
        said = f"node node-l of cluster {cluster['cluster_id']} is already joined"
        wait_for(lambda: said in (d.root / "daemon.log").read_text(), 30, "the refusal")
        assert not kept.exists()
        # An admin resets it: it joins again, with a new credential.
        cp.json("nodes", "reset", "node-l", "--cluster", "hpc")
        wait_for(kept.exists, 30, "the node to join again")
        second = node_credential(d)
        assert second != first
        # Reset while it runs: its credential is refused, it joins again by itself.
        cp.json("nodes", "reset", "node-l")
        wait_for(
            lambda: kept.exists() and node_credential(d) not in (first, second),
            30,
            "the node to join again after the reset",
        )
        log = (d.root / "daemon.log").read_text()
        assert log.count(said) == 1  # said once, not every heartbeat
        for token in (first, second, node_credential(d), cluster["token"]):
            assert token not in log
    finally:
        d.stop()
        cp.stop()
