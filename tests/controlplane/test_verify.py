"""The control plane's side of `stasis verify`: a `verify` policy picks each label's newest
checkpoint not verified yet and sends it, at low priority, to the node that took it; the
verdict that node answers is kept with the checkpoint and shown by the API, the CLI and the
dashboard (ok / failed: REASON / not verified). A node speaks only for its own cluster's
checkpoints. Here the nodes are FakeNodes over plain HTTP (what a node may send, hostile too);
test_verify_node has a real daemon verify a real checkpoint."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.conftest import wait_for
from tests.controlplane.conftest import ControlPlane
from tests.controlplane.fakenode import FakeNode
from tests.controlplane.test_commands import scrape
from tests.controlplane.test_dashboard import Browserless


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def verdict(checkpoint: str, ok: bool, at: float, reason: str = "") -> dict[str, Any]:
    return {
        "checkpoint": checkpoint,
        "ok": ok,
        "reason": reason,
        "node": "host",
        "at": _iso(at),
        "duration_s": 0.5,
        "processes": 2 if ok else 0,
    }


def checkpoints(cp: ControlPlane, token: str | None = None) -> dict[str, dict[str, Any]]:
    status, listed = cp.call("GET", "/api/v1/checkpoints", token or cp.admin)
    assert status == 200, listed
    return {c["id"]: c for c in listed}


def verify_commands(cp: ControlPlane) -> list[dict[str, Any]]:
    return [c for c in cp.json("actions") if c["kind"] == "verify"]


def test_a_verify_policy_queues_the_newest_unverified_and_keeps_the_verdicts(
    controlplane: ControlPlane,
) -> None:
    cp = controlplane
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    other = cp.json("clusters", "add", "other", "--kind", "slurm")
    fa, fb = FakeNode(cp, hpc, "fa"), FakeNode(cp, other, "fb")
    for n in (fa, fb):
        n.register()
    now = time.time()
    fa.took("c1", "train-a", now - 30)
    fa.took("c2", "train-a", now - 20)  # train-a's newest: the one verified
    fa.took("c3", "scratch", now - 10)  # not picked by the filter
    fb.took("cb1", "train-a", now - 5)  # the other cluster's own

    # Validation: one line each, nothing added.
    for args, said in (
        (
            ("--on", "memory", "--above", "50"),
            "a memory trigger takes the checkpoint or migrate action",
        ),
        (
            ("--on", "webhook", "--stop"),
            "verify stops no job (it restores a checkpoint in a sandbox): leave out stop",
        ),
        (
            ("--on", "webhook", "--min-size", "1M"),
            "filter 'min_rss_bytes' picks jobs; verify picks checkpoints by cluster, node, "
            "label, user",
        ),
    ):
        r = cp.cli("policies", "add", "v", "--action", "verify", *args)
        assert (r.returncode, r.stderr.strip()) == (2, f"stasis: error: {said}"), r.stderr
    assert cp.json("policies", "list") == []

    cp.json("policies", "add", "v", "--on", "webhook", "--action", "verify", "--label", "train-*")
    assert cp.json("policies", "run", "v") == {"name": "v", "queued": 2}
    queued = {c["node"]: c for c in verify_commands(cp)}
    assert {n: c["args"]["checkpoint"] for n, c in queued.items()} == {"fa": "c2", "fb": "cb1"}
    assert queued["fa"]["args"]["policy"] == "v"
    assert cp.json("policies", "run", "v")["queued"] == 0  # under way: not queued twice

    # Low priority: a checkpoint asked after the verify is leased before it.
    fa.heartbeat([{"job": "j1"}])
    status, asked = cp.call(
        "POST", "/api/v1/commands", cp.admin, {"kind": "checkpoint", "job": "j1"}
    )
    assert status == 201, asked
    first = fa.lease()
    assert first is not None and first["id"] == asked["id"]
    fa.ack(first["id"], True, {"checkpoint": "c9", "label": "j1", "size_bytes": 1})
    got = fa.lease()
    assert got is not None and got["kind"] == "verify" and got["args"]["checkpoint"] == "c2"

    # A node speaks for its own cluster's checkpoints only: fb's verdicts on hpc's c1 (in a
    # heartbeat) and on c2 (answering its own command for cb1) change nothing.
    fb.beat(verdicts=[verdict("c1", True, now)])
    theirs = fb.lease()
    assert theirs is not None and theirs["args"]["checkpoint"] == "cb1"
    status, answer = cp.call(
        "POST",
        f"/api/v1/commands/{theirs['id']}/ack",
        fb.token,
        {
            "lease_id": fb.leases[theirs["id"]],
            "ok": True,
            "result": {"verdict": verdict("c2", True, now)},
        },
    )
    assert (status, answer) == (
        400,
        {
            "error": f"command {theirs['id']} asked to verify "
            "checkpoint cb1, not c2: answer with its "
            "verdict"
        },
    )
    seen = checkpoints(cp)
    assert (seen["c1"]["verdict"], seen["c2"]["verdict"]) == (None, None)
    assert seen["c1"]["verified"] == "not verified"
    refused = [e["message"] for e in cp.json("events") if e["kind"] == "verify-refused"]
    assert refused == [
        f"node fb of cluster {other['cluster_id']} reported a verdict on "
        f"checkpoint c1, which is cluster {hpc['cluster_id']}'s: ignored"
    ]
    # ... and is told nothing of it (not in its cluster's view).
    status, events = cp.call("GET", "/api/v1/events", other["token"])
    assert status == 200 and all("c1" not in e["message"] for e in events)

    # fa's verdict on c2 is kept: in the API, the CLI and the dashboard.
    fa.ack(got["id"], True, {"verdict": verdict("c2", True, now)})
    c2 = checkpoints(cp)["c2"]
    assert c2["verified"] == "ok" and c2["verdict"]["node"] == "fa"
    assert (c2["verdict"]["ok"], c2["verdict"]["processes"]) == (True, 2)
    assert checkpoints(cp, hpc["token"])["c2"]["verified"] == "ok"  # the cluster's view
    assert "cb1" not in checkpoints(cp, hpc["token"])
    lines = cp.cli("checkpoints").stdout.splitlines()
    assert lines[0].split("\t")[-1] == "verified"
    assert {ln.split("\t")[2]: ln.split("\t")[-1] for ln in lines[1:]}["c2"] == "ok"
    # train-a's newest restores: nothing more to verify there (cb1's is still under way).
    assert cp.json("policies", "run", "v")["queued"] == 0

    # A newer checkpoint that fails: its reason kept and shown (escaped), the command failed.
    fa.took("c4", "train-a", time.time())
    assert cp.json("policies", "run", "v")["queued"] == 1
    got = fa.lease()
    assert got is not None and got["args"]["checkpoint"] == "c4"
    why = "process 7 did not come back: <b>CRIU</b> said 'No such file' on tmp/x"
    fa.ack(
        got["id"],
        False,
        {
            "verdict": verdict("c4", False, now + 1, why),
            "error": f"checkpoint c4 does not restore: {why}",
        },
    )
    c4 = checkpoints(cp)["c4"]
    assert (c4["verified"], c4["verdict"]["ok"]) == (f"failed: {why}", False)
    assert cp.json("actions")[-1]["state"] == "failed"
    # An older verdict reported late (a heartbeat from before) does not override it; the same
    # one reported again counts once.
    fa.beat(verdicts=[verdict("c4", True, now), verdict("c4", False, now + 1, why)])
    assert checkpoints(cp)["c4"]["verified"] == f"failed: {why}"
    failed = [e["message"] for e in cp.json("events") if e["kind"] == "verify-failed"]
    assert failed == [f"checkpoint c4 failed verification on node fa: {why}"]
    # c4 failed, c2 restores: train-a needs nothing more.
    assert cp.json("policies", "run", "v")["queued"] == 0
    # The job's newest checkpoint is c4, which failed; the metrics count each verdict.
    fa.heartbeat([{"job": "job-train-a", "label": "train-a"}])
    (job,) = cp.json("jobs")
    assert (job["last_checkpoint"], job["last_checkpoint_verified"]) == ("c4", f"failed: {why}")
    metrics = scrape(cp, cp.admin)
    for verdict_, count in (("ok", 1), ("failed", 1), ("none", 2)):
        assert (
            f'stasis_checkpoints_verified{{cluster="hpc",verdict="{verdict_}"}} {count}\n'
            in metrics
        ), metrics

    web = Browserless(cp)
    web.login(cp.admin)
    status, _, page = web.call("GET", "/ui/checkpoints")
    assert status == 200
    row = page.split('data-checkpoint="c4"')[1].split("</tr>")[0]
    assert 'data-verified="failed"' in row
    assert (
        "failed: process 7 did not come back: &lt;b&gt;CRIU&lt;/b&gt; said &#39;No such "
        "file&#39; on tmp/x"
    ) in row and "<b>CRIU" not in page
    assert 'data-verified="ok"' in page.split('data-checkpoint="c2"')[1].split("</tr>")[0]
    assert "not verified" in page.split('data-checkpoint="c3"')[1].split("</tr>")[0]

    # Hostile bytes in a verdict: refused whole, nothing kept.
    status, answer = cp.call(
        "POST",
        "/api/v1/nodes/fa/heartbeat",
        fa.token,
        {"verdicts": [verdict("c3", True, now, "a\x00b")]},
    )
    assert status == 400 and answer["error"].startswith("bad request: verdicts.0.reason")
    assert checkpoints(cp)["c3"]["verdict"] is None


def test_verdicts_survive_a_schema_from_before_them(db_url: str, world_tmp: Path) -> None:
    """Revision 0011 on a database with checkpoints: they read as not verified, take a
    verdict, and the revision goes down and up again."""
    import tempfile

    from sqlalchemy import create_engine, inspect, text

    from tests.controlplane.test_migrations import _to

    url = db_url if "://" in db_url else f"sqlite:///{db_url}"
    _to(url, "0010")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO clusters (id, name, kind, created) VALUES ('cl_1', 'hpc', "
                    "'slurm', '2026-01-01T00:00:00+00:00')"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO checkpoints (id, cluster_id, node, job, label, \"user\", "
                    "size_bytes, stored_size_bytes, duration_s, frozen_s, work_s, leave_running, "
                    "reason, store, created) VALUES ('old1', 'cl_1', 'n1', 'j', 'l', 'u', 1, 1, "
                    "0.1, 0.1, 1, true, 'asked', '/s', 1000)"
                )
            )
    finally:
        engine.dispose()
    cp = ControlPlane(Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)), db_url)
    cp.start()
    try:
        (old,) = cp.json("checkpoints")
        assert (old["id"], old["verdict"], old["verified"]) == ("old1", None, "not verified")
    finally:
        cp.stop()

    def columns() -> set[str]:
        engine = create_engine(url)
        try:
            return {c["name"] for c in inspect(engine).get_columns("checkpoints")}
        finally:
            engine.dispose()

    assert {"verified_ok", "verify_reason", "verified_at"} <= columns()
    _to(url, "0010", down=True)
    assert "verified_ok" not in columns()
    _to(url, "head")
    assert "verified_ok" in columns()


def test_a_verify_queued_for_a_lost_node_is_failed_and_asked_again_when_it_is_back(
    controlplane: ControlPlane,
) -> None:
    cp = controlplane
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    fa = FakeNode(cp, hpc, "fa")
    fa.register()
    fa.took("c1", "train", time.time())
    cp.json("policies", "add", "v", "--on", "webhook", "--action", "verify")
    assert cp.json("policies", "run", "v")["queued"] == 1
    # Silent past --lost-after (3 s): the queued verify fails, naming why.
    wait_for(lambda: verify_commands(cp)[0]["state"] == "failed", 30, "the verify failed")
    error = verify_commands(cp)[0]["result"]["error"]
    assert re.fullmatch(r"node fa was lost \(silent \d+ s\) before carrying it out", error), error
    assert cp.json("policies", "run", "v")["queued"] == 0  # not ready: nothing for it
    # Asked for one checkpoint by hand: refused in one line while its node is lost, for an
    # unknown one, and for a cluster's token.
    r = cp.cli("verify", "c1")
    assert r.returncode == 2 and re.fullmatch(
        r"stasis: error: node fa is lost \(silent \d+ s\): the node that took checkpoint c1 "
        r"verifies it; ask again once it is ready",
        r.stderr.strip(),
    ), r.stderr
    r = cp.cli("verify", "nope")
    assert (r.returncode, r.stderr.strip()) == (
        2,
        "stasis: error: no checkpoint nope known "
        "here: `stasis controlplane checkpoints` "
        "lists them",
    )
    assert cp.call("POST", "/api/v1/checkpoints/c1/verify", hpc["token"])[0] == 403
    assert len(verify_commands(cp)) == 1
    fa.heartbeat([])
    assert cp.json("policies", "run", "v")["queued"] == 1  # back: asked again
    got = fa.lease()
    assert got is not None and got["args"]["checkpoint"] == "c1"
