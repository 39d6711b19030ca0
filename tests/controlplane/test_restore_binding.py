"""On the node: a restore command from the control plane is carried out only for the checkpoint
its migration took, never for an arbitrary checkpoint id. A node joined with a stolen cluster
token (the rogue, spoken over HTTP) reports a job, is made the source of a migration to a real
node, and answers with another user's checkpoint in the shared store; a restore command put
straight into the control plane's database (as a compromised control plane could) names one
too. The real node refuses both and restores nothing; a real migration still goes through."""

from __future__ import annotations

import json
import os
import pwd
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, insert, select

from stasis.controlplane.schema import commands
from tests import nodes
from tests.conftest import new_daemon, wait_for, workload
from tests.controlplane.conftest import ControlPlane
from tests.controlplane.fakenode import FakeNode
from tests.controlplane.test_node import node_credential, node_env


def finished(cp: ControlPlane, command_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        c: dict[str, Any] = cp.call("GET", f"/api/v1/commands/{command_id}", cp.admin)[1]
        return c if c["state"] in ("done", "failed") else None

    return wait_for(done, 60, f"command {command_id} to be answered")


def test_a_node_restores_only_the_checkpoint_its_migration_took(
    world_tmp: Path, site_key: Path, test_user: pwd.struct_passwd
) -> None:
    root = Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp))
    cp = ControlPlane(root, str(root / "cp.db"), host=nodes.site_address())
    cp.start()
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    store = Path(tempfile.mkdtemp(prefix="shared-store-", dir=world_tmp))
    env = {"STASIS_SITE_KEY": str(site_key)}
    # Hosts of their own (tests/nodes.py): the rogue speaks from this machine, off their nodes.
    a = new_daemon(
        world_tmp,
        "node-a",
        store=str(store),
        separate=True,
        env={**node_env(cp, hpc, "node-a"), **env},
    )
    b = new_daemon(
        world_tmp,
        "node-b",
        store=str(store),
        separate=True,
        env={**node_env(cp, hpc, "node-b"), **env},
    )
    started = []
    try:
        for d in (a, b):
            d.start()
            started.append(d)
        # The node joined and keeps its own credential: root's alone, never logged.
        wait_for(lambda: (b.state_dir / "controlplane-node.json").exists(), 30, "b to join")
        st = (b.state_dir / "controlplane-node.json").stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        assert node_credential(b) not in (b.root / "daemon.log").read_text()

        # The victim: a job of the test user's on node-b, checkpointed in the shared store.
        victim = b.run(*workload("counter.py"), label="victim", user=test_user.pw_name)["job"]
        wait_for(lambda: len(b.log_of(victim).split()) >= 2, 30, "the victim to count")
        ckpt = b.json("dump", victim, "--leave-running")["checkpoint"]
        b.cli("kill", victim)
        jobs_before = sorted(j["job"] for j in b.json("ps"))

        # The rogue joins with the cluster token and reports a job of its own.
        rogue = FakeNode(cp, hpc, "node-r")
        rogue.register()
        rogue.heartbeat([{"job": "j-rogue", "label": "mine", "user": "alice"}])
        status, cmd = cp.call(
            "POST", "/api/v1/migrations", cp.admin, {"job": "j-rogue", "to": "node-b"}
        )
        assert status == 201, cmd
        got = rogue.lease()
        assert got is not None and got["id"] == cmd["id"]
        # It answers with the victim's checkpoint; with its job, label and owner too.
        forged = {
            "checkpoint": ckpt,
            "label": "victim",
            "seal": {"key_id": "0" * 32, "hmac_sha256": "0" * 64},
        }
        done = rogue.ack(cmd["id"], True, forged)
        restore = finished(cp, done["result"]["next"])
        assert restore["node"] == "node-b" and restore["state"] == "failed", restore
        error = restore["result"]["error"]
        assert error.startswith(
            f"restore of checkpoint {ckpt} refused: this node restores for "
            "the control plane only the checkpoint a migration took"
        ), error
        assert "\n" not in error and "signed by a key this node does not trust" in error, error

        # A restore command put straight into the database: by id alone, no migration.
        engine = create_engine(f"sqlite:///{root / 'cp.db'}")
        with engine.begin() as conn:
            conn.execute(
                insert(commands).values(
                    id="cmd_injected",
                    cluster_id=hpc["cluster_id"],
                    node="node-b",
                    kind="restore",
                    args=json.dumps({"checkpoint": ckpt}),
                    state="queued",
                    attempts=0,
                    created="2026-01-01T00:00:00.000000+00:00",
                )
            )
        engine.dispose()
        injected = finished(cp, "cmd_injected")
        assert injected["state"] == "failed" and injected["result"]["error"] == (
            f"restore of checkpoint {ckpt} refused: this node restores for the control plane "
            "only the checkpoint a migration took (`stasis controlplane migrate`); a "
            "checkpoint by id is restored with `stasis restore` on the node"
        ), injected
        # Nothing restored: node-b runs no job it did not run before.
        assert sorted(j["job"] for j in b.json("ps")) == jobs_before
        assert not [j for j in b.json("ps") if j["state"] in ("running", "restored")]

        # A real migration, from node-a, still goes through once.
        job = a.run(*workload("counter.py"), label="mover", user=test_user.pw_name)["job"]
        wait_for(lambda: len(a.log_of(job).split()) >= 2, 30, "the counter to count")
        wait_for(lambda: job in [j["job"] for j in cp.json("jobs")], 30, "the job report")
        moved = cp.json("migrate", job, "--to", "node-b")
        assert (moved["from_node"], moved["node"]) == ("node-a", "node-b")
        running = [j for j in b.json("ps") if j["state"] in ("running", "restored")]
        assert [j["job"] for j in running] == [moved["job"]]

        # The migration's sealed restore half given again under a new command id (a
        # compromised control plane, a copied command), also after node-b's daemon restarted:
        # answered from what node-b keeps, never restored twice.
        engine = create_engine(f"sqlite:///{root / 'cp.db'}")
        with engine.begin() as conn:
            sealed = conn.execute(
                select(commands.c.args).where(
                    commands.c.kind == "restore", commands.c.state == "done"
                )
            ).scalar_one()
        jobs_before = sorted(j["job"] for j in b.json("ps"))
        for replay in ("cmd_replayed", "cmd_replayed_after_restart"):
            if replay.endswith("restart"):
                b.stop()
                b.start()
                jobs_before = sorted(j["job"] for j in b.json("ps"))
            with engine.begin() as conn:
                conn.execute(
                    insert(commands).values(
                        id=replay,
                        cluster_id=hpc["cluster_id"],
                        node="node-b",
                        kind="restore",
                        args=sealed,
                        state="queued",
                        attempts=0,
                        created="2026-01-01T00:00:00.000000+00:00",
                    )
                )
            again = finished(cp, replay)
            error = again["result"].get("error", "")
            assert again["state"] == "failed" and error.startswith(
                f"restore of checkpoint {json.loads(sealed)['checkpoint']} for migration "
                f"{moved['commands'][0]} refused: a migration restores once, and this node "
                f"already restored it as job {moved['job']} on "
            ), again
            assert error.endswith(": migrate the job again to move it") and "\n" not in error
            assert sorted(j["job"] for j in b.json("ps")) == jobs_before
        engine.dispose()
        # Kept in the daemon's own database: root's alone.
        db = b.state_dir / "jobs.db"
        assert stat.S_IMODE(db.stat().st_mode) == 0o600 and db.stat().st_uid == 0
    finally:
        for d in started:
            d.kill_all()
            d.stop()
        cp.stop()


