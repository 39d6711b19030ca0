"""Helpers for store tests: playing CRIU into a staging directory, building CheckpointInfo."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from stasis.store import CheckpointInfo, Manifest, Store, new_checkpoint_id
from stasis.store.store import MANIFEST_PURPOSE

BASE_TIME = datetime(2026, 11, 30, 0, 15, 12, tzinfo=UTC)


def make_info(label: str = "train", *, minutes: int = 0, **fields: object) -> CheckpointInfo:
    """Facts about a dump taken `minutes` after BASE_TIME."""
    created = BASE_TIME + timedelta(minutes=minutes)
    values: dict[str, object] = {
        "id": new_checkpoint_id(created),
        "label": label,
        "job": "job-1",
        "host": "node01",
        "created": created,
        "criu_version": "4.0",
        "command": ["python", "train.py", "--epochs", "3"],
        "cwd": "/home/alice/run",
        "env": {"OMP_NUM_THREADS": "4"},
        "user": "alice",
        "uid": 1000,
        "gid": 1000,
    }
    values.update(fields)
    return CheckpointInfo.model_validate(values)


def stage(store: Store, info: CheckpointInfo, files: dict[str, bytes]) -> Path:
    """Play CRIU: write `files` into the staging directory of `info.id`."""
    staging = store.staging_dir(info.id)
    for name, data in files.items():
        (staging / name).write_bytes(data)
    return staging


SMALL_FILES = {"core-1.img": b"core" * 100, "mm-1.img": b"mm" * 1000, "empty.img": b""}


def signed(store: Store, manifest: Manifest) -> bytes:
    """manifest.json for `manifest`, signed with `store`'s key as a publish would: for tests that
    need a manifest that lies and is still trusted (the signer's own bug, not an attacker)."""
    body = json.loads(manifest.model_dump_json(exclude={"signature"}))
    sealed = manifest.model_copy(update={"signature": store.keys.sign(MANIFEST_PURPOSE, body)})
    return sealed.model_dump_json().encode()
