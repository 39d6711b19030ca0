"""CRIU's page-server protocol, served from wherever a checkpoint's page images are: what lets
`criu lazy-pages --page-server` fill a lazily restored tree's memory from a store that is not a
local directory (or whose images are compressed or encrypted), page by page on demand.

What CRIU 4.2 speaks (criu/page-xfer.c, criu/uffd.c, criu/pagemap.c), over one stream socket
that lazy-pages inherits (`--ps-socket FD`: no port anyone else could connect to):

    request   struct page_server_iov {u32 cmd; [4 bytes padding] u64 nr_pages; u64 vaddr;
              u64 dst_id}, little-endian, 32 bytes. cmd's low 16 bits are the command, the high
              16 bits flags. lazy-pages only sends PS_IOV_GET (7): nr_pages pages at vaddr of the
              task whose pagemap-<dst_id>.img describes them (dst_id is the pid as the images
              name it, not encoded), and at its end PS_IOV_CLOSE (0x1023) or PS_IOV_FORCE_CLOSE
              (0x1024, with --ps-socket), answered with an int32 status (0).
    answer    the same header with cmd = PS_IOV_ADD_F | PE_PRESENT << 16, the same vaddr and
              dst_id, nr_pages AT MOST the number asked for (fewer is fine: lazy-pages asks again
              for the rest), then nr_pages * 4096 bytes. Answers go in the order of the requests
              (lazy-pages keeps one FIFO of reads in flight). There is no error answer: CRIU's
              own server closes the socket, after which lazy-pages exits and the kernel fills
              whatever was still missing with ZEROS. So on any failure this server first has the
              restored tree killed (`on_failure`, which must return only once it is dead), and
              only then closes.
    lazy-pages asks on each page fault, and by itself streams every remaining page in the
    background once the restore finished (64 KiB growing to 4 MiB per request, one request in
    flight per task): both arrive here as plain GETs.

Image files (criu/include/magic.h, images/pagemap.proto): two u32 magics (IMG_COMMON_MAGIC,
PAGEMAP_MAGIC), then u32-size-prefixed protobuf messages: one pagemap_head {pages_id = 1}, then
pagemap_entry {vaddr = 1, compat_nr_pages = 2, in_parent = 3, flags = 4, nr_pages = 5}.
Entries are sorted by vaddr; those flagged PE_PRESENT hold nr_pages * 4096 bytes in
pages-<pages_id>.img, one after the other; PE_LAZY ones are the ones a lazy restore skips (its
tree gets them from lazy-pages), all others it reads from the local pages file at their offset.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from stasis.engine import protobuf
from stasis.fdio import recv_exactly

log = logging.getLogger("stasis.engine")

PAGE_SIZE = 4096
IMG_COMMON_MAGIC = 0x54564319
PAGEMAP_MAGIC = 0x56084025

PE_PARENT = 1 << 0
PE_LAZY = 1 << 1
PE_PRESENT = 1 << 2

_SO_SNDBUFFORCE = 32  # <asm-generic/socket.h>; the socket module does not name it

PS_IOV_ADD_F = 6
PS_IOV_GET = 7
PS_IOV_CLOSE = 0x1023
PS_IOV_FORCE_CLOSE = 0x1024
_CMD_MASK = 0xFFFF
_CMD_BITS = 16

_IOV = struct.Struct("<I4xQQQ")
_PROCESS_PAGEMAP = re.compile(r"^pagemap-([0-9]+)\.img$")


class PagemapError(Exception):
    """A pagemap image this module cannot read, or a request it does not describe."""


@dataclass(frozen=True)
class PagemapEntry:
    vaddr: int
    nr_pages: int
    flags: int
    offset: int  # in the pages file; meaningful only when PE_PRESENT

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE_SIZE

    @property
    def present(self) -> bool:
        return bool(self.flags & PE_PRESENT)

    @property
    def lazy(self) -> bool:
        return bool(self.flags & PE_LAZY)


@dataclass(frozen=True)
class Pagemap:
    """One task's pagemap: which of its pages are where in `pages_file`."""

    pages_file: str  # e.g. "pages-1.img"
    entries: tuple[PagemapEntry, ...]
    starts: tuple[int, ...]  # each entry's vaddr, for bisecting

    def in_parent(self) -> bool:
        return any(e.flags & PE_PARENT for e in self.entries)

    def eager_ranges(self) -> list[tuple[int, int]]:
        """(offset, length) in the pages file of what a lazy restore reads itself (present, not
        lazy), adjacent ranges merged."""
        ranges: list[tuple[int, int]] = []
        for e in self.entries:
            if not e.present or e.lazy:
                continue
            length = e.nr_pages * PAGE_SIZE
            if ranges and ranges[-1][0] + ranges[-1][1] == e.offset:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + length)
            else:
                ranges.append((e.offset, length))
        return ranges

    def locate(self, vaddr: int, nr_pages: int) -> tuple[int, int]:
        """(offset in the pages file, pages) of the first of `nr_pages` pages at `vaddr`: as
        many as one present entry holds from there. PagemapError if none holds `vaddr`."""
        i = bisect.bisect_right(self.starts, vaddr) - 1
        if i < 0 or vaddr >= self.entries[i].end or vaddr % PAGE_SIZE:
            raise PagemapError(f"no pagemap entry holds address {vaddr:#x}")
        e = self.entries[i]
        if not e.present:
            raise PagemapError(f"the pages at {vaddr:#x} are not in {self.pages_file}")
        skip = (vaddr - e.vaddr) // PAGE_SIZE
        return e.offset + skip * PAGE_SIZE, min(nr_pages, e.nr_pages - skip)


