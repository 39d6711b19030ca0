"""The per-checkpoint record of failed container restores (stasis.k8s.restorefails) and what
the runtime reads of a failed restore's log. The whole path, through containerd, runc and
CRIU: tests/e2e/test_k8s_restore_failure.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stasis.k8s import restorefails
from stasis.k8s.restorefails import RestoreFailures
from stasis.k8s.runtime import _restore_error

CKPT = "20261206T110048Z-ae12e5"
OTHER = "20261206T110055Z-fd0e9b"


def test_failures_are_counted_per_checkpoint_kept_root_only_and_forgotten(tmp_path: Path) -> None:
    f = RestoreFailures(tmp_path / restorefails.DIRECTORY)
    assert f.get(CKPT).attempts == 0
    assert f.failed(CKPT, "Error (criu/files-reg.c:2372):\n Can't open file", "/l").attempts == 1
    done = f.failed(CKPT, "again", "")
    assert (done.attempts, done.error) == (2, "again")
    assert f.get(OTHER).attempts == 0
    assert os.stat(f.directory).st_mode & 0o777 == 0o700
    assert os.stat(f.path(CKPT)).st_mode & 0o077 == 0
    f.forget(CKPT)
    assert f.get(CKPT).attempts == 0


def test_a_damaged_record_counts_one_failure_never_none_nor_given_up(tmp_path: Path) -> None:
    f = RestoreFailures(tmp_path)
    f.path(CKPT).write_text("{not json")
    got = f.get(CKPT)
    assert got.attempts == 1 and "cannot be read" in got.error
    assert f.failed(CKPT, "x", "").attempts == 2


def test_only_checkpoint_ids_name_a_record(tmp_path: Path) -> None:
    f = RestoreFailures(tmp_path / "d")
    for bad in ("../../etc/passwd", "a/b", "", CKPT + "/.."):
        with pytest.raises(ValueError):
            f.path(bad)
    f.forget("../x")  # nothing to do, and no error


def test_records_of_checkpoints_that_are_gone_are_pruned(tmp_path: Path) -> None:
    f = RestoreFailures(tmp_path)
    f.failed(CKPT, "x", "")
    f.failed(OTHER, "y", "")
    (tmp_path / "unrelated.txt").write_text("kept")
    f.prune(lambda c: c == OTHER)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{OTHER}.json", "unrelated.txt"]


def test_the_message_names_the_checkpoint_the_attempts_and_what_comes_next() -> None:
    first = restorefails.message("l", CKPT, "why", 1, 3, "/log", "/rec", "n1")
    assert f"restore of checkpoint {CKPT} failed (why)" in first and "attempt 1 of 3" in first
    assert "not started fresh" in first and "previous checkpoint is tried" in first
    assert "/log" in first and "STASIS_FRESH=1" in first and "\n" not in first
    last = restorefails.message("l", CKPT, "why", 3, 3, "", "/rec", "n1")
    assert "given up on this node now (remove /rec to try it again)" in last
    never = restorefails.message("l", CKPT, "why", 7, 0, "", "/rec", "n1")
    assert "tried again at every create" in never and "STASIS_FRESH" not in never
    unheard = restorefails.message("l", CKPT, "why", 0, 3, "", "", "n1")
    assert "not counted on node n1" in unheard and "not started fresh" in unheard


def test_the_cause_of_a_failed_restore_is_criu_s_first_real_error(tmp_path: Path) -> None:
    (tmp_path / "restore.log").write_text(
        "(00.000001) Version: 4.1\n"
        "(00.003335) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: "
        "Operation not permitted\n"
        "(00.031150)      1: Error (criu/files-reg.c:2372): Can't open file vol/held on "
        "restore: No such file or directory\n"
        "(00.032173) Error (criu/cr-restore.c:2331): Restoring FAILED.\n"
    )
    assert _restore_error(tmp_path) == (
        "Error (criu/files-reg.c:2372): Can't open file "
        "vol/held on restore: No such file or directory"
    )
    assert _restore_error(tmp_path / "none") == "runc restore failed"
