"""Finding the reason for a failure in a CRIU log."""

from __future__ import annotations

import re
from pathlib import Path

_ERROR = re.compile(r"^\(\s*[\d.]+\)\s+(?:\d+:\s+)?Error\s+\(([^)]*)\):\s*(.*)$")

# CRIU logs these on every run on our machines; they are never the reason a run failed.
_HARMLESS = ("Can't setup RLIMIT_NOFILE",)


def first_error(log_path: Path) -> str | None:
    """The first real `Error (...)` line of a CRIU log, without its timestamp, or None."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        m = _ERROR.match(line.strip())
        if not m:
            continue
        message = m.group(2).strip()
        if any(h in message for h in _HARMLESS):
            continue
        return f"{message} [{m.group(1)}]"
    return None