def _fields(message: bytes) -> dict[int, int]:
    """The varint fields of a protobuf message (all pagemap fields are varints)."""
    fields: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(message):
            key, pos = protobuf.varint(message, pos)
            if key & 7 != 0:
                raise PagemapError(f"unexpected protobuf wire type {key & 7} in a pagemap")
            fields[key >> 3], pos = protobuf.varint(message, pos)
    except ValueError:
        raise PagemapError("truncated or malformed protobuf varint") from None
    return fields


def _messages(data: bytes) -> Iterator[bytes]:
    pos = 8
    while pos < len(data):
        if pos + 4 > len(data):
            raise PagemapError("truncated pagemap image")
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + size > len(data):
            raise PagemapError("truncated pagemap image")
        yield data[pos : pos + size]
        pos += size


def parse_pagemap(data: bytes) -> Pagemap:
    """A pagemap image's content (CRIU >= 3: two magics, then the head and the entries)."""
    if len(data) < 8 or struct.unpack_from("<II", data) != (IMG_COMMON_MAGIC, PAGEMAP_MAGIC):
        raise PagemapError("not a CRIU pagemap image (bad magic)")
    messages = _messages(data)
    head = next(messages, None)
    if head is None:
        raise PagemapError("pagemap image without a head")
    pages_id = _fields(head).get(1)
    if pages_id is None:
        raise PagemapError("pagemap head without pages_id")
    entries = []
    offset = 0
    for message in messages:
        f = _fields(message)
        nr_pages = f.get(5, f.get(2, 0))
        # Images of older CRIUs carry no flags: in_parent, or else present (criu/pagemap.c).
        flags = f[4] if 4 in f else (PE_PARENT if f.get(3) else PE_PRESENT)
        if f.get(3):
            flags |= PE_PARENT
        entries.append(
            PagemapEntry(vaddr=f.get(1, 0), nr_pages=nr_pages, flags=flags, offset=offset)
        )
        if flags & PE_PRESENT:
            offset += nr_pages * PAGE_SIZE
    return Pagemap(
        pages_file=f"pages-{pages_id}.img",
        entries=tuple(entries),
        starts=tuple(e.vaddr for e in entries),
    )


