"""Helpers for store tests: playing CRIU into a staging directory, building CheckpointInfo."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import blake3
import fsspec

from stasis.store import CheckpointInfo, Manifest, Store, new_checkpoint_id
from stasis.store.crypt import KeyFiles
from stasis.store.manifest import Compression
from stasis.store.store import MANIFEST_PURPOSE

BASE_TIME = datetime(2026, 11, 30, 0, 15, 12, tzinfo=UTC)


def blake3_digest(data: bytes, chunk_bytes: int = 1 << 20) -> str:
    """What a format 3 manifest says of a plain file holding `data`: BLAKE3 over its size, its
    chunk size and each chunk's BLAKE3 (computed here, not by the store)."""
    hashes = [
        blake3.blake3(data[i : i + chunk_bytes]).digest() for i in range(0, len(data), chunk_bytes)
    ]
    h = blake3.blake3(b"stasis file v1\0")
    h.update(
        len(data).to_bytes(8, "little")
        + chunk_bytes.to_bytes(8, "little")
        + len(hashes).to_bytes(8, "little")
        + b"".join(hashes)
    )
    return h.hexdigest()


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


def write_key(path: Path, key: bytes | None = None, mode: int = 0o600) -> Path:
    """An encryption key file (32 random bytes unless `key` says otherwise)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(key if key is not None else os.urandom(32))
    os.chmod(path, mode)
    return path


def with_keys(store: Store, current: Path | None, *old: Path) -> Store:
    """The same store (same URL, same signing keys) as a node with these key files sees it."""
    return Store(
        store.url,
        staging_root=store._tree.staging_area(),
        keep=store.keep,
        keys=store.keys,
        encryption=KeyFiles(str(current) if current else "", [str(p) for p in old]),
    )


def encrypted_store(store: Store, tmp_path: Path) -> Store:
    """`store` with an encryption key file of its own (tmp_path/current.key)."""
    key = tmp_path / "current.key"
    if not key.exists():
        write_key(key)
    return with_keys(store, key)


def stored_bytes(store: Store, manifest: Manifest, name: str) -> bytes:
    entry = next(f for f in manifest.files if f.name == name)
    fs, root = fsspec.core.url_to_fs(store.url)
    with fs.open(f"{root}/{manifest.id}/{entry.stored_name}", "rb") as f:
        data: bytes = f.read()
    return data


@contextmanager
def stored_file(store: Store, manifest: Manifest, name: str) -> Iterator[io.BytesIO]:
    """A stored image file to damage: changes to the yielded buffer are written back."""
    entry = next(f for f in manifest.files if f.name == name)
    fs, root = fsspec.core.url_to_fs(store.url)
    buffer = io.BytesIO(stored_bytes(store, manifest, name))
    yield buffer
    fs.pipe_file(f"{root}/{manifest.id}/{entry.stored_name}", buffer.getvalue())


def publish_images(
    store: Store, images: dict[str, bytes], compression: Compression = "none", encrypt: bool = False
) -> Manifest:
    """A checkpoint of `images` (name -> bytes) published into `store`, compressed and
    encrypted as asked (the store needs a key file to encrypt: `encrypted_store`)."""
    info = make_info()
    stage(store, info, images)
    key = store.new_data_key(info.id) if encrypt else None
    return store.publish(info, compression, data_key=key)


def damage_chunk(store: Store, manifest: Manifest, name: str, index: int) -> None:
    """Flip one bit in the middle of chunk `index` of stored image `name`."""
    entry = next(f for f in manifest.files if f.name == name)
    assert entry.chunks is not None
    at = entry.chunks.offsets[index] + entry.chunks.stored_bytes[index] // 2
    with stored_file(store, manifest, name) as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
