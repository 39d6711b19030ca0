"""The page server's side of CRIU's protocol, spoken to as lazy-pages speaks (the whole path,
with real CRIU, is in tests/daemon/test_lazy_remote.py), and pagemap images as CRIU writes them."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest

from stasis.engine.pageserver import (
    IMG_COMMON_MAGIC,
    PAGE_SIZE,
    PAGEMAP_MAGIC,
    PE_LAZY,
    PE_PRESENT,
    PageServer,
    parse_pagemap,
)

_IOV = struct.Struct("<I4xQQQ")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _message(**fields: int) -> bytes:
    numbers = {
        "vaddr": 1,
        "compat_nr_pages": 2,
        "in_parent": 3,
        "flags": 4,
        "nr_pages": 5,
        "pages_id": 1,
    }
    body = b"".join(_varint(numbers[k] << 3) + _varint(v) for k, v in fields.items())
    return struct.pack("<I", len(body)) + body


def _pagemap(pages_id: int, *entries: dict[str, int]) -> bytes:
    return (
        struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC)
        + _message(pages_id=pages_id)
        + b"".join(_message(**e) for e in entries)
    )


def test_pagemap_offsets_and_eager_ranges() -> None:
    pm = parse_pagemap(
        _pagemap(
            3,
            {"vaddr": 0x10000, "compat_nr_pages": 2, "flags": PE_PRESENT},
            {"vaddr": 0x20000, "compat_nr_pages": 0, "nr_pages": 4, "flags": PE_PRESENT | PE_LAZY},
            {"vaddr": 0x40000, "compat_nr_pages": 1, "flags": PE_PRESENT},
            {"vaddr": 0x50000, "compat_nr_pages": 1},  # an older CRIU's: no flags means present
        )
    )
    assert pm.pages_file == "pages-3.img"
    assert [e.offset for e in pm.entries] == [0, 2 * PAGE_SIZE, 6 * PAGE_SIZE, 7 * PAGE_SIZE]
    assert pm.eager_ranges() == [(0, 2 * PAGE_SIZE), (6 * PAGE_SIZE, 2 * PAGE_SIZE)]
    assert pm.locate(0x21000, 10) == (3 * PAGE_SIZE, 3)  # no further than its entry
    with pytest.raises(Exception, match="no pagemap entry"):
        pm.locate(0x30000, 1)


def test_get_answers_in_order_and_close(tmp_path: Path) -> None:
    (tmp_path / "pagemap-7.img").write_bytes(
        _pagemap(1, {"vaddr": 0x100000, "compat_nr_pages": 8, "flags": PE_PRESENT | PE_LAZY})
    )
    pages = bytes(range(256)) * (8 * PAGE_SIZE // 256)
    failures: list[str] = []
    ours, theirs = socket.socketpair()
    server = PageServer(
        ours,
        tmp_path,
        {"pages-1.img": len(pages)},
        lambda name, off, n: pages[off : off + n],
        failures.append,
        block_bytes=3 * PAGE_SIZE,
        ahead=2,
    )
    server.start()
    # Two requests in flight, as lazy-pages may have them; the second asks for more than the
    # entry holds and gets what there is.
    theirs.sendall(_IOV.pack(7, 2, 0x102000, 7) + _IOV.pack(7 | 1 << 16, 9, 0x105000, 7))
    for vaddr, count, offset in ((0x102000, 2, 2), (0x105000, 3, 5)):
        cmd, nr, got_vaddr, dst = _IOV.unpack(_recv(theirs, _IOV.size))
        assert (cmd, nr, got_vaddr, dst) == (6 | PE_PRESENT << 16, count, vaddr, 7)
        assert (
            _recv(theirs, nr * PAGE_SIZE) == pages[offset * PAGE_SIZE : (offset + nr) * PAGE_SIZE]
        )
    theirs.sendall(_IOV.pack(0x1024, 0, 0, 0))
    assert _recv(theirs, 4) == struct.pack("<i", 0)
    server.join(5)
    theirs.close()
    assert server.closed_cleanly and failures == []


def test_a_read_that_fails_is_reported_before_the_socket_closes(tmp_path: Path) -> None:
    (tmp_path / "pagemap-7.img").write_bytes(
        _pagemap(1, {"vaddr": 0x100000, "compat_nr_pages": 1, "flags": PE_PRESENT | PE_LAZY})
    )
    ours, theirs = socket.socketpair()
    order: list[str] = []

    def read(name: str, off: int, n: int) -> bytes:
        raise OSError(5, "Input/output error", name)

    def on_failure(reason: str) -> None:
        # The socket must still be open here: closing it would hand the tree zero pages.
        assert ours.fileno() != -1
        order.append(reason)

    server = PageServer(ours, tmp_path, {"pages-1.img": PAGE_SIZE}, read, on_failure)
    server.start()
    theirs.sendall(_IOV.pack(7, 1, 0x100000, 7))
    assert theirs.recv(1) == b""  # closed, nothing answered
    server.join(5)
    theirs.close()
    assert order == ["Input/output error: pages-1.img"]


def _recv(sock: socket.socket, size: int) -> bytes:
    buf = b""
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        assert chunk, "closed early"
        buf += chunk
    return buf
