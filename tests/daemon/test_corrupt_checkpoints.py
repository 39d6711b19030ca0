"""Checkpoints whose manifest is garbage or untrusted: root can delete them, nobody else can, and
the daemon frees the garbage ones by itself after `remove_corrupt_after_s`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tests.conftest import TEST_USER, Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error
from tests.daemon.test_restore_state import last_number


def _manifest(d: Daemon, checkpoint: str) -> Path:
    return Path(d.store) / checkpoint / "manifest.json"


def _dumps(d: Daemon, count: int, user: str | None = None) -> list[str]:
    job = d.json("run", "--", *workload("counter.py"), user=user)
    wait_for(lambda: last_number(d, job["job"]) >= 1, what="counting")
    ids = [
        d.json("dump", job["job"], "--leave-running", user=user)["checkpoint"] for _ in range(count)
    ]
    d.cli("kill", job["job"], user=user)
    return ids


def _tamper(d: Daemon, checkpoint: str) -> None:
    path = _manifest(d, checkpoint)
    document = json.loads(path.read_text())
    document["uid"] = 0 if document["uid"] else 1  # root's, or from root's to someone's
    path.write_text(json.dumps(document))


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_only_root_deletes_a_checkpoint_nobody_can_tell_the_owner_of(daemon: Daemon) -> None:
    garbage, untrusted = _dumps(daemon, 2, TEST_USER)
    _manifest(daemon, garbage).write_bytes(b"{not json")
    _tamper(daemon, untrusted)
    for checkpoint in (garbage, untrusted):
        # The user is told why, and is not sent to a command that cannot work for them.
        err = one_line_error(
            daemon.cli("checkpoints", "rm", checkpoint, user=TEST_USER, check=False),
            2,
            "permission denied",
            "only root",
        )
        assert "stasis checkpoints rm" not in err
        assert _manifest(daemon, checkpoint).exists()
    err = one_line_error(
        daemon.cli("restore", garbage, user=TEST_USER, check=False),
        1,
        "manifest.json is unreadable",
        "nobody can tell whose it is",
        "root can delete it",
    )
    for checkpoint in (garbage, untrusted):
        daemon.cli("checkpoints", "rm", checkpoint)
        assert not (Path(daemon.store) / checkpoint).exists()
    one_line_error(daemon.cli("checkpoints", "rm", garbage, check=False), 2, "no checkpoint")


def test_the_daemon_frees_old_garbage_and_leaves_the_rest(make_daemon: MakeDaemon) -> None:
    d: Daemon = make_daemon(env={"STASIS_REMOVE_CORRUPT_AFTER_S": "3600"})
    good, old_garbage, new_garbage, old_untrusted, old_future = _dumps(d, 5)
    d.stop()
    _manifest(d, old_garbage).write_bytes(b"\x00garbage")
    _age(_manifest(d, old_garbage), 7200)
    _manifest(d, new_garbage).write_bytes(b"\x00garbage")
    _tamper(d, old_untrusted)  # maybe another site's: root decides, not the daemon
    _age(_manifest(d, old_untrusted), 7200)
    _manifest(d, old_future).write_text('{"format": 99}')  # a newer stasis sharing the store
    _age(_manifest(d, old_future), 7200)
    _age(_manifest(d, good), 7200)

    d.start()  # the daemon looks at its start (and then hourly)
    wait_for(lambda: not (Path(d.store) / old_garbage).exists(), what="the garbage removed")
    d.stop()  # waits for the sweep to finish
    for kept in (good, new_garbage, old_untrusted, old_future):
        assert (Path(d.store) / kept).exists(), kept
    log = (d.root / "daemon.log").read_text()
    assert f"removed checkpoint {old_garbage}" in log and "unreadable" in log
    d.start()
    assert [c["id"] for c in d.json("checkpoints")] == [good]
