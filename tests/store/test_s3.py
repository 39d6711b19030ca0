"""The store on a real S3 server (SeaweedFS): publish, list, restore, the label index and its
paging, credentials and buckets that are wrong, and a server cut off mid-upload/-download."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from stasis.errors import NotFoundError, StoreError
from stasis.store import Store
from stasis.store.index import entry_name
from tests.faultproxy import CutProxy
from tests.s3server import REGION, S3Server
from tests.store.helpers import SMALL_FILES, make_info, stage


def options(s3: S3Server, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "key": s3.access_key,
        "secret": s3.secret_key,
        "client_kwargs": {"endpoint_url": endpoint or s3.endpoint, "region_name": REGION},
        "skip_instance_cache": True,
        **extra,
    }


def s3_store(s3: S3Server, url: str, tmp_path: Path, **kwargs: Any) -> Store:
    opts = kwargs.pop("options", None) or options(s3)
    return Store(
        url, staging_root=tmp_path / "staging", keep=kwargs.pop("keep", 0), options=opts, **kwargs
    )


def publish(
    store: Store,
    label: str = "train",
    minutes: int = 0,
    uid: int = 1000,
    files: dict[str, bytes] | None = None,
    compression: str = "none",
) -> str:
    info = make_info(label, minutes=minutes, uid=uid)
    stage(store, info, files or SMALL_FILES)
    store.publish(info, compression)  # type: ignore[arg-type]
    return info.id


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_publish_list_restore_delete(
    s3: S3Server, s3_bucket: str, tmp_path: Path, compression: str
) -> None:
    store = s3_store(s3, f"s3://{s3_bucket}/ckpt", tmp_path)
    pages = os.urandom(3 << 20)
    checkpoint_id = publish(
        store, files={**SMALL_FILES, "pages-1.img": pages}, compression=compression
    )
    # Another node's view: a store object of its own, nothing cached.
    other = s3_store(s3, f"s3://{s3_bucket}/ckpt", tmp_path / "other")
    assert [m.id for m in other.list()] == [checkpoint_id]
    with other.open_images(checkpoint_id, tmp_path / "scratch") as (manifest, images):
        assert (images / "pages-1.img").read_bytes() == pages
        assert manifest.compression == compression
    assert list((tmp_path / "scratch").iterdir()) == []
    # The manifest was written in place (S3 has no rename): no temporary object is left.
    fs = s3.filesystem()
    assert sorted(
        os.path.basename(p) for p in fs.ls(f"{s3_bucket}/ckpt/{checkpoint_id}")
    ) == sorted(["manifest.json", *(e.stored_name for e in manifest.files)])
    other.delete(checkpoint_id)
    assert store.list() == []
    assert not fs.exists(f"{s3_bucket}/ckpt/{checkpoint_id}")
    assert store._tree.index_list("train", 1000) == []


def test_latest_by_label_reads_the_index_not_every_manifest(
    s3: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    store = s3_store(s3, f"s3://{s3_bucket}/p", tmp_path)
    store.ensure_index()
    ids = [publish(store, "a", minutes=m) for m in range(3)]
    theirs = publish(store, "a", minutes=10, uid=2000)
    other_label = publish(store, "b", minutes=20)
    assert store.latest("a", uid=1000).id == ids[-1]
    assert store.latest("a", uid=2000).id == theirs
    assert [m.id for m in store.list("a", uid=1000)] == ids[::-1]
    assert {m.id for m in store.list("a")} == {*ids, theirs}
    assert store.latest("b", uid=1000).id == other_label
    with pytest.raises(NotFoundError):
        store.latest("c", uid=1000)
    # An entry is only a hint: one leading to a checkpoint of another label is ignored, one
    # leading nowhere (a publish under way or dead) too.
    store._tree.index_put("a", 1000, entry_name(make_info(minutes=99).created, other_label))
    store._tree.index_put(
        "a", 1000, entry_name(make_info(minutes=98).created, "20261130T020000Z-abcdef")
    )
    assert store.latest("a", uid=1000).id == ids[-1]


def test_retention_keeps_n_and_drops_by_age_but_never_the_newest(
    s3: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    store = s3_store(s3, f"s3://{s3_bucket}/r", tmp_path, keep=2)
    ids = [publish(store, minutes=m) for m in range(4)]
    assert [m.id for m in store.list("train", uid=1000)] == ids[:1:-1]
    # make_info's times are in 2026-11-30: long past for an age limit of a day.
    aged = s3_store(
        s3,
        f"s3://{s3_bucket}/r",
        tmp_path / "aged",
        keep=0,
        max_age_s=timedelta(days=1).total_seconds(),
    )
    assert aged.expire() == [ids[2]]
    assert [m.id for m in aged.list("train", uid=1000)] == [ids[3]]


def test_listings_page_through_more_than_1000_keys(
    s3: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    store = s3_store(s3, f"s3://{s3_bucket}/many", tmp_path)
    real = publish(store, minutes=5000)
    fs = s3.filesystem()
    # 1,010 directories without a manifest (as publishes under way look): listed as ids,
    # never as checkpoints.
    fake = [make_info(minutes=m).id for m in range(1010)]
    fs.pipe({f"{s3_bucket}/many/{i}/core-1.img": b"x" for i in fake})
    assert len(store._tree.ids()) == 1011
    assert [m.id for m in store.list()] == [real]
    # The same for index entries of one label: the newest is on the first page.
    for m in range(1010):
        store._tree.index_put("train", 1000, entry_name(make_info(minutes=m).created, fake[m]))
    store._tree.mark_index_ready()
    assert store.latest("train", uid=1000).id == real
    assert len(store._tree.index_list("train", 1000)) == 1011


def test_wrong_credentials_are_one_clear_line(s3: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    bad = s3_store(
        s3, f"s3://{s3_bucket}/x", tmp_path, options={**options(s3), "secret": "not-the-secret"}
    )
    with pytest.raises(StoreError) as listing:
        bad.list()
    message = str(listing.value)
    assert message.startswith(
        f"cannot list checkpoints in s3://{s3_bucket}/x: access to " f"s3://{s3_bucket}/x denied"
    )
    assert "check the S3 credentials" in message and "\n" not in message
    assert "not-the-secret" not in message
    info = make_info()
    stage(bad, info, SMALL_FILES)
    with pytest.raises(StoreError, match="check the S3 credentials"):
        bad.publish(info)
    good = s3_store(s3, f"s3://{s3_bucket}/x", tmp_path / "good")
    assert good.list() == []


def test_missing_bucket_is_named(s3: S3Server, tmp_path: Path) -> None:
    store = s3_store(s3, "s3://no-such-bucket-here/x", tmp_path)
    with pytest.raises(
        StoreError,
        match="bucket no-such-bucket-here of checkpoint store "
        "s3://no-such-bucket-here/x does not exist",
    ):
        store.list()
    info = make_info()
    stage(store, info, SMALL_FILES)
    with pytest.raises(
        StoreError,
        match="no-such-bucket-here of checkpoint store s3://no-such-bucket-here/x does not exist: create it",
    ):
        store.publish(info)
    # Publishing must never have created it.
    assert not s3.filesystem().exists("no-such-bucket-here")


def test_server_cut_off_mid_upload_publishes_nothing_and_gc_cleans_up(
    s3: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    url = f"s3://{s3_bucket}/cut"
    with CutProxy(("127.0.0.1", s3.port)) as proxy:
        store = s3_store(
            s3, url, tmp_path, options=options(s3, proxy.endpoint, default_block_size=5 << 20)
        )
        info = make_info()
        stage(store, info, {**SMALL_FILES, "pages-1.img": os.urandom(24 << 20)})
        proxy.cut_after(upload=12 << 20)
        started = time.monotonic()
        with pytest.raises(StoreError) as caught:
            store.publish(info)
        assert time.monotonic() - started < 60
        assert str(caught.value).startswith(f"cannot write checkpoint {info.id} to {url}: ")
        assert "\n" not in str(caught.value)
        assert not store.staging_dir(info.id).exists() or True
        proxy.heal()
        # Nothing listed, by this node or another; the parts uploaded before the cut may stay
        # (the server was gone when the publish tried to remove them): gc removes them.
        other = s3_store(s3, url, tmp_path / "other")
        assert other.list() == []
        with pytest.raises(NotFoundError):
            other.latest("train", uid=1000)
        report = other.gc(idle_s=0)
        assert other._tree.abandoned_uploads(0) == []  # type: ignore[attr-defined]
        assert other._tree.ids() == []
        assert other._tree.index_list("train", 1000) == []
        assert report.uploads or report.partial or report.entries_removed
        # And the store works again.
        checkpoint_id = publish(other)
        assert other.latest("train", uid=1000).id == checkpoint_id


def test_server_cut_off_mid_download_restores_nothing(
    s3: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    url = f"s3://{s3_bucket}/down"
    writer = s3_store(s3, url, tmp_path)
    checkpoint_id = publish(writer, files={**SMALL_FILES, "pages-1.img": os.urandom(16 << 20)})
    with CutProxy(("127.0.0.1", s3.port)) as proxy:
        reader = s3_store(s3, url, tmp_path / "r", options=options(s3, proxy.endpoint))
        reader.get(checkpoint_id)
        proxy.cut_after(download=6 << 20)
        scratch = tmp_path / "scratch"
        with pytest.raises(StoreError) as caught:
            with reader.open_images(checkpoint_id, scratch):
                pytest.fail("images handed out from a partial download")
        assert str(caught.value).startswith(f"cannot read checkpoint {checkpoint_id} from {url}")
        assert list(scratch.iterdir()) == []


def test_ensure_index_adopts_checkpoints_written_without_one(
    s3: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    store = s3_store(s3, f"s3://{s3_bucket}/old", tmp_path)
    ids = [publish(store, minutes=m) for m in range(2)]
    fs = s3.filesystem()
    fs.rm(f"{s3_bucket}/old/.index", recursive=True)  # as a stasis without an index wrote it
    assert not store._tree.index_ready()
    assert store.latest("train", uid=1000).id == ids[1]  # by reading every manifest
    assert store.ensure_index() == 2
    assert store.ensure_index() == 0
    assert [e.checkpoint_id for e in store._tree.index_list("train", 1000)] == ids[::-1]


def test_gc_leaves_a_publish_under_way_alone(s3: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    store = s3_store(s3, f"s3://{s3_bucket}/gc", tmp_path)
    done = publish(store)
    fs = s3.filesystem()
    young = make_info(minutes=1).id
    fs.pipe_file(f"{s3_bucket}/gc/{young}/core-1.img", b"x")
    report = store.gc()  # default idle time: an hour
    assert report.partial == [] and fs.exists(f"{s3_bucket}/gc/{young}/core-1.img")
    assert store.gc(idle_s=0).partial == [young]
    assert [m.id for m in store.list()] == [done]
