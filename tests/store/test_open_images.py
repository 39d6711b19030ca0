"""Restoring: images come back byte for byte, and damage is caught before CRIU sees anything."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest

from stasis.errors import CorruptCheckpointError, NotFoundError
from stasis.store import Compression, Manifest, Store
from stasis.store.manifest import file_digest

from .helpers import SMALL_FILES, make_info, signed, stage


@pytest.fixture
def images(random_20m: bytes, mostly_zero: bytes) -> dict[str, bytes]:
    return {"pages-1.img": random_20m, "pages-2.img": mostly_zero, **SMALL_FILES}


@pytest.mark.parametrize("compression", ["none", "zstd", "lz4"])
def test_round_trip(
    store: Store, images: dict[str, bytes], compression: Compression, tmp_path: Path
) -> None:
    info = make_info()
    stage(store, info, images)
    published = store.publish(info, compression)
    stored = {f.name: f.stored_size_bytes for f in published.files}
    if compression == "zstd":
        assert stored["pages-2.img"] < len(images["pages-2.img"]) // 100
    if compression == "none":
        assert published.stored_size_bytes == published.size_bytes
    scratch = tmp_path / "scratch"
    with store.open_images(info.id, scratch) as (manifest, images_dir):
        assert manifest == published
        assert {p.name for p in images_dir.iterdir()} >= set(images)
        for name, data in images.items():
            assert (images_dir / name).read_bytes() == data
    if not images_dir.is_relative_to(tmp_path / "store"):  # not read in place
        assert not images_dir.exists()  # fetched copies are removed on exit


def test_local_uncompressed_is_read_into_a_private_copy(local_store: Store, tmp_path: Path) -> None:
    """Never the store's own directory: whoever can write the store could change an image
    between its check and CRIU's read. A copy (not a hard link: the same inode) checked as it
    is written, in a fresh root-only directory, removed after."""
    info = make_info()
    stage(local_store, info, SMALL_FILES)
    local_store.publish(info)
    stored = tmp_path / "store" / info.id
    with local_store.open_images(info.id, tmp_path / "scratch") as (_, images_dir):
        assert images_dir != stored and stored not in images_dir.parents
        assert os.stat(images_dir).st_mode & 0o777 == 0o700
        for name, data in SMALL_FILES.items():
            assert os.stat(images_dir / name).st_ino != os.stat(stored / name).st_ino
            # A store writer rewriting an image after the check changes nothing CRIU reads.
            (stored / name).write_bytes(b"X" * len(data))
            assert (images_dir / name).read_bytes() == data
    assert not images_dir.exists()
    assert stored.exists()


def test_fetched_images_go_to_memory_when_it_holds_them(
    local_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Images that must be decoded (or, on a remote store, fetched) for a restore are read back
    at once: /dev/shm when memory holds them, the scratch on disk only when it does not."""
    from stasis.store import reader as store_module

    info = make_info()
    stage(local_store, info, SMALL_FILES)
    local_store.publish(info, "lz4")
    scratch = tmp_path / "scratch"
    with local_store.open_images(info.id, scratch) as (_, images_dir):
        assert images_dir.parent == store_module.MEMORY_SCRATCH and info.id in images_dir.name
        assert os.stat(images_dir).st_mode & 0o777 == 0o700
        assert (images_dir / "core-1.img").read_bytes() == SMALL_FILES["core-1.img"]
    assert not images_dir.exists()
    monkeypatch.setattr(store_module, "_memory_scratch", lambda size_bytes: None)
    with local_store.open_images(info.id, scratch) as (_, images_dir):
        assert images_dir.parent == scratch
        assert (images_dir / "core-1.img").read_bytes() == SMALL_FILES["core-1.img"]
    assert not images_dir.exists()


def test_scratch_is_removed_when_the_body_fails(local_store: Store, tmp_path: Path) -> None:
    info = make_info()
    stage(local_store, info, SMALL_FILES)
    local_store.publish(info, "lz4")
    with pytest.raises(RuntimeError):
        with local_store.open_images(info.id, tmp_path / "scratch"):
            raise RuntimeError("criu restore failed")
    assert list((tmp_path / "scratch").iterdir()) == []


# -- damage --------------------------------------------------------------------------------


def _publish(store: Store, compression: Compression) -> Manifest:
    info = make_info()
    stage(store, info, {"pages-1.img": os.urandom(300_000), "core-1.img": b"core" * 1000})
    return store.publish(info, compression)


def _stored_path(store: Store, manifest: Manifest, name: str) -> str:
    entry = next(f for f in manifest.files if f.name == name)
    if "://" in store.url:
        return f"{store.url}/{manifest.id}/{entry.stored_name}"
    return str(Path(store.url) / manifest.id / entry.stored_name)


def _rewrite(path: str, change: Callable[[bytes], bytes]) -> None:
    with fsspec.open(path, "rb") as f:
        data = f.read()
    with fsspec.open(path, "wb") as f:
        f.write(change(data))


