"""The daemon's log under an error storm: each message a few times per interval, then a count."""

from __future__ import annotations

import logging
from pathlib import Path

from stasis.daemon.logfilter import RepeatFilter


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
