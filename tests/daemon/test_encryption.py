"""Encrypted dumps through a real daemon and CRIU: the counter goes on after a restore, a dump
that cannot be encrypted leaves the job running, a restore without the key restores nothing,
and a key rotation (`checkpoints rekey`) keeps old checkpoints restorable."""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path

from stasis import wire
from stasis.store.crypt import encryption_key_id
from tests.conftest import Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_restore_state import last_number, numbers
from tests.test_client import is_wire


def _key(path: Path, secret: bytes) -> bytes:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return secret


def _error_line(result: object) -> str:
    stderr: str = getattr(result, "stderr")
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_encrypted_dump_restore_and_rotation(
    make_daemon: MakeDaemon, world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    keys = world_tmp / f"keys-{os.urandom(3).hex()}"
    keys.mkdir(mode=0o700)
    first = _key(keys / "current.key", os.urandom(32))
    unrelated = _key(keys / "old.key", os.urandom(32))
    d: Daemon = make_daemon(
        env={
            "STASIS_ENCRYPTION_KEY_FILE": str(keys / "current.key"),
            "STASIS_OLD_ENCRYPTION_KEY_FILES": str(keys / "old.key"),
        }
    )
    job = d.run(*workload("counter.py"), label="secret")
    wait_for(lambda: last_number(d, job["job"]) >= 3, what="counting")
    cp = d.json("dump", "--encrypt", job["job"])
    before = numbers(d.log_of(job["job"]))
    checkpoint = Path(d.store) / cp["checkpoint"]
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["encryption"]["key_id"] == encryption_key_id(first)
    assert all(f["stored_name"].endswith(".enc") for f in manifest["files"])
    assert os.listdir(Path(d.store) / ".staging") == []  # no plain images left behind

    # Another key now, and the one it was sealed with nowhere: one line, nothing restored.
    _key(keys / "current.key", os.urandom(32))
    jobs_before = len(d.json("ps"))
    refused = d.cli("restore", cp["checkpoint"], check=False)
    assert refused.returncode == 1
    assert f"encrypted with key {encryption_key_id(first)}" in _error_line(refused)
    assert first.hex() not in refused.stderr
    assert len(d.json("ps")) == jobs_before
    scratch = d.state_dir / "scratch"
    assert not scratch.exists() or os.listdir(scratch) == []

    # Rotation: the old key among the old ones, then rekey (root only) re-wraps its data key.
    _key(keys / "old.key", first)
    denied = d.cli("checkpoints", "rekey", user=test_user.pw_name, check=False)
    assert denied.returncode == 2 and "only root" in _error_line(denied)
    images = {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.name != "manifest.json"}
    done = d.json("checkpoints", "rekey")
    assert done == {"rekeyed": [cp["checkpoint"]], "current": 0, "unknown_key": 0}
    assert is_wire(done, wire.RekeyAnswer)
    assert images == {
        p.name: p.read_bytes() for p in checkpoint.iterdir() if p.name != "manifest.json"
    }
    _key(keys / "old.key", unrelated)  # the first key gone for good

    restored = d.json("restore", cp["checkpoint"])
    wait_for(lambda: len(numbers(d.log_of(restored["job"]))) > len(before) + 2, what="counting on")
    # It goes on from where it was, not from the start.
    assert numbers(d.log_of(restored["job"]))[len(before)] == before[-1] + 1
    d.cli("kill", restored["job"])
    # And lazily: the daemon decrypts each chunk as lazy-pages asks for it.
    lazy = d.json("restore", "--lazy", cp["checkpoint"])
    assert lazy["lazy"] is True and lazy["notes"] == []
    # The same log: this second restore goes on from the same number once more, never from 0.
    wait_for(
        lambda: numbers(d.log_of(lazy["job"])).count(before[-1] + 2) == 2,
        what="counting on, lazily",
    )
    values = numbers(d.log_of(lazy["job"]))
    assert values.count(before[-1] + 1) == 2 and values.count(0) == 1
    d.cli("kill", lazy["job"])


def test_no_key_means_no_dump_and_the_job_runs_on(daemon: Daemon) -> None:
    job = daemon.run(*workload("counter.py"), label="nokey")
    wait_for(lambda: last_number(daemon, job["job"]) >= 2, what="counting")
    refused = daemon.cli("dump", "--encrypt", job["job"], check=False)
    assert refused.returncode == 2
    assert "set encryption_key_file" in _error_line(refused)
    assert daemon.job(job["job"])["state"] == "running"
    now = last_number(daemon, job["job"])
    wait_for(lambda: last_number(daemon, job["job"]) >= now + 2, what="still counting")
    assert daemon.json("checkpoints", "--label", "nokey") == []
    daemon.cli("kill", job["job"])
