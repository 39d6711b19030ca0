"""When CRIU may read a local checkpoint in place: only when nobody but root can change it."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from stasis.store import Store
from stasis.store._private import only_root_writes

from .helpers import SMALL_FILES, make_info, stage


def _published(tmp_path: Path) -> tuple[Store, str, Path]:
    store = Store(str(tmp_path / "store"), staging_root=tmp_path / "staging", keep=0)
    info = make_info()
    stage(store, info, SMALL_FILES)
    store.publish(info)
    return store, info.id, tmp_path / "store" / info.id


def test_a_root_only_checkpoint_is_read_in_place(tmp_path: Path) -> None:
    store, checkpoint, directory = _published(tmp_path)
    found = store.images_in_place(checkpoint)
    assert found is not None and found[1] == directory


def test_a_checkpoint_others_can_change_is_not(tmp_path: Path) -> None:
    store, checkpoint, directory = _published(tmp_path)
    os.chmod(directory, 0o777)  # anyone may swap an image for another
    assert store.images_in_place(checkpoint) is None
    os.chmod(directory, 0o700)
    image = directory / "core-1.img"
    os.chmod(image, 0o666)
    assert store.images_in_place(checkpoint) is None
    os.chmod(image, 0o600)
    nobody = pwd.getpwnam("nobody").pw_uid
    os.chown(image, nobody, -1)  # a file someone else owns they can rewrite
    assert store.images_in_place(checkpoint) is None
    os.chown(image, 0, -1)
    os.chmod(tmp_path, 0o777)  # a directory above: the checkpoint can be swapped
    assert store.images_in_place(checkpoint) is None
    os.chmod(tmp_path, 0o700)
    assert store.images_in_place(checkpoint) is not None


def test_a_link_or_a_filesystem_others_write_is_not(tmp_path: Path) -> None:
    store, checkpoint, directory = _published(tmp_path)
    (tmp_path / "link").symlink_to(directory)
    assert not only_root_writes(tmp_path / "link", ["core-1.img"])
    assert not only_root_writes(Path("/proc/sys"), [])  # not a local disk filesystem
    assert only_root_writes(directory, ["core-1.img"])
