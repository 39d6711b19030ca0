"""Signal names as people and scripts write them: TERM, SIGTERM, term, 15.

Shared by the CLI (to refuse a bad `--signal` before anything is sent) and the daemon (API callers
may send anything). Imports nothing heavy: every `stasis kill` loads it.
"""

from __future__ import annotations

import signal

from stasis.errors import UsageError


def parse_signal(text: str | int) -> signal.Signals:
    """The signal `text` names (a name with or without SIG, any case, or a number); UsageError,
    saying what would do, when it names none."""
    word = str(text).strip()
    try:
        if word.isdigit():
            return signal.Signals(int(word))
        name = word.upper()
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise UsageError(
            f"{word!r} is not a signal: give a name (TERM, INT, HUP, USR1, ...) " "or a number"
        ) from None


__all__ = ["parse_signal"]
