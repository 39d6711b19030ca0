"""Waiting for a condition: the one polling loop the demos, the benchmarks and the tests share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.05) -> T | None:
    """Call `predicate` every `interval_s` until it returns something true (returned), or
    `timeout_s` passes (None: the caller raises its own error, saying what it waited for)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval_s)