def process_pagemaps(images: Path) -> dict[int, Pagemap]:
    """Every task's pagemap in an images directory, by the pid the images name it with."""
    found = {}
    for path in images.iterdir():
        m = _PROCESS_PAGEMAP.match(path.name)
        if m:
            found[int(m[1])] = parse_pagemap(path.read_bytes())
    return found


Buffers = bytes | memoryview | list[memoryview]


class PageReader(Protocol):
    """Plaintext bytes of image file `name` from `offset`: exactly `length` of them (in one
    buffer, or in pieces that follow each other: `Store.read_range_views`), or an exception (a
    store that failed, a chunk that did not verify)."""

    def __call__(self, name: str, offset: int, length: int, /) -> Buffers: ...


def _views(data: Buffers) -> list[memoryview]:
    return data if isinstance(data, list) else [memoryview(data)]


def _slice(views: list[memoryview], lo: int, hi: int) -> list[memoryview]:
    """Bytes [lo, hi) of the pieces `views`, as views (nothing copied)."""
    out, at = [], 0
    for view in views:
        end = at + len(view)
        if end > lo and at < hi:
            out.append(view[max(lo - at, 0) : min(hi, end) - at])
        at = end
        if at >= hi:
            break
    return out


class _ReadAhead:
    """Reads of the page files in aligned blocks, the next few fetched ahead on a few threads:
    lazy-pages streams the remaining pages with one 4 MiB request in flight per task, so each
    of those would otherwise wait a whole store round trip."""

    def __init__(self, read: PageReader, sizes: dict[str, int], block: int, ahead: int) -> None:
        self._read = read
        self._sizes = sizes
        self._block = block
        self._ahead = ahead
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, min(ahead, 4)), thread_name_prefix="stasis-pages"
        )
        self._blocks: dict[tuple[str, int], Future[list[memoryview]]] = {}
        self._lock = threading.Lock()

    def _future(self, name: str, index: int) -> Future[list[memoryview]] | None:
        start = index * self._block
        size = self._sizes[name]
        if start >= size:
            return None
        key = (name, index)
        with self._lock:
            fut = self._blocks.get(key)
            if fut is None:
                fut = self._pool.submit(
                    self._read_views, name, start, min(self._block, size - start)
                )
                self._blocks[key] = fut
                # Bounded: blocks served long ago go (a page is asked for once, then it is in).
                while len(self._blocks) > 4 * self._ahead + 8:
                    del self._blocks[next(iter(self._blocks))]
            return fut

    def _read_views(self, name: str, offset: int, length: int) -> list[memoryview]:
        views = _views(self._read(name, offset, length))
        got = sum(len(v) for v in views)
        if got != length:
            raise PagemapError(f"{name}: got {got} bytes of {length} at {offset}")
        return views

    def read(self, name: str, offset: int, length: int) -> list[memoryview]:
        if name not in self._sizes or offset + length > self._sizes[name]:
            raise PagemapError(f"{name} has no bytes {offset}-{offset + length}")
        first, last = offset // self._block, (offset + length - 1) // self._block
        for index in range(last + 1, last + 1 + self._ahead):
            self._future(name, index)
        parts: list[memoryview] = []
        for index in range(first, last + 1):
            fut = self._future(name, index)
            assert fut is not None
            lo = max(offset, index * self._block) - index * self._block
            hi = min(offset + length, (index + 1) * self._block) - index * self._block
            parts += _slice(fut.result(), lo, hi)
        return parts

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PageServer:
    """Serves lazy-pages' GETs on `sock` from `read` (through read-ahead), mapping each through
    the pagemaps of `images`. `on_failure(reason)` is called (once) when a page cannot be had:
    it must see to it that the restored tree is dead before it returns, since closing the
    socket makes the kernel hand the tree zero pages. `delay_s` (tests only) holds each answer
    back, to make the window before all pages arrived deterministic."""

    def __init__(
        self,
        sock: socket.socket,
        images: Path,
        sizes: dict[str, int],
        read: PageReader,
        on_failure: Callable[[str], None],
        *,
        block_bytes: int = 4 << 20,
        ahead: int = 4,
        delay_s: float = 0.0,
    ) -> None:
        self.sock = sock
        # A unix socket queues ~200 KiB by default: each 4 MiB answer would go over in steps,
        # lazy-pages and this server taking turns. Room for whole answers lets both run at once.
        try:
            sock.setsockopt(socket.SOL_SOCKET, _SO_SNDBUFFORCE, 16 << 20)
        except OSError:
            pass  # not root (tests): the default works, only slower
        self.pagemaps = process_pagemaps(images)
        self._ahead = _ReadAhead(read, sizes, block_bytes, ahead)
        self._on_failure = on_failure
        self._delay_s = delay_s
        self.served_bytes = 0
        self.failure: str | None = None
        self.closed_cleanly = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve, name="stasis-page-server", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def serve(self) -> None:
        try:
            self._serve()
        except Exception as e:  # whatever it was, the tree must not get zeros for it
            self._fail(_failure_text(e))
        finally:
            self._ahead.close()
            self.sock.close()

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            self._on_failure(reason)

    def _serve(self) -> None:
        while True:
            try:
                header = recv_exactly(self.sock, _IOV.size)
            except ValueError:
                raise PagemapError("lazy-pages sent half a request") from None
            if header is None:
                # lazy-pages went away without saying goodbye: it died, or the restore failed.
                # Its tree's memory is the kernel's business now; nothing more to serve.
                return
            cmd, nr_pages, vaddr, dst_id = _IOV.unpack(header)
            command = cmd & _CMD_MASK
            if command in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                self.sock.sendall(struct.pack("<i", 0))
                self.closed_cleanly = True
                return
            if command != PS_IOV_GET:
                raise PagemapError(f"unexpected page-server command {cmd:#x}")
            self._get(nr_pages, vaddr, dst_id)

    def _get(self, nr_pages: int, vaddr: int, dst_id: int) -> None:
        pagemap = self.pagemaps.get(dst_id)
        if pagemap is None:
            raise PagemapError(f"pages asked for task {dst_id}, which has no pagemap")
        if nr_pages <= 0:
            raise PagemapError("asked for no pages")
        offset, count = pagemap.locate(vaddr, nr_pages)
        data = self._ahead.read(pagemap.pages_file, offset, count * PAGE_SIZE)
        if self._delay_s:
            time.sleep(self._delay_s)
        header = _IOV.pack(PS_IOV_ADD_F | PE_PRESENT << _CMD_BITS, count, vaddr, dst_id)
        _send_all(self.sock, [memoryview(header), *data])
        self.served_bytes += count * PAGE_SIZE


