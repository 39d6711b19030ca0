"""Range reads of stored images: only the chunks needed are fetched, each one verified."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stasis.errors import CorruptCheckpointError, UntrustedCheckpointError, UsageError
from stasis.store import Manifest, Store
from stasis.store.chunked import CHUNK_BYTES
from stasis.store.compression import pack, stored_name
from stasis.store.manifest import Compression, FileEntry
from tests.store.helpers import (
    damage_chunk,
    encrypted_store,
    make_info,
    publish_images,
    signed,
)

# 3.5 chunks: random halves (they do not compress) and zero halves (they do).
DATA = b"".join(
    os.urandom(CHUNK_BYTES // 2) + bytes(CHUNK_BYTES // 2) for _ in range(3)
) + os.urandom(CHUNK_BYTES // 2)

RANGES = [
    (0, 10),
    (CHUNK_BYTES - 5, 10),  # across a chunk boundary
    (CHUNK_BYTES, CHUNK_BYTES),  # exactly one chunk
    (100, 2 * CHUNK_BYTES + 7),  # three chunks
    (len(DATA) - 3, 3),  # the end of the short last chunk
    (0, len(DATA)),
    (12345, 0),
]


def _publish(store: Store, compression: Compression, encrypt: bool) -> Manifest:
    return publish_images(
        store, {"pages-1.img": DATA, "core-1.img": b"core" * 10}, compression, encrypt
    )


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
@pytest.mark.parametrize("compression", ["none", "zstd", "lz4"])
def test_ranges_read_back_exactly(
    store: Store, tmp_path: Path, compression: Compression, encrypt: bool
) -> None:
    store = encrypted_store(store, tmp_path)
    manifest = _publish(store, compression, encrypt)
    assert (manifest.encryption is not None) == encrypt
    for offset, length in RANGES:
        assert (
            store.read_range(manifest, "pages-1.img", offset, length)
            == DATA[offset : offset + length]
        ), (offset, length)
    assert store.read_range(manifest, "core-1.img", 4, 8) == b"corecore"


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_damaged_chunk_fails_only_the_ranges_in_it(
    store: Store, tmp_path: Path, compression: Compression, encrypt: bool
) -> None:
    store = encrypted_store(store, tmp_path)
    manifest = _publish(store, compression, encrypt)
    damage_chunk(store, manifest, "pages-1.img", 1)
    with pytest.raises(CorruptCheckpointError, match="pages-1.img chunk 1 fails"):
        store.read_range(manifest, "pages-1.img", CHUNK_BYTES - 1, 2)
    # Its neighbours still read, and verify.
    assert store.read_range(manifest, "pages-1.img", 0, 100) == DATA[:100]
    assert (
        store.read_range(manifest, "pages-1.img", 2 * CHUNK_BYTES, 100)
        == DATA[2 * CHUNK_BYTES : 2 * CHUNK_BYTES + 100]
    )


def test_a_truncated_file_fails_the_ranges_past_its_end(local_store: Store, tmp_path: Path) -> None:
    manifest = _publish(local_store, "none", False)
    os.truncate(tmp_path / "store" / manifest.id / "pages-1.img", CHUNK_BYTES + 10)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        local_store.read_range(manifest, "pages-1.img", CHUNK_BYTES, 100)
    assert local_store.read_range(manifest, "pages-1.img", 0, 100) == DATA[:100]


def test_ranges_outside_the_file_are_refused(local_store: Store) -> None:
    manifest = _publish(local_store, "none", False)
    with pytest.raises(UsageError, match="not within pages-1.img"):
        local_store.read_range(manifest, "pages-1.img", len(DATA) - 1, 2)
    with pytest.raises(UsageError, match="not within"):
        local_store.read_range(manifest, "pages-1.img", -1, 2)
    with pytest.raises(UsageError, match="no image file"):
        local_store.read_range(manifest, "pages-9.img", 0, 1)


def test_format_1_is_listed_but_not_restored(local_store: Store, tmp_path: Path) -> None:
    # What a stasis before chunking wrote: one zstd stream, no chunk table, format 1.
    info = make_info()
    directory = tmp_path / "store" / info.id
    directory.mkdir(parents=True, mode=0o700)
    with open(directory / stored_name("pages-1.img", "zstd"), "wb") as dst:
        streamed = pack(_Bytes(DATA), dst, "zstd")
    entry = FileEntry(
        name="pages-1.img",
        size_bytes=streamed.size_bytes,
        stored_name="pages-1.img.zst",
        stored_size_bytes=streamed.stored_size_bytes,
        xxh3_128=streamed.xxh3_128,
    )
    old = Manifest.build(info, "zstd", [entry], format=1)
    (directory / "manifest.json").write_bytes(signed(local_store, old))
    manifest = local_store.get(info.id)
    assert manifest.format == 1
    assert [m.id for m in local_store.list()] == [info.id]
    # Only xxh3 checks its images, which whoever writes the store can forge: one line, how on.
    refused = "predates cryptographic image hashes.*dump the job again"
    with pytest.raises(UntrustedCheckpointError, match=refused):
        local_store.read_range(manifest, "pages-1.img", 0, 1)
    with pytest.raises(UntrustedCheckpointError, match=refused):
        with local_store.open_images(info.id, tmp_path / "scratch"):
            pass
    assert not (tmp_path / "scratch").exists() or not any((tmp_path / "scratch").iterdir())


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.view = memoryview(data)
        self.at = 0

    def read(self, size: int = -1, /) -> bytes:
        end = len(self.view) if size < 0 else self.at + size
        out = bytes(self.view[self.at : end])
        self.at += len(out)
        return out

    def readinto(self, buffer: memoryview, /) -> int:
        out = self.read(len(buffer))
        buffer[: len(out)] = out
        return len(out)
