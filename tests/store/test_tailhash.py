"""Hashing page images while CRIU writes them: the published checksums are those of the files."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import xxhash

from stasis.store import Store
from stasis.store.tailhash import Partial, TailHasher
from tests.store.helpers import make_info, stage


def _write_slowly(path: Path, data: bytes, pieces: int) -> None:
    """Append `data` in `pieces` writes, as CRIU does with a page image."""
    step = len(data) // pieces + 1
    with open(path, "wb", buffering=0) as f:
        for offset in range(0, len(data), step):
            f.write(data[offset:offset + step])
            time.sleep(0.01)


def test_follows_files_as_they_grow(local_store: Store, random_20m: bytes) -> None:
    info = make_info()
    staging = local_store.staging_dir(info.id)
    tail = local_store.follow(info.id, "none")
    assert tail is not None
    writers = [
        threading.Thread(target=_write_slowly, args=(staging / "pages-1.img", random_20m, 40)),
        threading.Thread(target=_write_slowly,
                         args=(staging / "pages-2.img", random_20m[:3 << 20], 5)),
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    (staging / "inventory.img").write_bytes(b"inventory")
    hashed = tail.finish()
    # It kept up with the writers (a few idle ms behind at most), and took no other image.
    assert set(hashed) == {"pages-1.img", "pages-2.img"}
    assert hashed["pages-1.img"].offset > 0

    manifest = local_store.publish(info, "none", hashed=hashed)

    files = {f.name: f for f in manifest.files}
    assert files["pages-1.img"].xxh3_128 == xxhash.xxh3_128(random_20m).hexdigest()
    assert files["pages-2.img"].xxh3_128 == xxhash.xxh3_128(random_20m[:3 << 20]).hexdigest()
    assert files["pages-1.img"].size_bytes == len(random_20m)
    local_store.verify(manifest)


def test_a_partial_hash_longer_than_the_file_is_ignored(local_store: Store) -> None:
    info = make_info()
    stage(local_store, info, {"pages-1.img": b"x" * 1000})
    bogus = Partial(offset=5000, hasher=xxhash.xxh3_128(b"y" * 5000))
    manifest = local_store.publish(info, "none", hashed={"pages-1.img": bogus})
    assert manifest.files[0].xxh3_128 == xxhash.xxh3_128(b"x" * 1000).hexdigest()


def test_only_where_it_saves_a_read(local_store: Store, memory_store: Store) -> None:
    info = make_info()
    local_store.staging_dir(info.id)
    memory_store.staging_dir(info.id)
    assert local_store.follow(info.id, "zstd") is None  # compressing reads every byte anyway
    assert memory_store.follow(info.id, "none") is None  # so does copying to a remote store
    tail = local_store.follow(info.id, "auto")
    assert tail is not None
    assert tail.finish() == {}


def test_a_vanished_directory_stops_nothing(tmp_path: Path) -> None:
    tail = TailHasher(tmp_path / "gone", writeback=True)
    time.sleep(0.02)
    assert tail.finish() == {}
    assert os.listdir(tmp_path) == []
