"""A stored image decoded in order into a writer (what a streamed restore hands CRIU): exactly
the plain bytes, and at a damaged chunk an error before any byte of that chunk is written."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from stasis.errors import CorruptCheckpointError
from stasis.store import Manifest, Store
from stasis.store.chunked import CHUNK_BYTES
from stasis.store.manifest import Compression
from tests.store.helpers import damage_chunk, encrypted_store, publish_images

DATA = b"".join(
    os.urandom(CHUNK_BYTES // 2) + bytes(CHUNK_BYTES // 2) for _ in range(3)
) + os.urandom(CHUNK_BYTES // 3)


def _publish(store: Store, compression: Compression, encrypt: bool) -> Manifest:
    return publish_images(
        store, {"pages-1.img": DATA, "core-1.img": b"core" * 10}, compression, encrypt
    )


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
@pytest.mark.parametrize("compression", ["none", "zstd", "lz4"])
def test_a_file_streams_back_exactly(
    store: Store, tmp_path: Path, compression: Compression, encrypt: bool
) -> None:
    store = encrypted_store(store, tmp_path)
    manifest = _publish(store, compression, encrypt)
    out = io.BytesIO()
    store.stream_file(manifest, "pages-1.img", out)
    assert out.getvalue() == DATA
    small = io.BytesIO()
    store.stream_file(manifest, "core-1.img", small)
    assert small.getvalue() == b"core" * 10


# Plain images are read by CRIU in place, never streamed.
@pytest.mark.parametrize(
    ("compression", "encrypt"), [("zstd", False), ("zstd", True), ("none", True)]
)
def test_a_damaged_chunk_stops_the_stream_before_it(
    store: Store, tmp_path: Path, compression: Compression, encrypt: bool
) -> None:
    store = encrypted_store(store, tmp_path)
    manifest = _publish(store, compression, encrypt)
    damage_chunk(store, manifest, "pages-1.img", 2)
    out = io.BytesIO()
    with pytest.raises(CorruptCheckpointError, match="pages-1.img chunk 2"):
        store.stream_file(manifest, "pages-1.img", out)
    # Chunks 0 and 1 went out, verified; nothing of chunk 2.
    assert out.getvalue() == DATA[: 2 * CHUNK_BYTES]


def test_a_truncated_file_is_refused_before_a_byte(local_store: Store, tmp_path: Path) -> None:
    manifest = _publish(local_store, "zstd", False)
    stored = next(
        p for p in (tmp_path / "store" / manifest.id).iterdir() if p.name.startswith("pages-1.img")
    )
    os.truncate(stored, stored.stat().st_size - 10)
    out = io.BytesIO()
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        local_store.stream_file(manifest, "pages-1.img", out)
    assert out.getvalue() == b""
