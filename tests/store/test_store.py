"""Publishing, listing, deleting and retention, on a local directory and on memory://."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import fsspec
import pytest

from stasis.errors import NotFoundError, StoreError, UsageError
from stasis.store import Store

from .helpers import SMALL_FILES, blake3_digest, make_info, stage


def test_publish_then_get_list_latest(store: Store) -> None:
    info = make_info(extra={"slurm_job_id": "1234"})
    stage(store, info, SMALL_FILES)
    manifest = store.publish(info)
    assert manifest.id == info.id
    assert manifest.compression == "none"
    assert {f.name for f in manifest.files} == set(SMALL_FILES)
    assert manifest.size_bytes == sum(len(d) for d in SMALL_FILES.values())
    by_name = {f.name: f for f in manifest.files}
    assert by_name["mm-1.img"].blake3 == blake3_digest(SMALL_FILES["mm-1.img"])
    assert manifest.extra == {"slurm_job_id": "1234"}
    assert store.get(info.id) == manifest
    assert store.list() == [manifest]
    assert store.latest("train", uid=1000) == manifest


def test_list_is_newest_first_and_filters_by_label(store: Store) -> None:
    published = []
    for minutes, label in [(0, "train"), (10, "eval"), (5, "train"), (20, "train")]:
        info = make_info(label, minutes=minutes)
        stage(store, info, {"core-1.img": os.urandom(10)})
        published.append(store.publish(info))
    ids = [m.id for m in store.list()]
    assert ids == sorted(ids, reverse=True)  # ids sort like their creation time
    assert [m.created.minute - 15 for m in store.list()] == [20, 10, 5, 0]
    assert [m.label for m in store.list("train")] == ["train"] * 3
    assert store.latest("train", uid=1000).id == published[3].id
    assert store.latest("eval", uid=1000).id == published[1].id


def test_same_time_sorts_by_publish_order(store: Store) -> None:
    # Same clock: the sequence numbers publish gives (test_order.py), whatever the ids' random
    # part says.
    infos = [make_info(minutes=1) for _ in range(3)]
    for info in infos:
        stage(store, info, {"a.img": b"x"})
        store.publish(info)
    assert [m.id for m in store.list()] == [i.id for i in reversed(infos)]
    assert [m.seq for m in store.list()] == [3, 2, 1]


def test_unknown_ids_and_labels(store: Store) -> None:
    with pytest.raises(
        NotFoundError, match=f"no checkpoint 20261130T001512Z-000000 in store {store.url}"
    ):
        store.get("20261130T001512Z-000000")
    with pytest.raises(
        NotFoundError,
        match=f"no checkpoint with label nothing owned by uid 1000 in store {store.url}",
    ):
        store.latest("nothing", uid=1000)
    with pytest.raises(NotFoundError):
        store.delete("20261130T001512Z-000000")
    assert store.list() == []


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "..", "/etc"])
def test_every_entry_point_validates_ids(store: Store, bad: str, tmp_path: Path) -> None:
    calls = [store.get, store.delete, store.staging_dir, store.discard]
    for call in calls:
        with pytest.raises(UsageError, match="invalid checkpoint id"):
            call(bad)
    with pytest.raises(UsageError, match="invalid checkpoint id"):
        with store.open_images(bad, tmp_path):
            pass


def test_bad_labels_are_usage_errors(store: Store) -> None:
    with pytest.raises(UsageError, match="invalid label"):
        store.list("../x")
    with pytest.raises(UsageError, match="invalid label"):
        store.latest("a/b", uid=0)


def test_delete_removes_everything(store: Store) -> None:
    info = make_info()
    stage(store, info, SMALL_FILES)
    store.publish(info)
    store.delete(info.id)
    assert store.list() == []
    with pytest.raises(NotFoundError):
        store.get(info.id)
    with pytest.raises(NotFoundError):
        store.delete(info.id)


def test_retention_keeps_newest_per_label(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "store"), staging_root=tmp_path / "staging", keep=2)
    other = make_info("other", minutes=-10)
    stage(store, other, {"a.img": b"o"})
    store.publish(other)
    infos = [make_info("train", minutes=m) for m in (0, 1, 2)]
    for info in infos:
        stage(store, info, {"a.img": b"t"})
        store.publish(info)
    assert [m.id for m in store.list("train")] == [infos[2].id, infos[1].id]
    assert not (tmp_path / "store" / infos[0].id).exists()
    assert [m.id for m in store.list("other")] == [other.id]
    # Lowering keep later and applying it by hand.
    tighter = Store(str(tmp_path / "store"), staging_root=tmp_path / "staging", keep=1)
    assert tighter.apply_retention("train") == [infos[1].id]
    assert tighter.apply_retention("train") == []
    assert (
        Store(str(tmp_path / "store"), staging_root=tmp_path, keep=0).apply_retention("train") == []
    )


def test_labels_and_retention_are_per_owner(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "store"), staging_root=tmp_path / "staging", keep=2)
    roots = make_info("shared", minutes=0, uid=0, user="root")
    stage(store, roots, {"a.img": b"r"})
    store.publish(roots)
    alices = [make_info("shared", minutes=m) for m in (1, 2, 3, 4, 5)]
    for info in alices:
        stage(store, info, {"a.img": b"a"})
        store.publish(info)
    # Five dumps of uid 1000 kept its own newest two and never touched root's.
    assert [m.id for m in store.list("shared", uid=0)] == [roots.id]
    assert [m.id for m in store.list("shared", uid=1000)] == [alices[4].id, alices[3].id]
    assert store.latest("shared", uid=0).id == roots.id
    with pytest.raises(NotFoundError):
        store.latest("shared", uid=1001)
    assert len(store.list("shared")) == 3  # all owners, for root's own view
    tighter = Store(str(tmp_path / "store"), staging_root=tmp_path / "staging", keep=1)
    assert tighter.apply_retention("shared", uid=0) == []
    assert tighter.apply_retention("shared") == [alices[3].id]  # each owner counted apart
    assert [m.id for m in store.list("shared")] == [alices[4].id, roots.id]


def test_retention_never_deletes_the_checkpoint_just_published(tmp_path: Path) -> None:
    # A node whose clock lags publishes an "older" checkpoint into a full label.
    store = Store(str(tmp_path / "store"), staging_root=tmp_path / "staging", keep=1)
    newer = make_info(minutes=60)
    stage(store, newer, {"a.img": b"n"})
    store.publish(newer)
    lagging = make_info(minutes=0)
    stage(store, lagging, {"a.img": b"l"})
    store.publish(lagging)
    assert store.get(lagging.id).id == lagging.id


def test_negative_keep_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        Store(str(tmp_path), staging_root=tmp_path, keep=-1)


def test_publish_without_staging_is_a_store_error(store: Store) -> None:
    with pytest.raises(StoreError, match="no staged images"):
        store.publish(make_info())


def test_publish_refuses_subdirectories_and_cleans_up(store: Store) -> None:
    info = make_info()
    staging = stage(store, info, {"a.img": b"a"})
    (staging / "sub").mkdir()
    with pytest.raises(StoreError, match="unexpected entry 'sub'"):
        store.publish(info)
    assert not staging.exists()
    assert store.list() == []


def test_publishing_an_existing_id_leaves_the_original_alone(store: Store) -> None:
    info = make_info()
    stage(store, info, {"a.img": b"first"})
    first = store.publish(info)
    staging = stage(store, info, {"a.img": b"second"})
    with pytest.raises(StoreError, match=f"checkpoint {info.id} already exists"):
        store.publish(info)
    assert not staging.exists()
    assert store.list() == [first]


def test_publish_unknown_compression(store: Store) -> None:
    info = make_info()
    stage(store, info, {"a.img": b"a"})
    with pytest.raises(UsageError, match="unknown compression"):
        store.publish(info, "gzip")  # type: ignore[arg-type]


def test_discard_removes_staging_and_tolerates_absence(store: Store) -> None:
    info = make_info()
    staging = stage(store, info, SMALL_FILES)
    store.discard(info.id)
    assert not staging.exists()
    store.discard(info.id)
    assert store.list() == []


def test_staging_dir_is_fresh_and_private(store: Store) -> None:
    info = make_info()
    staging = stage(store, info, SMALL_FILES)
    again = store.staging_dir(info.id)
    assert again == staging and list(again.iterdir()) == []
    assert stat.S_IMODE(again.stat().st_mode) == 0o700


def test_local_store_stages_inside_itself_and_publishes_by_rename(
    local_store: Store, tmp_path: Path
) -> None:
    info = make_info()
    staging = stage(local_store, info, {"pages-1.img": os.urandom(1000)})
    root = tmp_path / "store"
    assert staging.parent.parent == root
    inode = (staging / "pages-1.img").stat().st_ino
    local_store.publish(info)
    published = root / info.id / "pages-1.img"
    assert published.stat().st_ino == inode  # moved, not copied
    assert not staging.exists()
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    assert stat.S_IMODE((root / info.id).stat().st_mode) == 0o700
    for path in (root / info.id).iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in root.iterdir()) == [
        ".index",
        ".staging",
        ".stasis-store",
        info.id,
    ]
    assert stat.S_IMODE((root / ".index").stat().st_mode) == 0o700


def test_memory_store_stages_under_staging_root(memory_store: Store, tmp_path: Path) -> None:
    info = make_info()
    staging = stage(memory_store, info, SMALL_FILES)
    assert staging.parent == tmp_path / "staging"
    memory_store.publish(info, "zstd")
    assert not staging.exists()
    fs = fsspec.filesystem("memory")
    names = sorted(
        p.rsplit("/", 1)[1] for p in fs.ls(f"{memory_store.url}/{info.id}", detail=False)
    )
    assert names == ["core-1.img.zst", "empty.img.zst", "manifest.json", "mm-1.img.zst"]


def test_file_url_is_a_local_store(tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}/store", staging_root=tmp_path / "elsewhere", keep=0)
    info = make_info()
    staging = stage(store, info, SMALL_FILES)
    assert staging.is_relative_to(tmp_path / "store")
    store.publish(info)
    assert Store(str(tmp_path / "store"), staging_root=tmp_path, keep=0).get(info.id).id == info.id


def test_world_writable_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(0o777)
    store = Store(str(root), staging_root=tmp_path, keep=0)
    with pytest.raises(StoreError, match="writable by other users"):
        store.list()
    with pytest.raises(StoreError, match="writable by other users"):
        store.staging_dir(make_info().id)


def test_missing_root_lists_nothing(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "not-yet"), staging_root=tmp_path, keep=0)
    assert store.list() == []
    assert not (tmp_path / "not-yet").exists()


def test_bad_urls_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        Store("", staging_root=tmp_path)
    with pytest.raises(UsageError, match="cannot use checkpoint store"):
        Store("nosuchprotocol://x", staging_root=tmp_path)
