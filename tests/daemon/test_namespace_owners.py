"""A Kubernetes namespace's checkpoints (owner `k8s:NS`) through a real daemon: older stasis
stored them under an owner uid a local account could have (2**30 and up), so a local user whose
uid is that number must still neither list, restore, check nor delete them; root may."""

from __future__ import annotations

from typing import Any

from tests.conftest import TEST_USER, Daemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error
from tests.daemon.test_restore_facts import _manifest, _resign
from tests.daemon.test_restore_state import last_number


def test_a_namespace_s_checkpoint_under_a_local_users_uid_is_roots_alone(daemon: Daemon) -> None:
    job = daemon.json("run", "--label", "ns-legacy", "--", *workload("counter.py"), user=TEST_USER)
    wait_for(lambda: last_number(daemon, job["job"]) >= 3, what="counting")
    ckpt = daemon.json("dump", job["job"], user=TEST_USER)["checkpoint"]
    # What an older stasis published for namespace "team" whose owner uid was this user's.
    document: dict[str, Any] = _manifest(daemon, ckpt)
    document["user"] = "k8s:team"
    _resign(daemon, ckpt, document)

    assert [c for c in daemon.json("checkpoints", user=TEST_USER) if c["id"] == ckpt] == []
    assert daemon.json("checkpoints", "--label", "ns-legacy", user=TEST_USER) == []
    one_line_error(
        daemon.cli("restore", "--label", "ns-legacy", user=TEST_USER, check=False),
        2,
        "no checkpoint with label ns-legacy",
    )
    for args in (("restore", ckpt), ("check", "--checkpoint", ckpt), ("checkpoints", "rm", ckpt)):
        one_line_error(
            daemon.cli(*args, user=TEST_USER, check=False),
            2,
            f"checkpoint {ckpt} belongs to another user",
        )
    jobs = [j for j in daemon.json("ps") if j["state"] == "running"]
    assert jobs == []  # nothing restored
    # Still there, and root's to handle.
    assert [c["id"] for c in daemon.json("checkpoints") if c["label"] == "ns-legacy"] == [ckpt]
    daemon.cli("checkpoints", "rm", ckpt)
    assert [c for c in daemon.json("checkpoints") if c["id"] == ckpt] == []
