"""Whole writes to a file descriptor (os.write may write less than it was given: a pipe, a
signal; the rest must follow), and the kernel's description of a buffer for vectored I/O."""

from __future__ import annotations

import ctypes
import os


class Iovec(ctypes.Structure):
    """struct iovec: `iov_len` bytes at `iov_base` (vmsplice, process_vm_readv)."""

    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
