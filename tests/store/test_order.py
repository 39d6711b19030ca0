"""A label's order follows lineage and publish order, not the dumping nodes' clocks (issue 28):
a node whose clock runs ahead must not make its older checkpoint the "newest", nor have the
newer ones of correct nodes rotated out first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stasis.store import Store
from stasis.store.index import entry_name
from tests.store.helpers import SMALL_FILES, make_info, signed, stage


def publish(store: Store, minutes: int, **fields: object) -> str:
    info = make_info("train", minutes=minutes, **fields)
    stage(store, info, SMALL_FILES)
    return store.publish(info).id


@pytest.fixture(params=["scan", "index"])
def ordered(request: pytest.FixtureRequest, store: Store) -> Store:
    """Each store both ways: every manifest read, and the label index (index.py)."""
    if request.param == "index":
        store.ensure_index()
    return store


def test_a_child_is_newer_than_its_parent_whatever_the_clocks(ordered: Store) -> None:
    store = ordered
    # The job ran on a node two days ahead; it was restored on a correct node and dumped again.
    skewed = publish(store, minutes=2 * 24 * 60, host="fast-clock")
    child = publish(store, minutes=5, host="correct", parent=skewed)
    assert store.latest("train", uid=1000).id == child
    assert [m.id for m in store.list("train", uid=1000)] == [child, skewed]
    assert store.get(child).parent == skewed
    assert store.get(child).seq == store.get(skewed).seq + 1  # type: ignore[operator]


def test_retention_rotates_out_the_skewed_old_one_first(ordered: Store) -> None:
    store = ordered
    store.keep = 2
    skewed = publish(store, minutes=2 * 24 * 60, host="fast-clock")
    first = publish(store, minutes=5, parent=skewed)
    second = publish(store, minutes=10, parent=first)
    assert [m.id for m in store.list("train", uid=1000)] == [second, first]
    assert not store.exists(skewed)


def test_unrelated_ones_follow_publish_order_before_clocks(ordered: Store) -> None:
    store = ordered
    # Two first runs of the label (no parent): the one published later is newer, even from a
    # node whose clock is behind.
    publish(store, minutes=60)
    behind = publish(store, minutes=0)
    assert store.latest("train", uid=1000).id == behind
    assert store.get(behind).seq == 2


def test_the_sequence_is_signed(local_store: Store, tmp_path: Path) -> None:
    checkpoint_id = publish(local_store, minutes=0)
    path = tmp_path / "store" / checkpoint_id / "manifest.json"
    document = json.loads(path.read_bytes())
    document["seq"] = 99
    path.write_text(json.dumps(document))
    assert local_store.list() == []  # a changed sequence number breaks the signature


@pytest.mark.parametrize("indexed", [False, True])
def test_manifests_written_before_sequences_still_order_by_clock(
    local_store: Store, tmp_path: Path, indexed: bool
) -> None:
    if indexed:
        local_store.ensure_index()
    # What an older stasis wrote: no parent, no seq in the signed document, a clock-named entry.
    old = []
    for minutes in (0, 30):
        info = make_info("train", minutes=minutes)
        stage(local_store, info, SMALL_FILES)
        manifest = local_store.publish(info)
        legacy = json.loads(signed(local_store, manifest))
        for field in ("parent", "seq"):
            legacy.pop(field, None)
        body = {k: v for k, v in legacy.items() if k != "signature"}
        legacy["signature"] = json.loads(local_store.keys.sign("manifest", body).model_dump_json())
        (tmp_path / "store" / info.id / "manifest.json").write_text(json.dumps(legacy))
        index = tmp_path / "store" / ".index" / "train" / "1000"
        for entry in index.iterdir():
            if entry.name.endswith(info.id):
                entry.rename(index / entry_name(info.created, info.id))
        old.append(info.id)
    assert [m.id for m in local_store.list("train", uid=1000)] == old[::-1]
    assert local_store.latest("train", uid=1000).id == old[1]
    # A new one is numbered above them, whatever its clock says.
    new = publish(local_store, minutes=-60)
    assert local_store.latest("train", uid=1000).id == new
    assert local_store.get(new).seq == 1
