"""Encryption at rest: what is stored is sealed, opens only with the right key, and any damage,
swap or cut is caught before anything is restored; rotation re-wraps keys, never images."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from stasis.errors import CorruptCheckpointError, EncryptionKeyError, StoreError, UsageError
from stasis.store import Manifest, Store
from stasis.store.chunked import CHUNK_BYTES
from stasis.store.crypt import encryption_key_id, read_key_file
from stasis.store.manifest import Compression, CompressionRequest
from tests.store.helpers import (
    encrypted_store,
    make_info,
    stage,
    stored_bytes,
    stored_file,
    with_keys,
    write_key,
)

MARKER = b"plaintext-marker-" * 64
# 2.5 chunks of recognisable text, plus some random memory.
PAGES = (MARKER * (CHUNK_BYTES // len(MARKER) + 1))[: 2 * CHUNK_BYTES + CHUNK_BYTES // 2]
FILES = {
    "pages-1.img": PAGES,
    "pages-2.img": os.urandom(3 * CHUNK_BYTES),
    "core-1.img": MARKER,
    "empty.img": b"",
}


def _publish(
    store: Store,
    compression: CompressionRequest = "none",
    files: dict[str, bytes] = FILES,
    encrypt: bool = True,
) -> Manifest:
    info = make_info()
    stage(store, info, files)
    return store.publish(
        info, compression, data_key=store.new_data_key(info.id) if encrypt else None
    )


def _restored(store: Store, manifest: Manifest, scratch: Path) -> dict[str, bytes]:
    with store.open_images(manifest.id, scratch) as (_, images):
        return {p.name: p.read_bytes() for p in images.iterdir()}


@pytest.mark.parametrize("compression", ["none", "zstd", "lz4"])
def test_sealed_at_rest_and_restored_exactly(
    store: Store, tmp_path: Path, compression: Compression
) -> None:
    store = encrypted_store(store, tmp_path)
    manifest = _publish(store, compression)
    assert manifest.encryption is not None
    assert manifest.encryption.key_id == read_key_file(str(tmp_path / "current.key")).key_id
    key = (tmp_path / "current.key").read_bytes()
    text = store._tree.read_manifest(manifest.id)
    # No key, and no checksum of plain bytes, in the manifest.
    assert key.hex().encode() not in text and base64.b64encode(key) not in text
    for entry in manifest.files:
        assert entry.chunks is not None and entry.chunks.xxh3_64 is None
        assert entry.stored_name.endswith(".enc")
        data = stored_bytes(store, manifest, entry.name)
        assert MARKER[:32] not in data
        assert len(data) == entry.stored_size_bytes
    pages = next(f for f in manifest.files if f.name == "pages-2.img")
    if compression == "none":
        assert pages.stored_size_bytes == 3 * CHUNK_BYTES  # sealed in place: as long
    assert _restored(store, manifest, tmp_path / "scratch") == FILES
    assert os.listdir(tmp_path / "scratch") == []
    store.verify(manifest)


def test_plain_staged_files_do_not_stay(local_store: Store, tmp_path: Path) -> None:
    store = encrypted_store(local_store, tmp_path)
    manifest = _publish(store)
    root = tmp_path / "store"
    for path in root.rglob("*"):
        if path.is_file() and path.name != "manifest.json":
            assert MARKER[:32] not in path.read_bytes(), path
    assert sorted(os.listdir(root / ".staging")) == []
    assert sorted(os.listdir(root / manifest.id)) == sorted(
        [f.stored_name for f in manifest.files] + ["manifest.json"]
    )


def test_without_a_key_file_encryption_is_refused_before_anything(local_store: Store) -> None:
    with pytest.raises(UsageError, match="set encryption_key_file"):
        local_store.new_data_key(make_info().id)


def test_restore_needs_the_key_it_was_sealed_with(store: Store, tmp_path: Path) -> None:
    manifest = _publish(encrypted_store(store, tmp_path))
    assert manifest.encryption is not None
    needed = manifest.encryption.key_id
    scratch = tmp_path / "scratch"
    other = write_key(tmp_path / "other.key")
    for node in (with_keys(store, None), with_keys(store, other)):
        with pytest.raises(EncryptionKeyError, match=f"encrypted with key {needed} and") as e:
            _restored(node, manifest, scratch)
        assert "\n" not in str(e.value)
        with pytest.raises(EncryptionKeyError):
            node.read_range(manifest, "pages-1.img", 0, 10)
        assert not scratch.exists() or os.listdir(scratch) == []
    # Its id was named; the key itself never is.
    assert encryption_key_id((tmp_path / "other.key").read_bytes()) in str(e.value)


def _flip(data: bytearray, at: int) -> None:
    data[at] ^= 0x40


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "swap", "move", "cut"])
def test_damage_is_caught_before_anything_is_restored(
    store: Store, tmp_path: Path, compression: Compression, damage: str
) -> None:
    store = encrypted_store(store, tmp_path)
    manifest = _publish(store, compression)
    pages = next(f for f in manifest.files if f.name == "pages-2.img")
    assert pages.chunks is not None
    offsets = pages.chunks.offsets
    with stored_file(store, manifest, "pages-2.img") as f:
        data = bytearray(f.getvalue())
        if damage == "flip":  # in the middle of chunk 1
            _flip(data, (offsets[1] + offsets[2]) // 2)
        elif damage == "truncate":
            del data[-1:]
        elif damage == "swap":  # chunks 0 and 1 trade places (same sizes when uncompressed)
            a, b = bytes(data[offsets[0] : offsets[1]]), bytes(data[offsets[1] : offsets[2]])
            data[offsets[0] : offsets[2]] = b + a
        elif damage == "move":  # chunk 0 of another file of the checkpoint put here
            other = stored_bytes(store, manifest, "pages-1.img")
            data[offsets[0] : offsets[1]] = other[: offsets[1]]
        else:  # the last chunk cut off, the one before it stored twice in its place
            data[offsets[2] :] = data[offsets[1] : offsets[2]]
        f.seek(0)
        f.truncate()
        f.write(data)
    scratch = tmp_path / "scratch"
    with pytest.raises(CorruptCheckpointError, match="pages-2.img") as e:
        _restored(store, manifest, scratch)
    assert "\n" not in str(e.value)
    assert os.listdir(scratch) == []


def _digests(root: Path, manifest: Manifest) -> dict[str, str]:
    return {
        f.stored_name: hashlib.sha256((root / manifest.id / f.stored_name).read_bytes()).hexdigest()
        for f in manifest.files
    }


def test_rekey_rewraps_without_touching_images(local_store: Store, tmp_path: Path) -> None:
    old_key = write_key(tmp_path / "old.key")
    new_key = write_key(tmp_path / "new.key")
    before = with_keys(local_store, old_key)
    manifest = _publish(before)
    plain = _publish(local_store, files={"core-1.img": b"in the clear"}, encrypt=False)
    images = _digests(tmp_path / "store", manifest)

    rotated = with_keys(local_store, new_key, old_key)
    result = rotated.rekey()
    assert result.rekeyed == [manifest.id] and result.current == 0
    assert _digests(tmp_path / "store", manifest) == images  # not one image rewritten
    after = rotated.get(manifest.id)  # re-signed: still trusted
    assert after.encryption is not None
    assert after.encryption.key_id == read_key_file(str(new_key)).key_id
    assert after.model_dump(exclude={"encryption", "signature"}) == manifest.model_dump(
        exclude={"encryption", "signature"}
    )
    assert rotated.get(plain.id).encryption is None

    # The new key alone opens it now; the old one alone no longer does.
    assert _restored(with_keys(local_store, new_key), after, tmp_path / "s1") == FILES
    with pytest.raises(EncryptionKeyError, match=after.encryption.key_id):
        _restored(before, after, tmp_path / "s2")
    again = rotated.rekey()
    assert again.rekeyed == [] and again.current == 1

    # A checkpoint whose key is not configured is counted, and left as it is.
    orphan = _publish(with_keys(local_store, write_key(tmp_path / "lost.key")))
    assert with_keys(local_store, new_key).rekey().unknown_key == 1
    assert local_store.get(orphan.id) == orphan


def test_key_files(tmp_path: Path) -> None:
    raw = os.urandom(32)
    as_base64 = write_key(tmp_path / "b64.key", base64.b64encode(raw) + b"\n")
    assert read_key_file(str(as_base64)).secret == raw
    assert read_key_file(str(write_key(tmp_path / "raw.key", raw))).key_id == encryption_key_id(raw)
    # Not the id signing would give the same bytes.
    from stasis.store.signing import key_id

    assert encryption_key_id(raw) != key_id(raw)
    loose = write_key(tmp_path / "loose.key", mode=0o644)
    with pytest.raises(UsageError, match=f"chmod 600 {loose}"):
        read_key_file(str(loose))
    for wrong in (b"short", os.urandom(33), b"x" * 44):
        with pytest.raises(UsageError, match="holds no key"):
            read_key_file(str(write_key(tmp_path / "wrong.key", wrong)))
    with pytest.raises(UsageError, match="does not exist"):
        read_key_file(str(tmp_path / "nothing.key"))
    assert repr(read_key_file(str(as_base64))).count(raw.hex()) == 0


def _write_slowly(path: Path, data: bytes, pieces: int) -> None:
    step = len(data) // pieces + 1
    with open(path, "wb", buffering=0) as f:
        for offset in range(0, len(data), step):
            f.write(data[offset : offset + step])
            time.sleep(0.005)


@pytest.mark.parametrize("compression", ["none", "zstd", "auto"])
def test_sealed_while_criu_writes(
    local_store: Store, tmp_path: Path, compression: CompressionRequest
) -> None:
    store = encrypted_store(local_store, tmp_path)
    info = make_info()
    staging = store.staging_dir(info.id)
    data_key = store.new_data_key(info.id)
    tail = store.follow(info.id, compression, data_key)
    assert tail is not None
    files = {"pages-1.img": PAGES, "pages-2.img": FILES["pages-2.img"]}
    writers = [
        threading.Thread(target=_write_slowly, args=(staging / n, d, 20)) for n, d in files.items()
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    (staging / "core-1.img").write_bytes(MARKER)
    hashed = tail.finish()
    # It sealed while following (whole chunks only), into the files the store keeps.
    assert all(p.output is not None and p.offset % CHUNK_BYTES == 0 for p in hashed.values())
    assert hashed["pages-2.img"].offset > 0
    settled = tail.compression or "none"
    manifest = store.publish(info, settled, hashed=hashed, data_key=data_key)
    assert manifest.encryption == data_key.encryption
    assert _restored(store, manifest, tmp_path / "scratch") == {**files, "core-1.img": MARKER}
    shutil.rmtree(tmp_path / "scratch")
    assert os.listdir(tmp_path / "store" / ".staging") == []


def _follow_and_write(
    store: Store, files: dict[str, bytes]
) -> tuple[Manifest, dict[str, int], Path]:
    """Stage `files` as CRIU would, followed and sealed in place; return what publish made,
    the staged files' inode numbers, and the staging directory."""
    info = make_info()
    staging = store.staging_dir(info.id)
    data_key = store.new_data_key(info.id)
    tail = store.follow(info.id, "none", data_key)
    assert tail is not None
    for name, data in files.items():
        _write_slowly(staging / name, data, 20)
    inodes = {n: os.stat(staging / n).st_ino for n in files}
    hashed = tail.finish()
    assert hashed["pages-2.img"].offset > 0  # sealed while written
    return store.publish(info, "none", hashed=hashed, data_key=data_key), inodes, staging


