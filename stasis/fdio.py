"""Whole writes to a file descriptor and whole reads from a socket (either may move less than
asked: a pipe, a signal, a peer that sent part; the rest must follow), the kernel's
description of a buffer for vectored I/O, the walk down a tree by directory descriptors
(each one closed once the next is open, the one held closed on any error), the opening of
a new file under a directory descriptor that nothing planted there can redirect, and of a file
that must be a regular one (a key, a record root trusts)."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import stat
from collections.abc import Callable, Iterable
from typing import TypeVar

_Step = TypeVar("_Step")


class Iovec(ctypes.Structure):
    """struct iovec: `iov_len` bytes at `iov_base` (vmsplice, process_vm_readv)."""

    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    """`size` bytes from `sock`; None when the peer closed before sending any, ValueError when
    it closed in the middle."""
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            if buf:
                raise ValueError("a cut-off request")
            return None
        buf += chunk
    return bytes(buf)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def create_new(name: str, dir_fd: int) -> int:
    """A new file `name` in the directory open as `dir_fd`, open for writing only, mode 0600.
    FileExistsError where anything stands at that name (a link included: never written through,
    never another's inode); the caller says what that means."""
    return os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dir_fd,
    )


class NotRegularFile(OSError):
    """What `open_regular` raises for a directory, a fifo, a socket or a device."""


def open_regular(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """`path` open for reading, and its status, when it is a regular file: never through a
    link (ELOOP), never waiting on a fifo or a device (opened non-blocking, then refused with
    NotRegularFile, closed). What the open raises comes out as it is (FileNotFoundError...)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def descend(top: int, steps: Iterable[_Step], step: Callable[[int, _Step], int]) -> int:
    """From the directory open as `top` (taken over: closed like every other one on the way),
    `step(fd, each)` opens the next directory down; the descriptor of the last one opened (`top`
    for no steps). Whatever a step raises comes out with the descriptor held closed; a step
    that rejects what it opened closes that itself."""
    fd = top
    try:
        for each in steps:
            nxt = step(fd, each)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise
