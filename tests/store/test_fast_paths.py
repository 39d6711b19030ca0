"""Publishing from images staged outside the store, and `auto` compression."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stasis.errors import StoreError
from stasis.store import Store
from stasis.store.compression import choose_compression
from tests.store.helpers import make_info


def _store(tmp_path: Path) -> Store:
    return Store(str(tmp_path / "store"), staging_root=tmp_path / "staging")


def _mostly_zero(size: int) -> bytes:
    page = bytearray(4096)
    page[0] = 1
    return bytes(page) * (size // 4096)


def test_publish_from_an_outside_staging_dir(tmp_path: Path) -> None:
    store = _store(tmp_path)
    info = make_info()
    fast = tmp_path / "fast" / info.id  # stands in for the node's tmpfs
    fast.mkdir(parents=True)
    data = os.urandom(3 << 20)
    (fast / "pages-1.img").write_bytes(data)
    manifest = store.publish(info, "none", source=fast)
    assert not fast.exists()  # consumed
    assert [m.id for m in store.list()] == [info.id]
    with store.open_images(manifest.id, tmp_path / "scratch") as (_, images):
        assert (images / "pages-1.img").read_bytes() == data


def test_failed_publish_from_outside_leaves_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    info = make_info()
    fast = tmp_path / "fast" / info.id
    fast.mkdir(parents=True)
    (fast / "pages-1.img").write_bytes(b"x")
    (fast / "subdir").mkdir()  # not a plain image file: the store refuses it
    with pytest.raises(StoreError, match="unexpected entry"):
        store.publish(info, "none", source=fast)
    assert store.list() == [] and not fast.exists()


def test_auto_compresses_mostly_zero_pages_only(tmp_path: Path) -> None:
    staged = tmp_path / "s"
    staged.mkdir()
    (staged / "pages-1.img").write_bytes(_mostly_zero(16 << 20))
    assert choose_compression(staged, ["pages-1.img"]) == "zstd"
    (staged / "pages-1.img").write_bytes(os.urandom(16 << 20))
    assert choose_compression(staged, ["pages-1.img"]) == "none"
    (staged / "pages-1.img").write_bytes(b"\0" * 1000)
    assert choose_compression(staged, ["pages-1.img"]) == "none"  # too small to bother


def test_auto_in_publish_records_the_choice(tmp_path: Path) -> None:
    store = _store(tmp_path)
    info = make_info()
    staging = store.staging_dir(info.id)
    (staging / "pages-1.img").write_bytes(_mostly_zero(32 << 20))
    manifest = store.publish(info, "auto")
    assert manifest.compression == "zstd"
    assert manifest.stored_size_bytes * 5 <= manifest.size_bytes
