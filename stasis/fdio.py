"""Whole writes to a file descriptor and whole reads from a socket (either may move less than
asked: a pipe, a signal, a peer that sent part; the rest must follow), and the kernel's
description of a buffer for vectored I/O."""

from __future__ import annotations

import ctypes
import os
import socket


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
