from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import xxhash

from stasis.store.compression import DecompressionError, pack, stored_name, unpack
from stasis.store.manifest import COMPRESSIONS, Compression


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("size", [0, 1, (8 << 20) + 5])
def test_pack_unpack_round_trip(compression: Compression, size: int) -> None:
    data = os.urandom(size)
    stored = io.BytesIO()
    packed = pack(io.BytesIO(data), stored, compression)
    assert packed.size_bytes == size
    assert packed.xxh3_128 == xxhash.xxh3_128(data).hexdigest()
    assert packed.stored_size_bytes == len(stored.getvalue())
    out = io.BytesIO()
    unpacked = unpack(io.BytesIO(stored.getvalue()), out, compression, size)
    assert (unpacked.size_bytes, unpacked.xxh3_128) == (size, packed.xxh3_128)
    assert out.getvalue() == data


def test_stored_names() -> None:
    assert [stored_name("pages-1.img", c) for c in COMPRESSIONS] == [
        "pages-1.img",
        "pages-1.img.zst",
        "pages-1.img.lz4",
    ]


def test_hash_only_needs_no_destination() -> None:
    packed = pack(io.BytesIO(b"abc"), None, "none")
    assert packed.xxh3_128 == xxhash.xxh3_128(b"abc").hexdigest()
    with pytest.raises(ValueError):
        pack(io.BytesIO(b"abc"), None, "zstd")


def test_unpack_stops_past_max_bytes() -> None:
    stored = io.BytesIO()
    pack(io.BytesIO(bytes(64 << 20)), stored, "zstd")
    got = unpack(io.BytesIO(stored.getvalue()), None, "zstd", max_bytes=10)
    assert 10 < got.size_bytes <= 16 << 20


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_garbage_is_a_decompression_error(compression: Compression) -> None:
    with pytest.raises(DecompressionError):
        unpack(io.BytesIO(b"this is not compressed at all" * 10), None, compression, 1000)


def test_truncated_lz4_is_a_decompression_error() -> None:
    stored = io.BytesIO()
    pack(io.BytesIO(os.urandom(100_000)), stored, "lz4")
    with pytest.raises(DecompressionError, match="ends early"):
        unpack(io.BytesIO(stored.getvalue()[:-100]), None, "lz4", 100_000)


@pytest.mark.parametrize("size", [0, 4095, (64 << 20) + 3])
def test_local_files_hash_alike_mapped_or_read(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "pages-1.img"
    path.write_bytes(data)
    want = xxhash.xxh3_128(data).hexdigest()
    with open(path, "rb", buffering=0) as f:  # a FileIO: hashed through a mapping
        assert pack(f, None, "none").xxh3_128 == want
        assert f.tell() == size
    with open(path, "rb", buffering=0) as f:  # verification reads: never a mapping
        got = unpack(f, None, "none", size)
        assert (got.size_bytes, got.xxh3_128) == (size, want)
    with open(path, "rb", buffering=0) as f:
        # A file longer than the manifest says is read past that: the size check catches it.
        assert min(size, size // 2 + 1) <= unpack(f, None, "none", size // 2).size_bytes <= size
    assert pack(io.BytesIO(data), None, "none").xxh3_128 == want  # not a file: read in chunks
