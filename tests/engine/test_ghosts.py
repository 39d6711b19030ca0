"""A ghost file left by a restore CRIU did not finish (engine/ghosts.py) is removed as root, in
directories the job's user may write: never through a link, and only a regular file."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from stasis.engine.ghosts import _remove


def test_only_a_regular_file_reached_without_a_link_is_removed(world_tmp: Path) -> None:
    top = Path(world_tmp) / f"ghosts-{secrets.token_hex(4)}"
    (top / "real").mkdir(parents=True)
    (top / "link").symlink_to(top / "real")
    ghost = top / "real" / "f.cr.1.ghost"
    ghost.write_text("a ghost")
    (top / "real" / "d.cr.2.ghost").mkdir()
    os.mkfifo(top / "real" / "p.cr.3.ghost")

    assert not _remove(str(top / "link" / "f.cr.1.ghost"), "cp")  # through a link: left alone
    assert not _remove(str(top / "real" / "d.cr.2.ghost"), "cp")
    assert not _remove(str(top / "real" / "p.cr.3.ghost"), "cp")
    assert ghost.read_text() == "a ghost"
    assert (top / "real" / "d.cr.2.ghost").is_dir()
    assert (top / "real" / "p.cr.3.ghost").exists()

    assert _remove(str(ghost), "cp")
    assert not ghost.exists()
