"""Checkpoints nobody can use: which ones the store frees by itself, and which it leaves to root."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime

import fsspec
import pytest

from stasis.errors import UnreadableManifestError
from stasis.store import Keyring, Manifest, Store

from .helpers import SMALL_FILES, make_info, stage

DAY_S = 86400


def _publish(store: Store) -> Manifest:
    info = make_info()
    stage(store, info, SMALL_FILES)
    return store.publish(info)


def _manifest(store: Store, checkpoint_id: str) -> str:
    return f"{fsspec.core.url_to_fs(store.url)[1]}/{checkpoint_id}/manifest.json"


def _write(store: Store, checkpoint_id: str, data: bytes, age_s: float) -> None:
    fs, _ = fsspec.core.url_to_fs(store.url)
    path = _manifest(store, checkpoint_id)
    fs.pipe_file(path, data)
    then = time.time() - age_s
    if "://" in store.url:  # fsspec's memory filesystem keeps the time on its file object
        fs.store[path].modified = datetime.fromtimestamp(then, UTC)
    else:
        os.utime(path, (then, then))


def _exists(store: Store, checkpoint_id: str) -> bool:
    fs, root = fsspec.core.url_to_fs(store.url)
    return bool(fs.exists(f"{root}/{checkpoint_id}"))


def test_old_garbage_goes_and_everything_else_stays(store: Store) -> None:
    good = _publish(store)
    old_garbage, new_garbage, future, untrusted, unsigned = (_publish(store) for _ in range(5))
    _write(store, old_garbage.id, b"{not json", 2 * DAY_S)
    _write(store, new_garbage.id, b"{not json", 60)
    _write(store, future.id, b'{"format": 99, "id": "whatever"}', 2 * DAY_S)
    other_node = Store(store.url, staging_root=store._tree.staging_area(), keys=Keyring.ephemeral())
    theirs = _publish(other_node)
    document = json.loads(untrusted.model_dump_json())
    document["uid"] = 0
    _write(store, untrusted.id, json.dumps(document).encode(), 2 * DAY_S)
    document = json.loads(unsigned.model_dump_json())
    del document["signature"]
    _write(store, unsigned.id, json.dumps(document).encode(), 2 * DAY_S)

    assert store.remove_unreadable(DAY_S) == [old_garbage.id]
    assert not _exists(store, old_garbage.id)
    for kept in (good, new_garbage, future, untrusted, unsigned, theirs):
        assert _exists(store, kept.id), kept.id
    assert store.remove_unreadable(DAY_S) == []
    assert [m.id for m in store.list()] == [good.id]
    assert store.remove_unreadable(0) == [new_garbage.id]


def test_the_error_of_garbage_does_not_send_its_owner_to_rm(store: Store) -> None:
    manifest = _publish(store)
    _write(store, manifest.id, b"[]", 0)
    with pytest.raises(
        UnreadableManifestError,
        match="nobody can tell whose it is: root can delete it with "
        f"`stasis checkpoints rm {manifest.id}`",
    ):
        store.get(manifest.id)
