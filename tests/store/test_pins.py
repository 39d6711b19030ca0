"""A checkpoint being restored is pinned (`Store.pin`): retention, from this node or another
sharing the store, leaves it alone until the pin is released or its node died (issue 28)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from stasis.errors import NotFoundError
from stasis.store import Store
from stasis.store import catalog as store_module
from tests.store.helpers import SMALL_FILES, make_info, stage


def publish(store: Store, minutes: int) -> str:
    info = make_info("train", minutes=minutes)
    stage(store, info, SMALL_FILES)
    return store.publish(info).id


def test_retention_skips_a_pinned_checkpoint_until_it_is_released(store: Store) -> None:
    store.keep = 1
    oldest = publish(store, 0)
    with store.pin(oldest, "restore of job-1"):
        newer = publish(store, 5)  # its retention would delete `oldest`
        assert store.pinned(oldest)
        assert store.exists(oldest)
        assert store.apply_retention("train") == []
        assert store.expire() == []
    assert not store.pinned(oldest)
    assert store.apply_retention("train") == [oldest]
    assert [m.id for m in store.list()] == [newer]


def test_another_node_sees_the_pin(local_store: Store, tmp_path: Path) -> None:
    oldest = publish(local_store, 0)
    other = Store(local_store.url, staging_root=tmp_path / "other", keep=1, keys=local_store.keys)
    with local_store.pin(oldest, "restore"):
        publish(other, 5)
        assert other.expire() == []
        assert other.gc(idle_s=0).partial == []
        assert local_store.exists(oldest)
    assert other.expire() == [oldest]


def test_the_pin_of_a_dead_node_lapses(local_store: Store, tmp_path: Path) -> None:
    local_store.keep = 1
    oldest = publish(local_store, 0)
    pins = local_store.pin(oldest, "restore on a node that then died")
    pins.__enter__()  # never left: the node died holding it
    try:
        publish(local_store, 5)
        assert local_store.exists(oldest)
        (pin,) = (tmp_path / "store" / oldest).glob("pin-*.json")
        # Not refreshed since PIN_TTL_S, by the store's clock (the file's mtime).
        old = time.time() - store_module.PIN_TTL_S - 5
        os.utime(pin, (old, old))
        assert local_store.apply_retention("train") == [oldest]
    finally:
        pins.__exit__(None, None, None)


def test_the_pin_is_refreshed(
    local_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "PIN_REFRESH_S", 0.1)
    oldest = publish(local_store, 0)
    with local_store.pin(oldest, "a long restore"):
        (pin,) = (tmp_path / "store" / oldest).glob("pin-*.json")
        old = time.time() - store_module.PIN_TTL_S - 5
        os.utime(pin, (old, old))
        deadline = time.monotonic() + 5
        while not local_store.pinned(oldest):
            assert time.monotonic() < deadline, "the pin was not refreshed"
            time.sleep(0.05)
    assert list((tmp_path / "store" / oldest).glob("pin-*.json")) == []


def test_pinning_a_missing_checkpoint_says_so(store: Store) -> None:
    with pytest.raises(NotFoundError, match="no checkpoint 20261130T001512Z-000000"):
        with store.pin("20261130T001512Z-000000", "restore"):
            pass


def test_a_cleanup_by_list_leaves_a_pinned_checkpoint(store: Store) -> None:
    # What retiring a label or pruning does: delete what it listed, unless a restore pins it.
    pinned, free = publish(store, 0), publish(store, 5)
    with store.pin(pinned, "restore"):
        assert [store.delete_unless_pinned(m.id) for m in store.list()] == [True, False]
    assert [m.id for m in store.list()] == [pinned]
    assert free not in {m.id for m in store.list()}