def test_uncompressed_images_are_sealed_in_place(local_store: Store, tmp_path: Path) -> None:
    store = encrypted_store(local_store, tmp_path)
    files = {"pages-1.img": PAGES, "pages-2.img": FILES["pages-2.img"]}
    manifest, inodes, staging = _follow_and_write(store, files)
    root = tmp_path / "store"
    for entry in manifest.files:
        path = root / manifest.id / entry.stored_name
        # The very file CRIU wrote, renamed: no second copy was made.
        assert os.stat(path).st_ino == inodes[entry.name]
        sealed = path.read_bytes()
        plain = files[entry.name]
        assert len(sealed) == len(plain) == entry.stored_size_bytes
        # Not one page of it is left as it was (equal bytes by chance: ~1 in 256).
        for at in range(0, len(plain), 4096):
            assert sealed[at : at + 4096] != plain[at : at + 4096], (entry.name, at)
        same = sum(a == b for a, b in zip(sealed[:65536], plain[:65536]))
        assert same < 65536 // 100
        assert entry.chunks is not None and entry.chunks.seals is not None
        assert len(entry.chunks.seals) == len(entry.chunks.stored_bytes)
    assert os.listdir(root / ".staging") == [] and not staging.exists()
    assert _restored(store, manifest, tmp_path / "scratch") == files
    # A flipped byte in a chunk sealed in place is caught, by range and by a full restore.
    with open(root / manifest.id / "pages-2.img.enc", "r+b") as f:
        f.seek(CHUNK_BYTES + 5)
        byte = f.read(1)
        f.seek(CHUNK_BYTES + 5)
        f.write(bytes([byte[0] ^ 1]))
    assert store.read_range(manifest, "pages-2.img", 0, 100) == files["pages-2.img"][:100]
    with pytest.raises(CorruptCheckpointError, match="pages-2.img.*chunk 1"):
        store.read_range(manifest, "pages-2.img", CHUNK_BYTES, 100)
    with pytest.raises(CorruptCheckpointError, match="pages-2.img"):
        _restored(store, manifest, tmp_path / "scratch2")


