"""A store on a full filesystem: one readable StoreError, nothing listed, nothing left behind.

Uses a real 4 MiB tmpfs, so these tests need root (they are skipped otherwise).
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stasis.errors import StoreError
from stasis.store import Compression, Store
from stasis.store.index import FORMAT_FILE
from stasis.store.marker import MARKER_NAME

from .helpers import make_info, stage

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(mountpoint)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def _fill(path: Path) -> None:
    """Write zeros into `path` until the filesystem is full."""
    with open(path, "wb", buffering=0) as f:
        block = bytes(64 << 10)
        try:
            while True:
                f.write(block)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with open(path, "ab", buffering=0) as f:  # the last partial pages too
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass


def _files_under(root: Path) -> list[str]:
    """What is under `root`, but the label index's empty directories: a failed publish removes
    its index entry (asserted here), not necessarily the directories the entry was in. Nor
    what marks the store as one (its marker, its index complete): written when it starts."""
    index = root / ".index"
    assert [p for p in index.rglob("*") if not p.is_dir() and p != index / FORMAT_FILE] == []
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p != index and index not in p.parents and p.name != MARKER_NAME
    )


def _expect_no_space(
    store: Store, checkpoint_id: str, where: str, compression: Compression
) -> None:
    with pytest.raises(StoreError) as caught:
        store.publish(make_info(id=checkpoint_id), compression)
    message = str(caught.value)
    assert message == (
        f"no space left on {where} while writing checkpoint {checkpoint_id}: "
        "free space or point STASIS_STORE elsewhere"
    )
    assert store.list() == []
    store.discard(checkpoint_id)  # harmless afterwards


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_compressed_publish_on_a_full_local_store(tiny_fs: Path, compression: Compression) -> None:
    store = Store(str(tiny_fs), staging_root=Path("/nonexistent"), keep=0)
    info = make_info()
    # Fits as staged, but not twice: the compressed copy runs out of space.
    staging = stage(store, info, {"pages-1.img": os.urandom(2_500_000), "core-1.img": b"c" * 100})
    _expect_no_space(store, info.id, str(tiny_fs), compression)
    assert not staging.exists()
    assert _files_under(tiny_fs) == [".staging"]


def test_manifest_write_on_a_full_local_store(tiny_fs: Path) -> None:
    store = Store(str(tiny_fs), staging_root=Path("/nonexistent"), keep=0)
    info = make_info()
    stage(store, info, {"pages-1.img": os.urandom(1_000_000)})
    _fill(tiny_fs / "filler")
    _expect_no_space(store, info.id, str(tiny_fs), "none")
    assert _files_under(tiny_fs) == [".staging", "filler"]


def test_8_mib_upload_to_a_full_fsspec_store(tiny_fs: Path, tmp_path: Path) -> None:
    # "dir::file://" goes through the fsspec code path: staged on local disk, uploaded from there.
    url = f"dir::file://{tiny_fs}"
    store = Store(url, staging_root=tmp_path / "staging", keep=0)
    info = make_info()
    staging = stage(store, info, {"pages-1.img": os.urandom(8 << 20), "core-1.img": b"c" * 100})
    assert staging.is_relative_to(tmp_path / "staging")
    _expect_no_space(store, info.id, url, "none")
    assert not staging.exists()
    assert _files_under(tiny_fs) == []


def test_a_streamed_upload_to_a_full_fsspec_store_fails_and_never_hangs(
    tiny_fs: Path, tmp_path: Path
) -> None:
    # The follower streams the images while "CRIU" writes them; the store fills up. The error
    # may come as late as the file's close: the dump must still fail, not wait forever.
    url = f"dir::file://{tiny_fs}"
    store = Store(url, staging_root=tmp_path / "staging", keep=0)
    info = make_info()
    staging = store.staging_dir(info.id)
    tail = store.follow(info.id, "none")
    assert tail is not None
    (staging / "pages-1.img").write_bytes(os.urandom(8 << 20))
    (staging / "core-1.img").write_bytes(b"c" * 100)
    hashed = tail.finish()
    _expect_no_space_with(store, info, url, hashed)
    assert not staging.exists()


def _expect_no_space_with(store: Store, info: Any, where: str, hashed: Any) -> None:
    with pytest.raises(StoreError) as caught:
        store.publish(info, "none", hashed=hashed)
    assert str(caught.value) == (
        f"no space left on {where} while writing checkpoint {info.id}: "
        "free space or point STASIS_STORE elsewhere"
    )
    assert store.list() == []
