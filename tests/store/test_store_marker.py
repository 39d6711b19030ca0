"""A local store that this node used and that is now missing or an empty mount point reads as
"cannot tell" (StoreError), never as a store without checkpoints (issue 28; marker.py).

An unmounted filesystem is played with real mounts: a tmpfs mounted over the store's directory
hides the store exactly as an NFS export not mounted on its mount point leaves it empty; a
store moved away plays a missing directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stasis.errors import NotFoundError, StoreError
from stasis.store import Store
from stasis.store.marker import MARKER_NAME, KnownStores, read_marker

from .helpers import SMALL_FILES, make_info, stage


def node_store(tmp_path: Path, root: Path | None = None) -> Store:
    """The store as a node's daemon opens it: with its memory of the stores it used."""
    return Store(
        str(root or tmp_path / "store"),
        staging_root=tmp_path / "staging",
        keep=0,
        known_stores=tmp_path / "state" / "stores",
    )


def publish(store: Store, label: str = "train", minutes: int = 0) -> str:
    info = make_info(label, minutes=minutes)
    stage(store, info, SMALL_FILES)
    return store.publish(info).id


@contextmanager
def unmounted(root: Path) -> Iterator[None]:
    """`root` as an empty mount point: the store's filesystem is not there (a tmpfs over it,
    root-owned 0755 as a mount point is)."""
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "mode=0755,size=1m", "stasis-test", str(root)], check=True
    )
    try:
        yield
    finally:
        subprocess.run(["umount", str(root)], check=True)


def test_a_store_this_node_used_cannot_vanish_behind_an_empty_mount_point(tmp_path: Path) -> None:
    store = node_store(tmp_path)
    kept = publish(store)
    with unmounted(tmp_path / "store"):
        # A fresh process of this node (Slurm's task start, the daemon restarted).
        again = node_store(tmp_path)
        for ask in (
            again.list,
            lambda: again.list("train", uid=1000),
            lambda: again.latest("train", uid=1000),
            lambda: again.get(kept),
            lambda: again.exists(kept),
            again.ensure_index,
            again.gc,
            again.expire,
        ):
            with pytest.raises(StoreError) as e:
                ask()
            assert not isinstance(e.value, NotFoundError), e.value
            said = str(e.value)
            assert "\n" not in said
            assert "mounted?" in said and str(tmp_path / "store") in said, said
        # Nothing is written onto the disk under the mount point either.
        info = make_info(minutes=5)
        with pytest.raises(StoreError, match="mounted"):
            again.staging_dir(info.id)
        assert os.listdir(tmp_path / "store") == []
    # The filesystem back: the same checkpoint, from the same process.
    assert [m.id for m in again.list("train", uid=1000)] == [kept]
    assert again.latest("train", uid=1000).id == kept


def test_a_missing_store_directory_is_not_created_by_a_read_and_not_taken_for_empty(
    tmp_path: Path,
) -> None:
    store = node_store(tmp_path)
    kept = publish(store)
    os.rename(tmp_path / "store", tmp_path / "away")
    with pytest.raises(StoreError, match="is missing: is its filesystem mounted"):
        store.latest("train", uid=1000)
    with pytest.raises(StoreError, match="mounted"):
        store.publish(make_info(minutes=1))
    with pytest.raises(StoreError, match="mounted"):
        store.staging_dir(make_info(minutes=1).id)
    assert not (tmp_path / "store").exists()
    os.rename(tmp_path / "away", tmp_path / "store")
    assert store.latest("train", uid=1000).id == kept


def test_a_new_store_starts_at_its_first_publish_and_a_read_creates_nothing(tmp_path: Path) -> None:
    store = node_store(tmp_path)
    assert store.list() == []  # never used here: empty, truly
    with pytest.raises(NotFoundError):
        store.latest("train", uid=1000)
    store.ensure_index()
    store.gc()
    assert not (tmp_path / "store").exists()
    assert not (tmp_path / "state" / "stores").exists()
    publish(store)
    store_id = read_marker(tmp_path / "store")
    assert store_id is not None
    assert KnownStores(tmp_path / "state" / "stores").get(tmp_path / "store") == store_id
    entry = KnownStores(tmp_path / "state" / "stores").entry(tmp_path / "store")
    assert entry.stat().st_mode & 0o077 == 0
    assert json.loads(entry.read_text()) == {"path": str(tmp_path / "store"), "store_id": store_id}