def test_a_file_sealed_in_part_is_never_published(local_store: Store, tmp_path: Path) -> None:
    store = encrypted_store(local_store, tmp_path)
    info = make_info()
    staging = store.staging_dir(info.id)
    data_key = store.new_data_key(info.id)
    tail = store.follow(info.id, "none", data_key)
    assert tail is not None
    _write_slowly(staging / "pages-1.img", FILES["pages-2.img"], 20)
    hashed = tail.finish()
    # What a follower that failed after sealing some chunks leaves: the seals are gone.
    hashed["pages-1.img"].discard()
    assert hashed["pages-1.img"].spoiled
    with pytest.raises(StoreError, match="pages-1.img was sealed in part") as e:
        store.publish(info, "none", hashed=hashed, data_key=data_key)
    assert "\n" not in str(e.value)
    assert store.list() == [] and not staging.exists()
    assert not (tmp_path / "store" / info.id).exists()
    assert os.listdir(tmp_path / "store" / ".staging") == []


def test_decrypted_images_go_to_memory_and_go(local_store: Store, tmp_path: Path) -> None:
    from stasis.store.reader import MEMORY_SCRATCH

    if not MEMORY_SCRATCH.is_dir():
        pytest.skip(f"no {MEMORY_SCRATCH} here")
    store = encrypted_store(local_store, tmp_path)
    manifest = _publish(store)
    with store.open_images(manifest.id, tmp_path / "scratch") as (_, images):
        # Plain pages of an encrypted checkpoint: in memory, never in the scratch on disk.
        assert images.parent == MEMORY_SCRATCH and manifest.id in images.name
        assert (images / "pages-1.img").read_bytes() == PAGES
        assert os.stat(images).st_mode & 0o777 == 0o700
    assert not images.exists()
    assert os.listdir(tmp_path / "scratch") == []


def test_an_encrypted_checkpoint_of_format_2_still_restores(
    local_store: Store, tmp_path: Path
) -> None:
    """Before BLAKE3 (format 2) an encrypted checkpoint's chunks were already each sealed with
    AES-GCM under a key no store writer has: still restored, unlike a plain one of then."""
    import json

    import xxhash

    from stasis.store.store import MANIFEST_PURPOSE

    store = encrypted_store(local_store, tmp_path)
    manifest = _publish(store, "zstd")
    path = tmp_path / "store" / manifest.id / "manifest.json"
    document = json.loads(path.read_text())
    document["format"] = 2
    del document["signature"]
    for entry in document["files"]:
        del entry["blake3"]
        entry["xxh3_128"] = xxhash.xxh3_128_hexdigest(stored_bytes(store, manifest, entry["name"]))
    document["signature"] = store.keys.sign(MANIFEST_PURPOSE, document).model_dump()
    path.write_text(json.dumps(document))
    old = store.get(manifest.id)
    assert old.format == 2 and old.has_cryptographic_sums
    assert _restored(store, old, tmp_path / "scratch") == FILES