def _send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """sendall for pieces (one sendmsg for them all: no joined copy of 4 MiB per answer)."""
    while views:
        sent = sock.sendmsg(views[:1024])  # IOV_MAX
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


def _failure_text(e: BaseException) -> str:
    """A failure in one line: the OS's words (and the file) where it has some."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def fill_sparse(
    path: Path,
    size: int,
    ranges: list[tuple[int, int]],
    read: PageReader,
    name: str,
    workers: int = 4,
) -> None:
    """Write `size` bytes' worth of file at `path` holding only `ranges` of image `name` (the
    rest a hole): the pages a lazy restore reads itself, at their offsets."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        pieces = [
            (off + done, min(8 << 20, length - done))
            for off, length in ranges
            for done in range(0, length, 8 << 20)
        ]

        def one(piece: tuple[int, int]) -> None:
            views = _views(read(name, piece[0], piece[1]))
            if sum(len(v) for v in views) != piece[1]:
                raise PagemapError(
                    f"{name}: got {sum(len(v) for v in views)} bytes of " f"{piece[1]}"
                )
            at = piece[0]
            for view in views:
                while view:
                    written = os.pwrite(fd, view, at)
                    view, at = view[written:], at + written

        if len(pieces) <= 1:
            for piece in pieces:
                one(piece)
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                list(pool.map(one, pieces))
    finally:
        os.close(fd)