def test_the_record_of_restored_migrations_is_bounded_and_forgets_safely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beyond its bound the rows of the oldest checkpoints go; a seal of a checkpoint as old as
    those (which may have been restored) is refused unseen, a newer one still goes through,
    and a replay of one kept is refused naming its job."""
    from types import SimpleNamespace

    from stasis.controlplane import node
    from stasis.daemon.db import JobDB
    from stasis.errors import PermissionDeniedError

    monkeypatch.setattr(node, "_RESTORED_MAX", 3)
    db = JobDB(tmp_path / "jobs.db")
    try:
        db.create_tables([node.restored_table])
        from stasis.daemon.records import Records, file_name

        kept_as_files = tmp_path / "records"
        me: Any = SimpleNamespace(
            manager=SimpleNamespace(db=db), _records=Records(db, kept_as_files)
        )
        for i in range(5):
            node.ControlPlaneNode._claim_restore(me, f"cmd_{i}", f"ckpt-{i}", 1000.0 + i)
            node.ControlPlaneNode._restored(me, f"cmd_{i}", f"job-{i}")
        with db.transaction() as conn:
            kept = {r.migration for r in conn.execute(select(node.restored_table))}
        assert kept == {"cmd_2", "cmd_3", "cmd_4", node._WATERMARK}
        # Its files (for a rebuild of a corrupt database: stasis/daemon/records.py) follow.
        assert {p.name for p in (kept_as_files / "controlplane_restored").iterdir()} == {
            file_name(k) for k in kept
        }
        with pytest.raises(PermissionDeniedError, match="already restored it as job job-4"):
            node.ControlPlaneNode._claim_restore(me, "cmd_4", "ckpt-4", 1004.0)
        # cmd_0 was forgotten: its seal comes again, refused as older than what is remembered.
        with pytest.raises(PermissionDeniedError, match="older than what this node remembers"):
            node.ControlPlaneNode._claim_restore(me, "cmd_0", "ckpt-0", 1000.0)
        node.ControlPlaneNode._claim_restore(me, "cmd_5", "ckpt-5", 1005.0)
    finally:
        db.engine.dispose()  # its SQLite connections closed, not left to the collector
