"""Fuzzing what a store writer controls: manifest.json and the chunk table and stored bytes it
describes. Whatever they hold, the store answers with one of its own errors (a line for the
user), never another exception (a crash of the request, or worse of the daemon), and never
bytes that did not verify. Bounded in time: a few hundred examples each, no deadline per example
(these machines are shared)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stasis.errors import StasisError
from stasis.store import Store
from stasis.store.chunked import (
    ChunkDecoder,
    ChunkError,
    ChunkSpec,
    encode_chunk,
    unpack_chunked,
)
from stasis.store.manifest import Chunks, Compression, FileEntry, Manifest, file_digest
from tests.store.helpers import SMALL_FILES, make_info, signed, stage

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Each example of these publishes a checkpoint first (~50 ms).
FUZZ_STORE = settings(FUZZ, max_examples=80)

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30,
)


IMAGES = {**SMALL_FILES, "pages-1.img": bytes(range(256)) * 9000}


def _published(tmp_path: Path) -> tuple[Store, Manifest, dict[str, Any]]:
    store = Store(str(tmp_path / "store"), staging_root=tmp_path / "staging", keep=0)
    info = make_info()
    stage(store, info, IMAGES)
    manifest = store.publish(info, "none")
    document = json.loads((tmp_path / "store" / manifest.id / "manifest.json").read_text())
    return store, manifest, document


@FUZZ_STORE
@given(data=st.binary(max_size=2048) | _json.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_as_a_manifest_are_one_refusal(tmp_path: Path, data: bytes) -> None:
    shutil.rmtree(tmp_path / "store", ignore_errors=True)
    store, manifest, _ = _published(tmp_path)
    (tmp_path / "store" / manifest.id / "manifest.json").write_bytes(data)
    try:
        store.get(manifest.id)
        raise AssertionError("an unsigned manifest was read")
    except StasisError as e:
        assert "\n" not in str(e)
    assert store.list() == []


_fields = st.sampled_from(
    [
        "format",
        "files",
        "size_bytes",
        "compression",
        "encryption",
        "uid",
        "label",
        "id",
        "created",
        "signature",
    ]
)
_file_fields = st.sampled_from(
    ["name", "size_bytes", "stored_name", "stored_size_bytes", "blake3", "xxh3_128", "chunks"]
)
_chunk_fields = st.sampled_from(["size_bytes", "stored_bytes", "blake3", "xxh3_64", "seals"])


@FUZZ_STORE
@given(
    top=st.lists(st.tuples(_fields, _json), max_size=2),
    per_file=st.lists(st.tuples(_file_fields, _json), max_size=3),
    per_table=st.lists(st.tuples(_chunk_fields, _json), max_size=3),
    which=st.integers(0, 20),
    signs=st.booleans(),
)
def test_a_mutated_manifest_is_refused_or_checked_all_the_way(
    tmp_path: Path,
    top: list[tuple[str, Any]],
    per_file: list[tuple[str, Any]],
    per_table: list[tuple[str, Any]],
    which: int,
    signs: bool,
) -> None:
    """Fields replaced by any JSON; sometimes signed with the node's own key (a signer's bug,
    or one key holder against another): parsing refuses it, or a restore from it reads only
    bytes that verify."""
    shutil.rmtree(tmp_path / "store", ignore_errors=True)
    store, manifest, document = _published(tmp_path)
    for key, value in top:
        document[key] = value
    files = document.get("files")
    if isinstance(files, list) and files and isinstance(files[which % len(files)], dict):
        one = files[which % len(files)]
        for key, value in per_file:
            one[key] = value
        table = one.get("chunks")
        if isinstance(table, dict):
            for key, value in per_table:
                table[key] = value
    path = tmp_path / "store" / manifest.id / "manifest.json"
    path.write_text(json.dumps(document))
    if signs:
        try:
            parsed = Manifest.model_validate(
                {k: v for k, v in document.items() if k != "signature"}
            )
        except ValueError:
            parsed = None
        if parsed is not None:
            path.write_bytes(signed(store, parsed))
    try:
        got = store.get(manifest.id)
        with store.open_images(got.id, tmp_path / "scratch") as (_, images):
            for entry in got.files:
                # What the restore gets is what was published, or nothing at all.
                assert (images / entry.name).read_bytes() == IMAGES[entry.name]
    except StasisError as e:
        assert "\n" not in str(e)


@FUZZ
@given(
    data=st.binary(max_size=600),
    step=st.integers(1, 200),
    compression=st.sampled_from(["none", "zstd", "lz4"]),
    flips=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), max_size=3),
    cut=st.integers(-3, 3),
    tail=st.binary(max_size=3),
)
def test_stored_chunks_changed_anyhow_are_one_chunk_error(
    data: bytes,
    step: int,
    compression: Compression,
    flips: list[tuple[int, int]],
    cut: int,
    tail: bytes,
) -> None:
    """Chunks stored as a publish stores them, then changed (bytes flipped, the table's cut
    moved, bytes added): decoding yields exactly the plain bytes the table's hashes name, or a
    ChunkError; never other bytes, never another error."""
    spec = ChunkSpec(compression, chunk_bytes=step)
    blobs = [
        bytes(
            encode_chunk(spec, "pages-1.img", i // step, i + step >= len(data), data[i : i + step])[
                0
            ]
        )
        for i in range(0, len(data), step)
    ]
    hashes = [blake3.blake3(data[i : i + step]).hexdigest() for i in range(0, len(data), step)]
    stored = bytearray(b"".join(blobs))
    for at, xor in flips:
        if stored:
            stored[at % len(stored)] ^= xor
    sizes = [len(b) for b in blobs]
    if sizes:
        sizes[0] = max(0, sizes[0] + cut)
    table = Chunks(size_bytes=step, stored_bytes=sizes, blake3=hashes)
    entry = FileEntry(
        name="pages-1.img",
        size_bytes=len(data),
        stored_name="pages-1.img",
        stored_size_bytes=sum(sizes),
        chunks=table,
        blake3=file_digest(len(data), table),
    )
    assert entry.cryptographic
    out = _Sink()
    try:
        got = unpack_chunked(
            _Reader(bytes(stored) + tail), out, ChunkDecoder("pages-1.img", len(data), table, spec)
        )
    except ChunkError:
        return
    assert bytes(out.data) == data and got.size_bytes == len(data)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def read(self, size: int = -1, /) -> bytes:
        end = len(self.data) if size < 0 else self.at + size
        out = self.data[self.at : end]
        self.at += len(out)
        return out

    def readinto(self, buffer: memoryview, /) -> int:
        out = self.read(len(buffer))
        buffer[: len(out)] = out
        return len(out)


class _Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes | memoryview, /) -> int:
        self.data += data
        return len(data)
