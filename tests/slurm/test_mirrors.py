"""Reading a job's step book from outside its IPC namespace, as the node daemon does to record
stasis's steps in Slurm (the records themselves in sacct: tests/e2e/test_slurm_report.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from stasis.slurm import steps
from stasis.slurm.mirrors import BookReader

# Writes a book in an IPC namespace of its own, says so, and waits.
WRITER = textwrap.dedent("""
    import sys
    from stasis.slurm import steps
    b = steps.Book()
    first = b.start({"where": "stasis", "argv": ["bash"], "name": "first", "ntasks": 2})
    b.end(first, 137, 9)
    b.start({"where": "slurm", "argv": ["--pty", "bash"], "reason": "r"})
    b.start({"where": "stasis", "argv": ["python3"], "name": "python3", "ntasks": 1})
    print("ready", flush=True)
    sys.stdin.read()
""")


@pytest.fixture
def reader() -> Iterator[BookReader]:
    r = BookReader()
    yield r
    r.close()


def _in_own_ipc(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        ["unshare", "--ipc", sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_the_book_is_read_from_outside_the_jobs_namespace(reader: BookReader) -> None:
    proc = _in_own_ipc(WRITER)
    try:
        fd = os.open(f"/proc/{proc.pid}/ns/ipc", os.O_RDONLY)
        try:
            records = reader.read(fd)
            assert records == reader.read(fd)  # read-only: reading twice changes nothing
        finally:
            os.close(fd)
    finally:
        proc.communicate("", timeout=30)
    assert [(r["step"], r["where"], r.get("exit"), r.get("signal")) for r in records] == [
        (0, "stasis", 137, 9),
        (1, "slurm", None, None),
        (2, "stasis", None, None),
    ]
    assert records[0]["name"] == "first" and records[0]["ntasks"] == 2
    # The daemon's own namespace has no book: each read enters the namespace it is given.
    own = os.open("/proc/self/ns/ipc", os.O_RDONLY)
    try:
        assert reader.read(own) == []
    finally:
        os.close(own)


def test_a_namespace_without_a_book_has_no_steps(reader: BookReader) -> None:
    proc = _in_own_ipc("import sys; print('ready', flush=True); sys.stdin.read()")
    try:
        fd = os.open(f"/proc/{proc.pid}/ns/ipc", os.O_RDONLY)
        try:
            assert reader.read(fd) == []
        finally:
            os.close(fd)
    finally:
        proc.communicate("", timeout=30)


def test_a_line_cut_short_is_skipped() -> None:
    data = (
        b'{"step": 0, "where": "stasis", "name": "a"}\n{"step": 0, "exit": 3, "signal": 0}\n'
        b'{"step": 1, "where": "sta'
    )
    assert steps.fold(data) == [{"step": 0, "where": "stasis", "name": "a", "exit": 3, "signal": 0}]
