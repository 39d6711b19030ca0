"""Signed manifests: whoever can write the store cannot make a node trust what it did not sign."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest

from stasis.config import load_settings
from stasis.errors import UntrustedCheckpointError, UsageError
from stasis.store import Keyring, Manifest, Store, node_keyring
from stasis.store.signing import KEY_BYTES, load_keyring

from .helpers import SMALL_FILES, make_info, stage


def _publish(store: Store, label: str = "train") -> Manifest:
    info = make_info(label)
    stage(store, info, SMALL_FILES)
    return store.publish(info)


def _path(store: Store, checkpoint_id: str) -> str:
    return f"{fsspec.core.url_to_fs(store.url)[1]}/{checkpoint_id}/manifest.json"


def _edit(store: Store, checkpoint_id: str, change: Callable[[dict[str, Any]], None]) -> None:
    fs, _ = fsspec.core.url_to_fs(store.url)
    document = json.loads(fs.cat_file(_path(store, checkpoint_id)))
    change(document)
    fs.pipe_file(_path(store, checkpoint_id), json.dumps(document, indent=2).encode())


def test_published_manifests_are_signed_with_the_stores_key(store: Store) -> None:
    manifest = _publish(store)
    assert manifest.signature is not None and manifest.signature.key_id == store.keys.key_id
    fs, _ = fsspec.core.url_to_fs(store.url)
    on_disk = json.loads(fs.cat_file(_path(store, manifest.id)))
    assert on_disk["signature"] == manifest.signature.model_dump()
    assert store.get(manifest.id) == manifest


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.__setitem__(key, value)


def _checksum(d: dict[str, Any]) -> None:
    d["files"][0]["xxh3_128"] = "0" * 32


@pytest.mark.parametrize(
    "change",
    [
        _set("uid", 0),
        _set("user", "root"),
        _set("label", "other"),
        _set("command", ["sh"]),
        _set("extra", {"slurm": {}}),
        _set("unknown_field", 1),
        _checksum,
    ],
    ids=["uid", "user", "label", "command", "extra", "new-field", "checksum"],
)
def test_a_tampered_manifest_is_refused(
    store: Store, change: Callable[[dict[str, Any]], None]
) -> None:
    good = _publish(store, "other")
    manifest = _publish(store)
    _edit(store, manifest.id, change)
    assert [m.id for m in store.list()] == [good.id]
    assert store.list("other", uid=1000) == [good]
    with pytest.raises(
        UntrustedCheckpointError,
        match=f"checkpoint {manifest.id} is not trusted.*changed after it was "
        f"signed.*stasis checkpoints rm {manifest.id}",
    ):
        store.get(manifest.id)
    with pytest.raises(UntrustedCheckpointError):
        with store.open_images(manifest.id, Path("/nonexistent")):
            pass


def test_reindenting_a_manifest_changes_nothing(store: Store) -> None:
    manifest = _publish(store)
    _edit(store, manifest.id, lambda d: None)  # rewritten with other whitespace and key order
    assert store.get(manifest.id) == manifest


def test_an_unsigned_manifest_is_refused(store: Store) -> None:
    manifest = _publish(store)
    _edit(store, manifest.id, lambda d: d.pop("signature"))
    assert store.list() == []
    with pytest.raises(UntrustedCheckpointError, match="is not signed"):
        store.get(manifest.id)


def test_a_signature_copied_from_another_manifest_does_not_verify(store: Store) -> None:
    mine = _publish(store)
    other = _publish(store)
    assert other.signature is not None
    _edit(store, mine.id, _set("signature", other.signature.model_dump()))
    with pytest.raises(UntrustedCheckpointError, match="does not match its signature"):
        store.get(mine.id)


def test_another_nodes_checkpoint_is_refused_until_its_key_is_trusted(tmp_path: Path) -> None:
    node_a, node_b = Keyring.ephemeral(), Keyring.ephemeral()
    url = str(tmp_path / "store")
    a = Store(url, staging_root=tmp_path / "a", keys=node_a)
    theirs = _publish(a)
    b = Store(url, staging_root=tmp_path / "b", keys=node_b)
    assert b.list() == []
    with pytest.raises(
        UntrustedCheckpointError,
        match=f"signed by key {node_a.key_id}, which this node does not trust.*" "trusted_keys",
    ):
        b.get(theirs.id)
    # The MAC's key is not in the error, the log or the manifest: only its id.
    assert node_a._signing_key.hex() not in json.dumps(theirs.model_dump(mode="json"))
    trusting = Store(
        url, staging_root=tmp_path / "b", keys=Keyring(node_b._signing_key, [node_a._signing_key])
    )
    assert trusting.get(theirs.id) == theirs
    # B's own checkpoints are still B's: A does not trust them.
    mine = _publish(trusting)
    assert mine.signature is not None and mine.signature.key_id == node_b.key_id
    assert [m.id for m in a.list()] == [theirs.id]


def test_listing_warns_once_per_untrusted_checkpoint(
    local_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    manifest = _publish(local_store)
    _edit(local_store, manifest.id, _set("uid", 0))
    with caplog.at_level(logging.WARNING, logger="stasis.store.store"):
        for _ in range(3):
            assert local_store.list() == []
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and manifest.id in warnings[0] and "signature" in warnings[0]


def test_a_store_without_keys_trusts_this_process_alone(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    manifest = _publish(Store(url, staging_root=tmp_path))
    assert Store(url, staging_root=tmp_path).get(manifest.id) == manifest
    with pytest.raises(UntrustedCheckpointError):
        Store(url, staging_root=tmp_path, keys=Keyring.ephemeral()).get(manifest.id)


# -- key files -------------------------------------------------------------------------------


def _key(path: Path, data: bytes | None = None, mode: int = 0o600) -> Path:
    path.write_bytes(os.urandom(KEY_BYTES) if data is None else data)
    path.chmod(mode)
    return path


def test_the_node_key_is_made_once_root_only(tmp_path: Path) -> None:
    keys_dir = tmp_path / "state" / "keys"
    first = load_keyring(keys_dir, "", (), create=True)
    key = keys_dir / "node.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.stat().st_size == KEY_BYTES
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    assert [p.name for p in keys_dir.iterdir()] == ["node.key"]
    again = load_keyring(keys_dir, "", (), create=True)
    assert again.key_id == first.key_id
    assert key.read_bytes().hex() not in repr(again) and first.key_id in repr(again)
    with pytest.raises(UsageError, match="does not exist"):
        load_keyring(tmp_path / "elsewhere", "", (), create=False)


def test_site_key_signs_and_every_trusted_key_verifies(tmp_path: Path) -> None:
    site = _key(tmp_path / "site.key")
    peers = tmp_path / "trusted.d"
    peers.mkdir()
    peer_one, peer_two = _key(peers / "node1.key"), _key(peers / "node2.key")
    single = _key(tmp_path / "node3.key")
    (peers / ".node1.key.swp").write_bytes(b"x")  # editors' leftovers are not keys
    settings = load_settings(
        {
            "STASIS_STATE_DIR": str(tmp_path / "state"),
            "STASIS_SITE_KEY": str(site),
            "STASIS_TRUSTED_KEYS": f"{peers}:{single}",
            "STASIS_CONFIG": "",
        }
    )
    keys = node_keyring(settings, create=True)
    node = (tmp_path / "state" / "keys" / "node.key").read_bytes()
    assert keys.key_id == Keyring(site.read_bytes()).key_id
    assert keys.trusted_ids == {
        Keyring(k).key_id
        for k in (
            node,
            site.read_bytes(),
            peer_one.read_bytes(),
            peer_two.read_bytes(),
            single.read_bytes(),
        )
    }


def test_trusted_keys_from_the_config_file_as_a_list(tmp_path: Path) -> None:
    conf = tmp_path / "config.toml"
    conf.write_text('trusted_keys = ["/etc/stasis/a.key", "/etc/stasis/b.key"]\n')
    settings = load_settings({"STASIS_CONFIG": str(conf)})
    assert settings.trusted_keys == ("/etc/stasis/a.key", "/etc/stasis/b.key")
    assert load_settings({"STASIS_CONFIG": ""}).trusted_keys == ()


@pytest.mark.parametrize(
    ("data", "mode", "words"),
    [(None, 0o644, "chmod 600"), (None, 0o620, "chmod 600"), (b"short", 0o600, "holds 5 bytes")],
    ids=["world-readable", "group-writable", "short"],
)
def test_a_key_file_others_could_read_or_that_is_no_key_is_refused(
    tmp_path: Path, data: bytes | None, mode: int, words: str
) -> None:
    bad = _key(tmp_path / "bad.key", data, mode)
    with pytest.raises(UsageError, match=words):
        load_keyring(tmp_path / "keys", str(bad), (), create=True)
    with pytest.raises(UsageError, match=words):
        load_keyring(tmp_path / "keys", "", (str(bad),), create=True)
    with pytest.raises(UsageError, match="does not exist"):
        load_keyring(tmp_path / "keys", "", (str(tmp_path / "missing.key"),), create=True)
