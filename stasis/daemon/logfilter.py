"""A cap on the daemon's log: an error that repeats in a storm (no files left, a full disk, a
client hammering the socket) is written a few times per interval, then counted, not written.

Without it, a daemon out of file descriptors wrote 89 MB of tracebacks in 40 s. Messages are
told apart by where they were logged and their format string (not their arguments), so "accept
failed: <errno>" is one message whatever the errno.

And one message is one line: much of what the daemon logs quotes what users chose (file names
in CRIU's errors, a job's paths, its step book), and a newline in one would write a line of the
user's making into root's log (a forged "job N checkpointed", say). Control characters in a
message are written escaped (OneLineFilter); tracebacks stay as they are.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

# Past this many distinct messages in one interval, the oldest are forgotten (a storm of
# distinct messages is still bounded: each is written at most `burst` times per interval).
_MAX_KEYS = 1024


class RepeatFilter(logging.Filter):
    """Lets each message through `burst` times per `interval_s`; the next one to pass after
    that says how many were dropped meanwhile."""

    def __init__(
        self, burst: int = 5, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock
        # key -> [start of its interval, passed in it, dropped since the last one passed]
        self._seen: dict[tuple[str, int, str, int], list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg), record.lineno)
        now = self.clock()
        seen = self._seen.get(key)
        if seen is None:
            if len(self._seen) >= _MAX_KEYS:
                self._forget(now)
            self._seen[key] = [now, 1, 0]
            return True
        if now - seen[0] >= self.interval_s:
            seen[0], seen[1] = now, 0
        if seen[1] >= self.burst:
            seen[2] += 1
            return False
        seen[1] += 1
        if seen[2]:
            dropped = int(seen[2])
            seen[2] = 0
            record.msg = f"{record.getMessage()} [{dropped} more like this dropped]"
            record.args = None
        return True

    def _forget(self, now: float) -> None:
        for key in [k for k, v in self._seen.items() if now - v[0] >= self.interval_s]:
            del self._seen[key]
        while len(self._seen) >= _MAX_KEYS:
            del self._seen[next(iter(self._seen))]


# C0 and C1 controls, DEL, and what Unicode takes as line ends.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(m: re.Match[str]) -> str:
    c = m.group(0)
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c)
    if named:
        return named
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def one_line(text: str) -> str:
    """`text` with its control characters written as escapes (\\n, \\x1b, ...)."""
    return _CONTROL.sub(_escape, text)


class OneLineFilter(logging.Filter):
    """Writes every message on one line: its control characters escaped (see the module
    docstring). A message that cannot be formatted is let through as it is, for logging's own
    error report."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - logging reports bad format strings itself
            return True
        if _CONTROL.search(text):
            record.msg = one_line(text)
            record.args = None
        return True


def quiet_repeats(burst: int = 5, interval_s: float = 60.0) -> None:
    """Put a RepeatFilter and a OneLineFilter on every handler of the root logger (where the
    daemon's log goes)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RepeatFilter) for f in handler.filters):
            handler.addFilter(RepeatFilter(burst, interval_s))
        if not any(isinstance(f, OneLineFilter) for f in handler.filters):
            handler.addFilter(OneLineFilter())
