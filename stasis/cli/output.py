"""Printing: JSON for scripts, tables and progress bars for people, one-line errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

console = Console()
errors = Console(stderr=True)


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data) + "\n")


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    t = Table(*columns, box=None, pad_edge=False)
    for row in rows:
        t.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    console.print(t)


def fail(message: str) -> None:
    errors.print(f"stasis: error: {message}", markup=False, highlight=False, soft_wrap=True)


@contextmanager
def progress_bar(what: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A bytes/rate/time-left bar on a terminal; nothing when piped or with --json."""
    if not enabled or not sys.stdout.isatty():
        yield None
        return
    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True,
    ) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=max(total, done) or None)

        yield update