def _flip(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


@pytest.mark.parametrize("compression", ["none", "zstd", "lz4"])
@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (_flip, "pages-1.img (chunk [0-9]+ )?(fails its checksum|cannot be decompressed)"),
        (lambda d: d[: len(d) - 1000], "pages-1.img has .* bytes stored instead of"),
        (lambda d: d + b"tail", "pages-1.img has .* bytes stored instead of"),
    ],
    ids=["flipped", "truncated", "extended"],
)
def test_damaged_image_is_reported_before_yielding(
    store: Store,
    compression: Compression,
    damage: Callable[[bytes], bytes],
    words: str,
    tmp_path: Path,
) -> None:
    manifest = _publish(store, compression)
    _rewrite(_stored_path(store, manifest, "pages-1.img"), damage)
    with pytest.raises(
        CorruptCheckpointError, match=f"checkpoint {manifest.id} is corrupt: {words}"
    ) as caught:
        with store.open_images(manifest.id, tmp_path / "scratch"):
            pytest.fail("yielded a damaged checkpoint")
    assert str(caught.value).endswith(f"delete it with `stasis checkpoints rm {manifest.id}`")
    assert "\n" not in str(caught.value)
    if (tmp_path / "scratch").exists():
        assert list((tmp_path / "scratch").iterdir()) == []


def test_wrong_plain_size_is_caught(local_store: Store, tmp_path: Path) -> None:
    # Stored bytes intact, but they decode to more than the manifest says: never trust the codec.
    manifest = _publish(local_store, "zstd")
    entry = next(f for f in manifest.files if f.name == "core-1.img")
    assert entry.chunks is not None
    lying = manifest.model_copy(
        update={
            "files": [
                # The file's digest covers its size: lie about that too, as a key holder could.
                f
                if f is not entry
                else entry.model_copy(
                    update={"size_bytes": 3, "blake3": file_digest(3, entry.chunks)}
                )
                for f in manifest.files
            ]
        }
    )
    (tmp_path / "store" / manifest.id / "manifest.json").write_bytes(signed(local_store, lying))
    with pytest.raises(
        CorruptCheckpointError, match="core-1.img (holds more than|chunk 0 does not hold) 3 bytes;"
    ):
        with local_store.open_images(manifest.id, tmp_path / "scratch"):
            pass


def test_missing_image_is_reported(store: Store, tmp_path: Path) -> None:
    manifest = _publish(store, "lz4")
    fsspec.core.url_to_fs(store.url)[0].rm(_stored_path(store, manifest, "core-1.img"))
    with pytest.raises(CorruptCheckpointError, match="core-1.img is missing"):
        with store.open_images(manifest.id, tmp_path / "scratch"):
            pass


def test_missing_manifest_is_not_listed(store: Store) -> None:
    manifest = _publish(store, "none")
    fs, root = fsspec.core.url_to_fs(store.url)
    fs.rm(f"{root}/{manifest.id}/manifest.json")
    assert store.list() == []
    with pytest.raises(NotFoundError):
        store.get(manifest.id)
    store.delete(manifest.id)  # a half-deleted checkpoint can still be cleaned up
    assert not fs.exists(f"{root}/{manifest.id}")


@pytest.mark.parametrize(
    "garbage",
    [b"", b"{not json", b"\xff\xfe", b'{"format": 1}', b"[]", b'{"format": 99}'],
    ids=["empty", "broken", "binary", "incomplete", "list", "future"],
)
def test_garbage_manifest_is_skipped_without_crashing(store: Store, garbage: bytes) -> None:
    good = _publish(store, "none")
    bad = _publish(store, "none")
    fs, root = fsspec.core.url_to_fs(store.url)
    fs.pipe_file(f"{root}/{bad.id}/manifest.json", garbage)
    assert [m.id for m in store.list()] == [good.id]
    with pytest.raises(
        CorruptCheckpointError, match=f"checkpoint {bad.id} is corrupt: manifest.json is unreadable"
    ):
        store.get(bad.id)
    store.delete(bad.id)
    assert [m.id for m in store.list()] == [good.id]


def test_manifest_of_another_checkpoint_is_skipped(store: Store) -> None:
    first = _publish(store, "none")
    second = _publish(store, "none")
    fs, root = fsspec.core.url_to_fs(store.url)
    fs.pipe_file(f"{root}/{second.id}/manifest.json", first.model_dump_json().encode())
    assert [m.id for m in store.list()] == [first.id]


def test_manifest_with_path_tricks_is_never_followed(local_store: Store, tmp_path: Path) -> None:
    manifest = _publish(local_store, "none")
    secret = tmp_path / "secret.img"
    secret.write_bytes(b"secret")
    raw = manifest.model_dump(mode="json")
    raw["files"][0]["stored_name"] = "../../secret.img"
    (tmp_path / "store" / manifest.id / "manifest.json").write_text(json.dumps(raw))
    assert local_store.list() == []
    with pytest.raises(CorruptCheckpointError, match="manifest.json is unreadable"):
        with local_store.open_images(manifest.id, tmp_path / "scratch"):
            pass
