"""The daemon's log under an error storm: each message a few times per interval, then a count;
and every message on one line, whatever the text it quotes (a user's file name, say)."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stasis.daemon.logfilter import OneLineFilter, RepeatFilter, one_line


def test_a_storm_of_one_error_writes_a_few_lines_and_a_count(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "daemon.log"
    handler = logging.FileHandler(path)
    handler.addFilter(RepeatFilter(burst=3, interval_s=60, clock=lambda: now[0]))
    log = logging.getLogger("stasis.test-storm")
    log.propagate = False
    log.addHandler(handler)
    error = OSError(24, "Too many open files")

    def accept_failed(fd: int) -> None:  # one place in the code, many calls
        log.error("accept failed on fd %d", fd, exc_info=error)

    try:
        for i in range(100_000):  # what 40 s of a daemon out of files wrote, and more
            accept_failed(i)
            log.warning("a different message")
        size_in_storm = path.stat().st_size
        now[0] = 61.0  # the next interval: the message passes again, with what was dropped
        accept_failed(7)
    finally:
        log.removeHandler(handler)
        handler.close()
    text = path.read_text()
    assert size_in_storm < 4096, size_in_storm
    assert text.count("accept failed on fd") == 4
    assert text.count("a different message") == 3
    assert "accept failed on fd 7 [99997 more like this dropped]" in text


@pytest.fixture
def one_line_log() -> tuple[logging.Logger, io.StringIO]:
    """A logger whose handler has the daemon's filters (as quiet_repeats puts them)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(asctime)s stasis %(levelname)s %(message)s"))
    handler.addFilter(RepeatFilter(burst=1000, interval_s=60))
    handler.addFilter(OneLineFilter())
    log = logging.getLogger("stasis.test-one-line")
    log.propagate = False
    log.handlers = [handler]
    return log, out


def test_a_forged_line_in_a_quoted_name_stays_in_its_own_line(
    one_line_log: tuple[logging.Logger, io.StringIO],
) -> None:
    log, out = one_line_log
    name = "/home/u/x\n2026-12-06 01:00:00,000 stasis INFO job 1 checkpointed\x1b[2K"
    log.warning("cannot dump %s: %s", "job 3", FileNotFoundError(2, "No such file", name))
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].endswith(
        "x\\n2026-12-06 01:00:00,000 stasis INFO job 1 checkpointed" "\\x1b[2K'"
    )


@settings(max_examples=300, deadline=None, database=None)
@given(
    fmt=st.text(max_size=40).map(lambda t: t.replace("%", "%%")),
    args=st.lists(st.text() | st.binary() | st.integers() | st.floats(), max_size=3),
)
def test_fuzz_every_message_is_one_line(fmt: str, args: list[object]) -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(OneLineFilter())
    log = logging.getLogger("stasis.test-fuzz-one-line")
    log.propagate = False
    log.handlers = [handler]
    log.warning(fmt + " %s" * len(args), *args)
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1 and "\r" not in text
    assert one_line(text[:-1]) == text[:-1]  # nothing left to escape
