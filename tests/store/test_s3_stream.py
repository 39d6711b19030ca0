"""Dumps streamed to a real S3 server (SeaweedFS) while CRIU writes them, and full restores
fetched in parallel ranges: byte-identical round trips, uploads that start before publish, a
server cut off mid-stream, a flipped byte."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

import stasis.store.reader as store_module
from stasis.errors import CorruptCheckpointError, StoreError
from stasis.store import Store
from stasis.store.crypt import KeyFiles
from tests.faultproxy import CutProxy
from tests.s3server import S3Server
from tests.store.helpers import SMALL_FILES, make_info, write_key
from tests.store.test_s3 import options

MiB = 1 << 20


def s3_store(
    s3: S3Server, url: str, root: Path, endpoint: str | None = None, encrypted: bool = False
) -> Store:
    keys = KeyFiles()
    if encrypted:
        key = root.parent / "current.key"
        if not key.exists():
            write_key(key)
        keys = KeyFiles(str(key))
    return Store(
        url,
        staging_root=root / "staging",
        keep=0,
        encryption=keys,
        options=options(s3, endpoint, default_block_size=5 * MiB),
    )


def uploads(s3: S3Server, bucket: str) -> list[dict[str, Any]]:
    page = s3.filesystem().call_s3("list_multipart_uploads", Bucket=bucket)
    return list(page.get("Uploads", []))


def parts(s3: S3Server, bucket: str, upload: dict[str, Any]) -> int:
    page = s3.filesystem().call_s3(
        "list_parts", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
    )
    return len(page.get("Parts", []))


def wait_for(what: str, check: Any, timeout_s: float = 20) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"{what} did not happen within {timeout_s} s")


@pytest.mark.parametrize(
    "compression,encrypted",
    [("none", False), ("zstd", False), ("none", True)],
    ids=["none", "zstd", "encrypted"],
)
def test_followed_dump_uploads_while_written_and_round_trips(
    s3: S3Server, s3_bucket: str, tmp_path: Path, compression: str, encrypted: bool
) -> None:
    url = f"s3://{s3_bucket}/stream"
    store = s3_store(s3, url, tmp_path / "a", encrypted=encrypted)
    info = make_info()
    staging = store.staging_dir(info.id)
    data_key = store.new_data_key(info.id) if encrypted else None
    tail = store.follow(info.id, compression, data_key)  # type: ignore[arg-type]
    assert tail is not None
    head, rest = os.urandom(12 * MiB), os.urandom(3 * MiB + 12345)
    with open(staging / "pages-1.img", "wb") as pages:
        pages.write(head)
        pages.flush()
        # CRIU is still "writing": parts of the file are on the server before publish.
        found = wait_for(
            "a multipart upload with a part",
            lambda: [
                u
                for u in uploads(s3, s3_bucket)
                if f"/{info.id}/pages-1.img" in u["Key"] and parts(s3, s3_bucket, u) >= 1
            ],
        )
        assert found
        pages.write(rest)
    for name, data in SMALL_FILES.items():
        (staging / name).write_bytes(data)
    hashed = tail.finish()
    assert hashed["pages-1.img"].offset >= 10 * MiB
    manifest = store.publish(
        info,
        compression,  # type: ignore[arg-type]
        hashed=hashed,
        data_key=data_key,
    )
    assert manifest.compression == compression
    assert (manifest.encryption is not None) == encrypted
    assert [u for u in uploads(s3, s3_bucket) if info.id in u["Key"]] == []
    other = s3_store(s3, url, tmp_path / "b", encrypted=encrypted)
    other.keys = store.keys
    assert [m.id for m in other.list()] == [info.id]
    with other.open_images(info.id, tmp_path / "scratch") as (_, images):
        assert (images / "pages-1.img").read_bytes() == head + rest
        for name, data in SMALL_FILES.items():
            assert (images / name).read_bytes() == data


def test_cut_mid_stream_fails_in_one_line_lists_nothing_and_gc_cleans(
    s3: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    url = f"s3://{s3_bucket}/cut"
    with CutProxy(("127.0.0.1", s3.port)) as proxy:
        store = s3_store(s3, url, tmp_path / "a", endpoint=proxy.endpoint)
        info = make_info()
        staging = store.staging_dir(info.id)
        tail = store.follow(info.id, "none")
        assert tail is not None
        proxy.cut_after(upload=8 * MiB)
        (staging / "pages-1.img").write_bytes(os.urandom(24 * MiB))
        for name, data in SMALL_FILES.items():
            (staging / name).write_bytes(data)
        hashed = tail.finish()
        started = time.monotonic()
        with pytest.raises(StoreError) as caught:
            store.publish(info, "none", hashed=hashed)
        assert time.monotonic() - started < 60
        assert str(caught.value).startswith(f"cannot write checkpoint {info.id} to {url}: ")
        assert "\n" not in str(caught.value)
        assert not staging.exists()
        proxy.heal()
    other = s3_store(s3, url, tmp_path / "b")
    assert other.list() == []
    other.gc(idle_s=0)
    assert other._tree.abandoned_uploads(0) == []  # type: ignore[attr-defined]
    assert other._tree.ids() == []
    assert other._tree.index_list("train", 1000) == []


def test_a_dump_that_fails_before_publish_aborts_its_uploads(
    s3: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    store = s3_store(s3, f"s3://{s3_bucket}/gone", tmp_path)
    info = make_info()
    staging = store.staging_dir(info.id)
    tail = store.follow(info.id, "zstd")
    assert tail is not None
    with open(staging / "pages-1.img", "wb") as pages:
        pages.write(os.urandom(12 * MiB))
        pages.flush()
        wait_for("an upload", lambda: [u for u in uploads(s3, s3_bucket) if info.id in u["Key"]])
        tail.finish()  # CRIU failed: the daemon stops the follower, then discards
    store.discard(info.id)
    assert [u for u in uploads(s3, s3_bucket) if info.id in u["Key"]] == []
    assert store._tree.ids() == []


def test_full_restore_fetches_ranges_in_parallel_and_checks_every_chunk(
    s3: S3Server, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "RANGE_CHUNKS", 2)  # 7 ranges of a 13.5 MiB file
    url = f"s3://{s3_bucket}/ranged"
    store = s3_store(s3, url, tmp_path / "a")
    info = make_info()
    staging = store.staging_dir(info.id)
    pages = os.urandom(13 * MiB + MiB // 2)
    (staging / "pages-1.img").write_bytes(pages)
    for name, data in SMALL_FILES.items():
        (staging / name).write_bytes(data)
    manifest = store.publish(info, "zstd")
    scratch = tmp_path / "scratch"
    with store.open_images(info.id, scratch) as (_, images):
        assert (images / "pages-1.img").read_bytes() == pages
    # One byte flipped in the 6th chunk (same size: the size checks pass).
    entry = next(f for f in manifest.files if f.name == "pages-1.img")
    assert entry.chunks is not None
    path = f"{s3_bucket}/ranged/{info.id}/{entry.stored_name}"
    fs = s3.filesystem()
    stored = bytearray(fs.cat_file(path))
    stored[entry.chunks.offsets[5] + 100] ^= 0x01
    fs.pipe_file(path, bytes(stored))
    with pytest.raises(CorruptCheckpointError) as caught:
        with store.open_images(info.id, scratch):
            pytest.fail("images handed out with a bad chunk")
    assert "pages-1.img" in str(caught.value) and "chunk 5" in str(caught.value)
    assert list(scratch.iterdir()) == []


def test_generic_fsspec_store_streams_too(memory_store: Store) -> None:
    store = memory_store
    info = make_info()
    staging = store.staging_dir(info.id)
    tail = store.follow(info.id, "lz4")
    assert tail is not None
    pages = os.urandom(5 * MiB + 7)
    (staging / "pages-1.img").write_bytes(pages)
    for name, data in SMALL_FILES.items():
        (staging / name).write_bytes(data)
    hashed = tail.finish()
    store.publish(info, "lz4", hashed=hashed)
    with store.open_images(info.id, staging.parent / "scratch") as (_, images):
        assert (images / "pages-1.img").read_bytes() == pages


def test_a_dump_tried_again_under_the_same_id_streams_again(memory_store: Store) -> None:
    # The daemon dumps again under the same checkpoint id when CRIU caught the job in a short
    # call to a process outside it: the first try's discard leaves nothing that stops the second
    # from uploading while CRIU writes.
    store = memory_store
    info = make_info()
    first = store.follow(info.id, "lz4")
    assert first is not None
    (store.staging_dir(info.id) / "pages-1.img").write_bytes(os.urandom(MiB))
    first.finish()
    store.discard(info.id)
    second = store.follow(info.id, "lz4")
    assert second is not None
    pages = os.urandom(2 * MiB + 3)
    staging = store.staging_dir(info.id)
    (staging / "pages-1.img").write_bytes(pages)
    for name, data in SMALL_FILES.items():
        (staging / name).write_bytes(data)
    store.publish(info, "lz4", hashed=second.finish())
    with store.open_images(info.id, staging.parent / "scratch") as (_, images):
        assert (images / "pages-1.img").read_bytes() == pages
    # A discard of a published checkpoint's id (never done, but) leaves it whole.
    store.discard(info.id)
    assert [c.id for c in store.list()] == [info.id]
