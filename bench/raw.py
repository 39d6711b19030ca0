"""The physical limit on a destination: write and read back the same number of bytes, raw.

Write: 64 MiB blocks of incompressible bytes from warm memory into a fresh file, no fsync (CRIU
and stasis do not fsync image data either), so on tmpfs it pays page allocation, on disk the page
cache and whatever writeback the kernel forces. Read: the file back into fresh anonymous memory,
which is what a restore does with its pages (cache-warm, like a restore right after a dump).
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK = 64 << 20


@dataclass(frozen=True)
class RawResult:
    write_s: float
    read_s: float
    size_bytes: int


def s3_baseline(fs: Any, prefix: str, size: int) -> RawResult:
    """The same bytes up to S3 and back with s3fs alone (what `dump to S3` is held to)."""
    block = os.urandom(min(BLOCK, size))
    data = (block * (size // len(block) + 1))[:size]
    path = f"{prefix}/raw-copy.bin"
    start = time.monotonic()
    fs.pipe_file(path, data)
    write_s = time.monotonic() - start
    del data
    start = time.monotonic()
    got = fs.cat_file(path)
    read_s = time.monotonic() - start
    assert len(got) == size
    fs.rm_file(path)
    return RawResult(write_s=write_s, read_s=read_s, size_bytes=size)


def copy_baseline(directory: Path, size: int) -> RawResult:
    block = os.urandom(min(BLOCK, size))
    path = directory / "raw-copy.bin"
    path.unlink(missing_ok=True)
    os.sync()
    start = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        left = size
        while left:
            n = min(left, len(block))
            written = os.write(fd, memoryview(block)[:n])
            left -= written
    finally:
        os.close(fd)
    write_s = time.monotonic() - start
    os.sync()
    start = time.monotonic()
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        got: int = 0
        while got < size:
            n = f.readinto(view[got : got + BLOCK]) or 0
            if not n:  # None never happens on a blocking file; 0 is an early end
                break
            got += n
    read_s = time.monotonic() - start
    view.release()
    buf.close()
    path.unlink()
    return RawResult(write_s=write_s, read_s=read_s, size_bytes=size)
