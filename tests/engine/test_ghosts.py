"""A ghost file left by a restore CRIU did not finish (engine/ghosts.py) is removed as root, in
directories the job's user may write: only what was not there when the restore began, in the
directory it began with, never through a link, and only a regular file."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from stasis.engine.ghosts import _directory, _remove


def _identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def test_only_a_regular_file_reached_without_a_link_in_its_directory_is_removed(
    world_tmp: Path,
) -> None:
    top = Path(world_tmp) / f"ghosts-{secrets.token_hex(4)}"
    real = top / "real"
    real.mkdir(parents=True)
    where = _identity(real)
    (top / "link").symlink_to(real)
    ghost = real / "f.cr.1.ghost"
    ghost.write_text("a ghost")
    (real / "d.cr.2.ghost").mkdir()
    os.mkfifo(real / "p.cr.3.ghost")

    assert not _remove(str(top / "link" / "f.cr.1.ghost"), where, "cp")  # through a link
    assert not _remove(str(real / "d.cr.2.ghost"), where, "cp")
    assert not _remove(str(real / "p.cr.3.ghost"), where, "cp")
    assert ghost.read_text() == "a ghost"
    assert (real / "d.cr.2.ghost").is_dir() and (real / "p.cr.3.ghost").exists()

    # Its directory renamed away and another put in its place (the job's user may): the file
    # of that name there is not this restore's.
    other = top / "other"
    other.mkdir()
    (other / "f.cr.1.ghost").write_text("someone else's")
    real.rename(top / "moved")
    other.rename(real)
    assert not _remove(str(real / "f.cr.1.ghost"), where, "cp")
    assert (real / "f.cr.1.ghost").read_text() == "someone else's"
    real.rename(other)
    (top / "moved").rename(real)

    assert _remove(str(ghost), where, "cp")
    assert not ghost.exists()


def test_what_stands_at_a_ghost_name_when_the_restore_begins_is_never_its_to_remove(
    world_tmp: Path,
) -> None:
    top = Path(world_tmp) / f"ghosts-{secrets.token_hex(4)}"
    top.mkdir()
    (top / "there.cr.1.ghost").write_text("before the restore")
    (top / "dangling.cr.2.ghost").symlink_to(top / "nowhere")
    assert _directory(str(top / "there.cr.1.ghost")) is None
    assert _directory(str(top / "dangling.cr.2.ghost")) is None
    assert _directory(str(top / "new.cr.3.ghost")) == _identity(top)
    (top / "link").symlink_to(top)
    assert _directory(str(top / "link" / "new.cr.3.ghost")) is None  # reached through a link
