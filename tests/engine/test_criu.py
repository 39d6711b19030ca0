"""The engine against the real CRIU: versions, features, failures explained, NOTIFY hooks."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.engine import CRIU, DumpOptions, RestoreOptions, find_criu, proctree
from stasis.engine.criulog import first_error
from stasis.errors import CRIUError
from tests.conftest import wait_for, workload


@pytest.fixture
def criu(tmp_path: Path) -> CRIU:
    return CRIU(find_criu(), tmp_path / "logs")


@pytest.fixture
def counter(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A counter as the init of its own pid namespace, as the daemon starts jobs."""
    log = tmp_path / "out.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                "unshare",
                "--pid",
                "--fork",
                "--",
                "setsid",
                "tini",
                "-g",
                "--",
                *workload("counter.py"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    init = wait_for(lambda: next(iter(proctree.children(proc.pid)), None), what="namespace init")
    wait_for(lambda: len(_numbers(log)) >= 3, what="counting")
    yield init, log
    proctree.signal_tree(init, signal.SIGKILL)
    proc.wait()


def test_version_and_features(criu: CRIU) -> None:
    assert criu.version()[:2] >= (4, 2)
    features = criu.features()
    assert features.mem_track is False  # no soft-dirty on this kernel: incremental dumps fall back
    assert isinstance(features.lazy_pages, bool)
    assert criu.check("check.log") is None


def test_failure_names_the_first_real_error(criu: CRIU, tmp_path: Path) -> None:
    images = tmp_path / "img"
    images.mkdir()
    with pytest.raises(CRIUError) as info:
        criu.dump(999_999_999, images, DumpOptions(), "dump.log")
    message = str(info.value)
    assert "RLIMIT" not in message
    assert "999999999" in message
    assert info.value.log_path and Path(info.value.log_path).exists()


def test_first_error_skips_harmless_lines(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text(
        "(00.000001) Version: 4.2.1\n"
        "(00.000010) Error (criu/util.c:12): rlimit: Can't setup RLIMIT_NOFILE for self\n"
        "(00.000200) Error (criu/cr-dump.c:99): Dumping FAILED.\n"
        "(00.000300) Error (criu/cr-dump.c:100): later\n"
    )
    assert first_error(log) == "Dumping FAILED. [criu/cr-dump.c:99]"
    assert first_error(tmp_path / "missing.log") is None


def test_notify_hooks_run_and_can_abort(
    criu: CRIU, counter: tuple[int, Path], tmp_path: Path
) -> None:
    init, log = counter
    seen: list[str] = []

    def refuse(script: str, _pid: int) -> bool:
        seen.append(script)
        return script != "pre-dump"

    images = tmp_path / "img1"
    images.mkdir()
    with pytest.raises(CRIUError):
        criu.dump(init, images, DumpOptions(notify=refuse), "refused.log")
    assert seen == ["pre-dump"]
    # An aborted dump leaves the job running, not frozen.
    lines = log.read_text().count("\n")
    wait_for(lambda: log.read_text().count("\n") >= lines + 3, what="still counting")

    def record(script: str, _pid: int) -> bool:
        seen.append(script)
        return True

    seen.clear()
    images = tmp_path / "img2"
    images.mkdir()
    criu.dump(init, images, DumpOptions(notify=record), "dump.log")
    assert "pre-dump" in seen and "post-dump" in seen
    at_dump = _numbers(log)[-1]

    seen.clear()
    out = open(log, "ab")
    try:
        result = criu.restore(
            images,
            RestoreOptions(inherit_fds=[(str(log).lstrip("/"), out.fileno())], notify=record),
            "restore.log",
        )
    finally:
        out.close()
    assert "post-restore" in seen
    wait_for(lambda: _numbers(log)[-1] >= at_dump + 3, what="counting on")
    values = _numbers(log)
    assert values == list(range(len(values)))  # continued, never restarted
    proctree.signal_tree(result.pid, signal.SIGKILL)
    os.waitpid(result.pid, 0)


def _numbers(log: Path) -> list[int]:
    # `unshare` (not part of the dumped tree) writes a complaint into the log when its child dies.
    return [int(v) for v in log.read_text().split() if v.isdigit()]
