"""A command that takes longer than the time after which a silent node is shown lost: the node
carries it out in a worker while its heartbeats go on, so it stays ready; the command's lease
is renewed while it runs, and it is carried out once. The length comes from a slow link to the
store (a real S3 server behind a proxy that carries the upload at a set rate)."""

from __future__ import annotations

import pwd
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.conftest import new_daemon, wait_for, workload
from tests.controlplane.conftest import ControlPlane
from tests.controlplane.slowlink import SlowLink
from tests.controlplane.test_node import node_env
from tests.s3server import S3Server

LOST_AFTER_S = 3
LEASE_S = 2


def test_a_long_dump_does_not_silence_its_node_and_runs_once(
    world_tmp: Path, s3: S3Server, s3_bucket: str, site_key: Path, test_user: pwd.struct_passwd
) -> None:
    root = Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp))
    cp = ControlPlane(root, str(root / "cp.db"))
    cp.start("--lost-after", str(LOST_AFTER_S), "--command-lease", str(LEASE_S))
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    # 24 MiB of random bytes (they do not compress) at 3 MiB/s: about 8 s of upload.
    link = SlowLink(("127.0.0.1", int(s3.endpoint.rsplit(":", 1)[1])), 3 << 20)
    d = new_daemon(
        world_tmp,
        "node-slow",
        store=f"s3://{s3_bucket}/site",
        env={
            **s3.env(AWS_ENDPOINT_URL=link.endpoint),
            **node_env(cp, cluster, "node-slow"),
            "STASIS_SITE_KEY": str(site_key),
        },
    )
    d.start()
    try:
        job = d.run(*workload("memhold.py", 24), label="slow")["job"]
        wait_for(lambda: "ready" in d.log_of(job), 30, "the job to fill its memory")
        wait_for(lambda: [j["job"] for j in cp.json("jobs")] == [job], 30, "the job report")
        status, cmd = cp.call(
            "POST", "/api/v1/commands", cp.admin, {"kind": "checkpoint", "job": job}
        )
        assert status == 201

        def command() -> dict[str, Any]:
            got: dict[str, Any] = cp.call("GET", f"/api/v1/commands/{cmd['id']}", cp.admin)[1]
            return got

        wait_for(lambda: command()["state"] != "queued", 30, "the node to lease the command")
        leased_at = time.monotonic()
        renewed = False
        worst_silence = 0.0
        while (now := command())["state"] == "leased":
            # Heartbeats go on while the dump runs: the node stays ready.
            (node,) = cp.call("GET", "/api/v1/nodes", cp.admin)[1]
            assert node["state"] == "ready", node
            worst_silence = max(worst_silence, node["last_heartbeat_age_s"])
            if time.monotonic() - leased_at > LEASE_S + 1 and now["lease_until"] >= time.time():
                renewed = True  # past its first lease and still leased: renewed
            assert time.monotonic() - leased_at < 120, "the dump never ended"
            time.sleep(0.3)
        took = time.monotonic() - leased_at
        done = command()
        assert done["state"] == "done", done
        assert took > LOST_AFTER_S + 1, f"the dump took {took:.1f} s: too short to show it"
        assert renewed, "the lease was not renewed while the node worked"
        assert worst_silence < LOST_AFTER_S, worst_silence
        assert done["attempts"] == 1  # never given out again
        (only,) = [c["id"] for c in d.json("checkpoints") if c["label"] == "slow"]
        assert done["result"]["checkpoint"] == only
        assert d.job(job)["state"] == "running"
        assert not [e for e in cp.json("events") if e["kind"] == "node-lost"]
        # The node takes its next command as before.
        status, again = cp.call(
            "POST", "/api/v1/commands", cp.admin, {"kind": "checkpoint", "job": job}
        )
        assert status == 201
        wait_for(
            lambda: cp.call("GET", f"/api/v1/commands/{again['id']}", cp.admin)[1]["state"]
            == "done",
            60,
            "the second checkpoint",
        )
    finally:
        d.kill_all()
        d.stop()
        link.close()
        cp.stop()
