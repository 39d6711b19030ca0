"""Printing: JSON for scripts, tables and progress bars for people, one-line errors.

rich is imported only when something is drawn for a person: scripts calling `--json` should not
pay for it on every call.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


@cache
def console() -> Console:
    from rich.console import Console

    # Piped output has no width: do not squeeze tables into 80 columns then.
    return Console() if sys.stdout.isatty() else Console(width=200)


@cache
def errors() -> Console:
    from rich.console import Console

    return Console(stderr=True)


def say(text: str) -> None:
    """A line for a person (rich markup allowed)."""
    console().print(text)


def plain(text: str) -> None:
    """A line as it is: no markup, never wrapped (it may hold paths and long explanations)."""
    sys.stdout.write(text + "\n")


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data) + "\n")


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Ids are never cut or wrapped (people copy them); only the last column may wrap."""
    from rich.table import Column, Table

    cols = [Column(c, no_wrap=True, overflow="ignore") for c in columns[:-1]]
    t = Table(*cols, Column(columns[-1], overflow="fold"), box=None, pad_edge=False)
    for row in rows:
        t.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    console().print(t)


def fail(message: str) -> None:
    sys.stderr.write(f"stasis: error: {message}\n")


def warn(message: str) -> None:
    sys.stderr.write(f"stasis: warning: {message}\n")


def notes(answer: Any) -> None:
    """What the daemon did otherwise than asked, and why (a fallback): on stderr, whatever the
    mode, so --json output stays one value and a person still sees it."""
    for text in answer.get("notes", []):
        sys.stderr.write(f"note: {text}\n")


@contextmanager
def progress_bar(what: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A bytes/rate/time-left bar on a terminal; nothing when piped or with --json."""
    if not enabled or not sys.stdout.isatty():
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console(),
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=max(total, done) or None)

        yield update
