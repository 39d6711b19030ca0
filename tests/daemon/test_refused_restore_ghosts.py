"""A restore refused once CRIU ran (a damaged page found at the gate: the whole restore is
killed, CRIU too) leaves none of the ghost files CRIU made on the node (a deleted file the job
held, recreated as PATH.cr.ID.ghost for the restore): the next restore of the job, from a good
checkpoint, restores it, the deleted file's content with it; nor does a daemon killed at the
gate (the job's supervisor kills the restore and removes them). What is removed is never
reached through a link, and only a regular file (tests/engine/test_ghosts.py)."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TEST_USER, Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_streamed_restore import _encrypting_daemon
from tests.faults import kit

LINE = re.compile(r"^(\d+) (\S+)$", re.M)


def _lines(text: str) -> list[tuple[int, str]]:
    return [(int(n), held) for n, held in LINE.findall(text)]


def _ghosts(where: str, token: str) -> list[Path]:
    return sorted(Path(where).glob(f"*{token}*.cr.*.ghost"))


@pytest.fixture
def token() -> Iterator[str]:
    """Names the job's deleted file; whatever of it is on the node at the end is removed."""
    token = secrets.token_hex(4)
    yield token
    for where in ("/dev/shm", "/tmp"):
        for left in Path(where).glob(f"*{token}*"):
            left.unlink()


@pytest.mark.parametrize("where", ["/dev/shm", "/tmp"])
def test_a_refused_restore_leaves_no_ghost_and_the_next_one_restores(
    make_daemon: MakeDaemon, world_tmp: Path, where: str, token: str
) -> None:
    # Streamed (encrypted): the gate refuses when CRIU reads the damaged page, long after it
    # made the ghost; in place, the hash may refuse before CRIU gets that far.
    d = _encrypting_daemon(make_daemon, world_tmp)
    held = f"held-{token}"
    job = d.run(*workload("heldghost.py", f"{where}/{token}", held), user=TEST_USER)
    wait_for(lambda: len(_lines(d.log_of(job["job"]))) >= 3, what="the job's deleted file")
    before = _lines(d.log_of(job["job"]))[-1][0]
    good = d.json("dump", "--encrypt", "--leave-running", job["job"], user=TEST_USER)
    after_dump = _lines(d.log_of(job["job"]))[-1][0]
    bad = d.json("dump", "--encrypt", job["job"], user=TEST_USER)["checkpoint"]
    pages = max((Path(d.store) / bad).glob("pages-*.img*"), key=lambda p: p.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(data)

    refused = d.cli("restore", bad, user=TEST_USER, check=False)

    assert refused.returncode == 1 and "authentication tag" in refused.stderr, refused.stderr
    criu_log = _criu_log(d)
    assert "Configuring remap" in criu_log, "CRIU never got to make the ghost"
    assert _ghosts(where, token) == []
    # Removed by the supervisor once the refusal killed CRIU; or, where CRIU met the damaged
    # file cut short (the streamer closes its pipe) and failed before the kill came, by CRIU
    # as it failed, which its log says (seen once in some forty runs of the suite).
    assert _removed_by_the_supervisor(d, bad, f"{where}/{token}") or re.search(
        rf"Unlink remap \S*/{token}\.cr\.[0-9a-f]+\.ghost$", criu_log, re.M
    ), criu_log[-3000:]
    logged = len(d.log_of(job["job"]))
    restored = d.json("restore", good["checkpoint"], user=TEST_USER)
    # Counting on from the good checkpoint, the deleted file read back.
    wait_for(lambda: len(_lines(d.log_of(job["job"])[logged:])) >= 3, what="the restored job")
    resumed = _lines(d.log_of(job["job"])[logged:])
    assert before < resumed[0][0] <= after_dump + 1, (before, after_dump, resumed)
    assert {text for _, text in resumed} == {held}
    assert _ghosts(where, token) == [] and not Path(where, token).exists()
    d.cli("kill", restored["job"], user=TEST_USER)


def _criu_log(d: Daemon) -> str:
    """The newest restore's CRIU log."""
    logs = sorted((d.state_dir / "criu-logs").glob("restore-*.log"), key=os.path.getmtime)
    return logs[-1].read_text(errors="replace") if logs else ""


def test_a_daemon_killed_at_the_gate_leaves_no_ghost(
    make_daemon: MakeDaemon, world_tmp: Path, token: str
) -> None:
    # Streamed: the daemon's check ends once CRIU read every page, long after it made the ghost.
    d = _encrypting_daemon(make_daemon, world_tmp)
    held = f"held-{token}"
    job = d.run(*workload("heldghost.py", f"/dev/shm/{token}", held), user=TEST_USER)
    wait_for(lambda: len(_lines(d.log_of(job["job"]))) >= 3, what="the job's deleted file")
    cp = d.json("dump", "--encrypt", job["job"], user=TEST_USER)
    at = _lines(d.log_of(job["job"]))[-1][0]
    kit.kill_at(d, "restore.streamed.before-resume", "restore", cp["checkpoint"])
    wait_for(
        lambda: _removed_by_the_supervisor(d, cp["checkpoint"], f"/dev/shm/{token}"),
        what="the supervisor's removal of the ghost",
    )
    assert not _ghosts("/dev/shm", token)
    wait_for(lambda: not kit.live_jobs(d), what="nothing of the killed restore running")
    logged = len(d.log_of(job["job"]))
    restored = d.json("restore", cp["checkpoint"], user=TEST_USER)
    wait_for(lambda: len(_lines(d.log_of(job["job"])[logged:])) >= 3, what="the restored job")
    resumed = _lines(d.log_of(job["job"])[logged:])
    assert resumed[0][0] == at + 1 and {text for _, text in resumed} == {held}, resumed
    assert not _ghosts("/dev/shm", token)
    d.cli("kill", restored["job"], user=TEST_USER)


def _removed_by_the_supervisor(d: Daemon, checkpoint: str, path: str) -> bool:
    """The job's supervisor said it removed the ghost of `path` (in the daemon's log)."""
    said = re.findall(
        rf"the failed restore of checkpoint {checkpoint} left ghost files .*removed: (.*)$",
        (d.root / "daemon.log").read_text(errors="replace"),
        re.M,
    )
    return any(re.search(rf'"{re.escape(path)}\.cr\.[0-9a-f]+\.ghost"', line) for line in said)