def test_an_empty_directory_this_node_never_used_stays_unmarked_when_read(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    store = node_store(tmp_path)
    assert store.list() == []
    store.ensure_index()
    assert os.listdir(tmp_path / "store") == []


def test_a_store_from_before_markers_is_marked_when_first_seen(tmp_path: Path) -> None:
    # Written without a node memory (as an older stasis did), then its marker gone.
    plain = Store(str(tmp_path / "store"), staging_root=tmp_path / "staging", keep=0)
    kept = publish(plain)
    os.unlink(tmp_path / "store" / MARKER_NAME)
    store = node_store(tmp_path)
    assert [m.id for m in store.list()] == [kept]
    store_id = read_marker(tmp_path / "store")
    assert store_id is not None
    assert KnownStores(tmp_path / "state" / "stores").get(tmp_path / "store") == store_id
    # From now on this node tells an unmounted store from an empty one.
    with unmounted(tmp_path / "store"):
        with pytest.raises(StoreError, match="mounted"):
            store.list()


def test_another_store_mounted_in_its_place_is_used_and_remembered(tmp_path: Path) -> None:
    store = node_store(tmp_path)
    publish(store)
    first = read_marker(tmp_path / "store")
    shutil.rmtree(tmp_path / "store")
    other = Store(str(tmp_path / "store"), staging_root=tmp_path / "staging", keep=0)
    other_id = publish(other)
    second = read_marker(tmp_path / "store")
    assert second is not None and second != first
    assert [m.id for m in store.list()] == [other_id]
    assert KnownStores(tmp_path / "state" / "stores").get(tmp_path / "store") == second


def test_root_starts_a_store_anew_by_removing_the_node_memory_the_error_names(
    tmp_path: Path,
) -> None:
    store = node_store(tmp_path)
    publish(store)
    shutil.rmtree(tmp_path / "store")
    with pytest.raises(StoreError) as e:
        store.list()
    entry = KnownStores(tmp_path / "state" / "stores").entry(tmp_path / "store")
    assert f"`rm {entry}`" in str(e.value)
    entry.unlink()
    assert store.list() == []
    fresh = publish(store)
    assert [m.id for m in store.list()] == [fresh]


def test_a_hostile_marker_is_refused_not_taken_for_a_store(tmp_path: Path) -> None:
    store = node_store(tmp_path)
    publish(store)
    (tmp_path / "store" / MARKER_NAME).write_bytes(b"x" * 100_000)
    with pytest.raises(StoreError, match="not one stasis wrote"):
        store.list()
    os.unlink(tmp_path / "store" / MARKER_NAME)
    os.symlink("/etc/hostname", tmp_path / "store" / MARKER_NAME)
    with pytest.raises(StoreError, match=MARKER_NAME):
        store.list()


def test_a_node_that_never_used_the_store_tells_it_unmounted_by_the_configured_store_id(
    tmp_path: Path,
) -> None:
    store = node_store(tmp_path)
    kept = publish(store)
    store_id = read_marker(tmp_path / "store")
    assert store_id is not None

    def new_node(name: str, expected: str = "") -> Store:
        # A node that never used the store: a state directory of its own.
        return Store(
            str(tmp_path / "store"),
            staging_root=tmp_path / f"{name}-staging",
            keep=0,
            known_stores=tmp_path / name / "stores",
            store_id=expected,
        )

    assert [m.id for m in new_node("b", store_id).list()] == [kept]
    with unmounted(tmp_path / "store"):
        # Without the setting a node that never saw the store cannot tell: it reads empty.
        assert new_node("c").list() == []
        with pytest.raises(StoreError, match="mounted.*store_id says it is store " + store_id):
            new_node("d", store_id).latest("train", uid=1000)
        with pytest.raises(StoreError, match="mounted"):
            new_node("e", store_id).staging_dir(make_info(minutes=3).id)
        assert os.listdir(tmp_path / "store") == []
    # Another store mounted there is not the one the site named.
    with pytest.raises(StoreError, match=f"is store {store_id}: is its filesystem mounted"):
        new_node("f", "0" * 32).list()


def test_a_store_id_setting_that_is_not_one_is_refused_in_one_line() -> None:
    from stasis.config import load_settings
    from stasis.errors import UsageError

    with pytest.raises(UsageError, match="bad setting 'store_id'.*32 hex digits"):
        load_settings({"STASIS_CONFIG": "/dev/null", "STASIS_STORE_ID": "../../etc"})
    good = "ab" * 16
    assert load_settings({"STASIS_CONFIG": "/dev/null", "STASIS_STORE_ID": good}).store_id == good
