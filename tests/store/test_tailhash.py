"""Hashing page images while CRIU writes them: the published checksums are those of the files."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from stasis.store import Store
from stasis.store.chunked import CHUNK_BYTES, ChunkSpec, ChunkWriter
from stasis.store.manifest import Compression, CompressionRequest, FileEntry, Manifest
from stasis.store.tailhash import Partial, TailHasher
from tests.store.helpers import blake3_digest, make_info, stage


def _write_slowly(path: Path, data: bytes, pieces: int) -> None:
    """Append `data` in `pieces` writes, as CRIU does with a page image."""
    step = len(data) // pieces + 1
    with open(path, "wb", buffering=0) as f:
        for offset in range(0, len(data), step):
            f.write(data[offset : offset + step])
            time.sleep(0.01)


def _follow_and_publish(
    store: Store, compression: CompressionRequest, files: dict[str, bytes]
) -> tuple[Manifest, dict[str, Partial], Path]:
    info = make_info()
    staging = store.staging_dir(info.id)
    tail = store.follow(info.id, compression)
    assert tail is not None
    writers = [
        threading.Thread(target=_write_slowly, args=(staging / name, data, 20))
        for name, data in files.items()
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    (staging / "inventory.img").write_bytes(b"inventory")
    hashed = tail.finish()
    decided = tail.compression or compression
    packing_dir = staging.with_name(info.id + ".publish")
    manifest = store.publish(info, decided, hashed=hashed)
    return manifest, hashed, packing_dir


def test_follows_files_as_they_grow(local_store: Store, random_20m: bytes) -> None:
    manifest, hashed, _ = _follow_and_publish(
        local_store, "none", {"pages-1.img": random_20m, "pages-2.img": random_20m[: 3 << 20]}
    )
    # It kept up with the writers (a few idle ms behind at most), and took no other image.
    assert set(hashed) == {"pages-1.img", "pages-2.img"}
    assert hashed["pages-1.img"].offset > 0

    files = {f.name: f for f in manifest.files}
    assert files["pages-1.img"].blake3 == blake3_digest(random_20m)
    assert files["pages-2.img"].blake3 == blake3_digest(random_20m[: 3 << 20])
    assert files["pages-1.img"].size_bytes == len(random_20m)
    local_store.verify(manifest)


def test_a_partial_hash_longer_than_the_file_is_ignored(local_store: Store) -> None:
    info = make_info()
    stage(local_store, info, {"pages-1.img": b"x" * 1000})
    bogus = ChunkWriter("pages-1.img", ChunkSpec("none"), None)
    bogus.add(b"y" * CHUNK_BYTES)
    manifest = local_store.publish(info, "none", hashed={"pages-1.img": Partial(bogus)})
    assert manifest.files[0].blake3 == blake3_digest(b"x" * 1000)


def test_only_where_it_saves_a_read(local_store: Store, memory_store: Store) -> None:
    info = make_info()
    local_store.staging_dir(info.id)
    memory_store.staging_dir(info.id)
    # A remote store streams the images while CRIU writes (tests/store/test_s3_stream.py).
    streaming = memory_store.follow(info.id, "none")
    assert streaming is not None
    streaming.finish()
    memory_store.discard(info.id)
    compressions: tuple[CompressionRequest, ...] = ("none", "auto", "zstd")
    for compression in compressions:
        tail = local_store.follow(info.id, compression)
        assert tail is not None
        assert tail.finish() == {}


def _entry(manifest: Manifest, name: str = "pages-1.img") -> FileEntry:
    return next(f for f in manifest.files if f.name == name)


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_compresses_while_written(
    local_store: Store, mostly_zero: bytes, random_20m: bytes, compression: Compression
) -> None:
    files = {"pages-1.img": mostly_zero, "pages-2.img": random_20m[: 5 << 20]}
    manifest, hashed, _ = _follow_and_publish(local_store, compression, files)
    # The follower compressed the files' heads, publish only the rest: one valid frame each.
    assert all(hashed[n].output is not None and hashed[n].offset > 0 for n in files)
    assert manifest.compression == compression
    entries = {f.name: f for f in manifest.files}
    for name, data in files.items():
        assert entries[name].blake3 == blake3_digest(data)
        assert entries[name].size_bytes == len(data)
    assert entries["pages-1.img"].stored_size_bytes * 5 < len(mostly_zero)
    local_store.verify(manifest)  # decompresses every file and checks it against the manifest


def test_auto_keeps_compressing_what_shrinks(local_store: Store, mostly_zero: bytes) -> None:
    manifest, hashed, packing_dir = _follow_and_publish(
        local_store, "auto", {"pages-1.img": mostly_zero}
    )
    assert hashed["pages-1.img"].output is not None
    assert manifest.compression == "zstd"
    assert _entry(manifest).blake3 == blake3_digest(mostly_zero)
    assert _entry(manifest).stored_size_bytes * 5 < len(mostly_zero)
    assert not packing_dir.exists()  # it became the checkpoint
    local_store.verify(manifest)


def test_auto_gives_up_on_what_does_not(local_store: Store, random_20m: bytes) -> None:
    manifest, hashed, packing_dir = _follow_and_publish(
        local_store, "auto", {"pages-1.img": random_20m}
    )
    # A few MiB told it: the rest was only hashed, and the staged file is the stored one.
    assert hashed["pages-1.img"].output is None
    assert hashed["pages-1.img"].offset > 0
    assert manifest.compression == "none"
    assert _entry(manifest).blake3 == blake3_digest(random_20m)
    assert not packing_dir.exists()
    local_store.verify(manifest)


def test_auto_leaves_a_small_dump_to_publish(local_store: Store) -> None:
    info = make_info()
    staging = local_store.staging_dir(info.id)
    tail = local_store.follow(info.id, "auto")
    assert tail is not None
    (staging / "pages-1.img").write_bytes(bytes(100 << 10))
    time.sleep(0.05)
    hashed = tail.finish()
    assert tail.compression is None  # 100 KiB: too little to judge; publish's own rule applies
    manifest = local_store.publish(info, "auto", hashed=hashed)
    assert manifest.compression == "none"
    local_store.verify(manifest)


def test_a_packed_head_longer_than_the_file_is_redone(
    local_store: Store, mostly_zero: bytes
) -> None:
    info = make_info()
    staging = local_store.staging_dir(info.id)
    tail = local_store.follow(info.id, "zstd")
    assert tail is not None
    (staging / "pages-1.img").write_bytes(mostly_zero)
    time.sleep(0.3)  # it follows within milliseconds
    hashed = tail.finish()
    assert hashed["pages-1.img"].offset > 4096
    os.truncate(staging / "pages-1.img", 4096)  # not what the follower saw
    manifest = local_store.publish(info, "zstd", hashed=hashed)
    assert _entry(manifest).size_bytes == 4096
    assert _entry(manifest).blake3 == blake3_digest(mostly_zero[:4096])
    local_store.verify(manifest)


def test_a_vanished_directory_stops_nothing(tmp_path: Path) -> None:
    tail = TailHasher(tmp_path / "gone", writeback=True)
    time.sleep(0.02)
    assert tail.finish() == {}
    assert os.listdir(tmp_path) == []


def test_no_room_to_compress_alongside_is_no_error(local_store: Store, mostly_zero: bytes) -> None:
    info = make_info()
    staging = local_store.staging_dir(info.id)
    # Something in the way of the directory the follower would compress into.
    (staging.parent / (info.id + ".publish")).write_bytes(b"")
    assert local_store.follow(info.id, "zstd") is None
    (staging / "pages-1.img").write_bytes(mostly_zero)
    (staging.parent / (info.id + ".publish")).unlink()
    manifest = local_store.publish(info, "zstd")
    assert _entry(manifest).blake3 == blake3_digest(mostly_zero)
    local_store.verify(manifest)
