"""What dumps that never finished left in the staging area is removed; running dumps are not."""

from __future__ import annotations

import os
import time
from pathlib import Path

from stasis.store import Store
from tests.store.helpers import make_info, stage


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    for p in [path, *path.iterdir()] if path.is_dir() else [path]:
        os.utime(p, (then, then))


def test_idle_staging_goes_and_running_staging_stays(local_store: Store) -> None:
    dead, running, busy = make_info(minutes=1), make_info(minutes=2), make_info(minutes=3)
    dead_dir = stage(local_store, dead, {"pages-1.img": b"x" * 4096, "core-1.img": b"c"})
    running_dir = stage(local_store, running, {"pages-1.img": b"y" * 4096})
    busy_dir = stage(local_store, busy, {"pages-1.img": b"z" * 4096})
    _age(dead_dir, 7200)
    _age(running_dir, 30)
    _age(busy_dir, 7200)
    os.utime(busy_dir / "pages-1.img")  # CRIU is still writing this one
    area = dead_dir.parent
    (area / "notes.txt").write_text("someone else's")
    _age(area / "notes.txt", 7200)

    assert local_store.remove_stale_staging() == [dead.id]
    assert not dead_dir.exists()
    assert running_dir.exists() and busy_dir.exists()
    assert (area / "notes.txt").exists()  # not a dump's: left alone
    # The survivors still publish.
    assert local_store.publish(running, "none").id == running.id
    assert [m.id for m in local_store.list()] == [running.id]


def test_nothing_to_clean(local_store: Store, memory_store: Store) -> None:
    assert local_store.remove_stale_staging() == []
    assert memory_store.remove_stale_staging() == []
