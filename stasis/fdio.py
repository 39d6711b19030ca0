"""Whole writes to a file descriptor: os.write may write less than it was given (a pipe, a
signal), and the rest must follow."""

from __future__ import annotations

import os


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
