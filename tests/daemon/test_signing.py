"""Signed manifests through real daemons: whoever can write the store (here root, editing files
as a node sharing the store could) cannot have a daemon restore what it did not sign; a second
daemon with its own key restores another node's checkpoint only once it trusts that key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import TEST_USER, Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error
from tests.daemon.test_restore_state import last_number, numbers


def _manifest(d: Daemon, checkpoint: str) -> Path:
    return Path(d.store) / checkpoint / "manifest.json"


def _edit(d: Daemon, checkpoint: str, **changes: Any) -> None:
    path = _manifest(d, checkpoint)
    document = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del document[key]
        else:
            document[key] = value
    path.write_text(json.dumps(document))


def _counter(d: Daemon, label: str, user: str | None = None) -> Any:
    job = d.json("run", "--label", label, "--", *workload("counter.py"), user=user)
    wait_for(lambda: last_number(d, job["job"]) >= 3, what="counting")
    return job


def _refused(
    d: Daemon, *args: str, code: int, words: tuple[str, ...], user: str | None = None
) -> None:
    jobs_before = d.json("ps")
    one_line_error(d.cli("restore", *args, user=user, check=False), code, *words)
    assert d.json("ps") == jobs_before  # nothing restored


def test_a_manifest_made_to_say_root_or_another_label_is_refused(daemon: Daemon) -> None:
    job = _counter(daemon, "signed-victim", TEST_USER)
    as_root = daemon.json("dump", job["job"], "--leave-running", user=TEST_USER)["checkpoint"]
    relabeled = daemon.json("dump", job["job"], "--leave-running", user=TEST_USER)["checkpoint"]
    daemon.cli("kill", job["job"], user=TEST_USER)
    # Someone who can write the store makes the first say it is root's process...
    _edit(daemon, as_root, uid=0, user="root", gid=0)
    _refused(
        daemon,
        as_root,
        code=1,
        words=(
            f"checkpoint {as_root} is not trusted",
            "changed after it was signed",
            f"stasis checkpoints rm {as_root}",
        ),
    )
    # ...and moves the second under another label of the user's, for them to restore.
    _edit(daemon, relabeled, label="stolen")
    _refused(
        daemon,
        "--label",
        "stolen",
        code=2,
        words=("no checkpoint with label stolen",),
        user=TEST_USER,
    )
    listed = [c["id"] for c in daemon.json("checkpoints")]
    assert as_root not in listed and relabeled not in listed
    assert daemon.json("checkpoints", "--label", "signed-victim", user=TEST_USER) == []
    log = (daemon.root / "daemon.log").read_text()
    assert f"skipping checkpoint {as_root}" in log and f"skipping checkpoint {relabeled}" in log


def test_an_unsigned_manifest_is_refused(daemon: Daemon) -> None:
    job = _counter(daemon, "unsigned")
    checkpoint = daemon.json("dump", job["job"])["checkpoint"]
    _edit(daemon, checkpoint, signature=None)
    _refused(daemon, checkpoint, code=1, words=(f"checkpoint {checkpoint}", "is not signed"))
    _refused(daemon, "--label", "unsigned", code=2, words=("no checkpoint with label",))


def _continues(d: Daemon, job: Any, restored: Any, at_dump: int) -> None:
    wait_for(lambda: last_number(d, restored["job"]) >= at_dump + 3, what="counting on")
    values = numbers(d.log_of(restored["job"]))
    assert values == list(range(len(values)))  # the same log, the same counter, no restart
    assert values[-1] >= at_dump + 3


def test_another_nodes_checkpoint_is_refused_until_its_key_is_trusted(
    make_daemon: MakeDaemon,
) -> None:
    node_a: Daemon = make_daemon()
    node_b: Daemon = make_daemon(store=node_a.store)  # its own state dir and key, one store
    job = _counter(node_a, "roaming")
    checkpoint = node_a.json("dump", job["job"])["checkpoint"]
    at_dump = last_number(node_a, job["job"])

    err = one_line_error(
        node_b.cli("restore", checkpoint, check=False),
        1,
        f"checkpoint {checkpoint} is not trusted",
        "trusted_keys",
    )
    key_id = node_a.json("checkpoints")[0]["signature"]["key_id"]
    assert f"signed by key {key_id}" in err
    assert node_b.json("ps") == []
    # By label, through the CLI: not "no checkpoint", but whose key and what trusts it.
    _refused(
        node_b,
        "--label",
        "roaming",
        code=1,
        words=(
            "no checkpoint with label roaming that this node trusts",
            f"signed by key {key_id}",
            "trusted_keys",
            "site_key",
        ),
    )
    # Another user's label of the same name says nothing of that user's checkpoints.
    _refused(
        node_b,
        "--label",
        "roaming",
        code=2,
        words=("no checkpoint with label roaming",),
        user=TEST_USER,
    )
    assert node_b.json("checkpoints") == []
    assert f"skipping checkpoint {checkpoint}" in (node_b.root / "daemon.log").read_text()

    node_b.stop()
    node_b.env["STASIS_TRUSTED_KEYS"] = str(node_a.state_dir / "keys" / "node.key")
    node_b.start()
    assert [c["id"] for c in node_b.json("checkpoints", "--label", "roaming")] == [checkpoint]
    restored = node_b.json("restore", "--label", "roaming")
    assert restored["checkpoint"] == checkpoint
    _continues(node_b, job, restored, at_dump)
    node_b.cli("kill", restored["job"])
    # The key itself is secret: root-only, and in no log.
    key = node_a.state_dir / "keys" / "node.key"
    assert key.stat().st_mode & 0o777 == 0o600 and key.stat().st_uid == 0
    for d in (node_a, node_b):
        assert key.read_bytes().hex() not in (d.root / "daemon.log").read_text()


def test_nodes_sharing_a_site_key_trust_each_other(make_daemon: MakeDaemon, site_key: Path) -> None:
    node_a: Daemon = make_daemon(env={"STASIS_SITE_KEY": str(site_key)})
    node_b: Daemon = make_daemon(store=node_a.store, env={"STASIS_SITE_KEY": str(site_key)})
    job = _counter(node_a, "site")
    checkpoint = node_a.json("dump", job["job"])["checkpoint"]
    at_dump = last_number(node_a, job["job"])
    restored = node_b.json("restore", checkpoint)
    _continues(node_b, job, restored, at_dump)
    node_b.cli("kill", restored["job"])
