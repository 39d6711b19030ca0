"""Streaming of image bytes: the codecs' names and the format-1 stored files.

Owns the codecs (none, zstd, lz4), the names stored files get, the `auto` decision, and the
stored files of format-1 checkpoints (one zstd or lz4 stream per file, or the plain file):
`unpack` reads them for restore, `pack` writes them (tests of old checkpoints). New checkpoints
are stored in chunks (chunked.py). Both read a file exactly once while computing its checksum
(xxh3-128: it detects damage only, a second preimage being practical; a format-1 checkpoint in the
clear is therefore never restored, store.require_cryptographic_sums). Images can be several GiB, so
nothing here holds a whole file in memory. Errors of the codecs surface as `DecompressionError`;
OSError from the streams passes through untouched for the caller to translate.
"""

from __future__ import annotations

import io
import mmap
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol, cast

import lz4.frame
import xxhash
import zstandard

from stasis.store.manifest import Compression

CHUNK_BYTES = 8 << 20
# Level 1: dumps happen under a preemption deadline, and level 1 already shrinks the zero
# pages that dominate most images; higher levels buy a few percent for twice the CPU time.
ZSTD_LEVEL = 1
_LZ4_READ_BYTES = 128 << 10

_SUFFIX: dict[Compression, str] = {"none": "", "zstd": ".zst", "lz4": ".lz4"}
_SEALED_SUFFIX = ".enc"


class DecompressionError(Exception):
    """Stored bytes could not be decoded by their codec."""


@dataclass(frozen=True)
class Streamed:
    """What one pass over a file saw: sizes on both sides and its checksum: the xxh3-128 of the
    plain bytes (formats 1 and 2; "" where not taken), or, for a chunked file written now, its
    BLAKE3 digest (manifest.file_digest)."""

    size_bytes: int
    stored_size_bytes: int
    xxh3_128: str
    blake3: str = ""


class Reader(Protocol):
    """Where stored or staged bytes come from: a local file, an fsspec file."""

    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: memoryview, /) -> int | None: ...


class Writer(Protocol):
    """Where packed bytes go: a local file, an fsspec file."""

    def write(self, data: bytes | memoryview, /) -> int | None: ...


def stored_name(name: str, compression: Compression, encrypted: bool = False) -> str:
    """The name an image called `name` gets in the store under `compression` (and encryption)."""
    return name + _SUFFIX[compression] + (_SEALED_SUFFIX if encrypted else "")


class _CountingWriter:
    """Forwards writes to `dst` and counts them: codecs write through it, giving the stored size."""

    def __init__(self, dst: Writer) -> None:
        self.dst = dst
        self.count = 0

    def write(self, data: bytes | memoryview, /) -> int:
        self.dst.write(data)
        self.count += len(data)
        return len(data)


class _Chunks:
    """Yields views of one reused buffer filled by `readinto`: no allocation per chunk."""

    def __init__(self, src: Reader) -> None:
        self.src = src
        self.buffer = bytearray(CHUNK_BYTES)
        self.view = memoryview(self.buffer)

    def __iter__(self) -> _Chunks:
        return self

    def __next__(self) -> memoryview:
        n = self.src.readinto(self.view)
        if not n:
            raise StopIteration
        return self.view[:n]


_MAPPED_CHUNK = 64 << 20


def _hash_mapped(src: Reader, sha: xxhash.xxh3_128) -> int | None:
    """Feed the rest of a local regular file to `sha` (`feed_mapped`); how many bytes, or None
    where `src` is not such a file: read it with `_Chunks` instead."""
    return feed_mapped(src, _MAPPED_CHUNK, sha.update)


def feed_mapped(src: Reader, step: int, consume: Callable[[memoryview], object]) -> int | None:
    """Hand the rest of a local regular file, from its position, to `consume` in pieces of
    `step` bytes through a read-only mapping; return how many bytes, or None where `src` is not
    such a file (a pipe, an fsspec file).

    A mapping skips the copy into a buffer: ~0.27 s instead of 0.3-0.9 s per GiB on these
    machines, on the publish path. Only for files nobody changes under us (a truncated mapping,
    or a file another NFS client deleted, raises SIGBUS and kills the daemon): the staging files
    this node's CRIU just wrote. Verifying stored checkpoints, which other nodes may delete,
    reads them instead, where such a loss is an OSError and one error line.
    """
    if not isinstance(src, io.FileIO):
        return None
    st = os.fstat(src.fileno())
    if not stat.S_ISREG(st.st_mode):
        return None
    start = src.tell()
    end = st.st_size
    if end <= start:
        return 0
    with mmap.mmap(src.fileno(), end, prot=mmap.PROT_READ) as mapped:
        mapped.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(mapped) as view:
            for offset in range(start, end, step):
                with view[offset : min(offset + step, end)] as piece:
                    consume(piece)
    src.seek(end)
    return end - start


def pack(
    src: Reader,
    dst: Writer | None,
    compression: Compression,
    hashed: tuple[int, xxhash.xxh3_128] | None = None,
) -> Streamed:
    """Read `src` once: hash it and write it, compressed as asked, to `dst`.

    With `dst=None` (only valid for "none") the bytes are hashed and nowhere written: that is the
    local uncompressed store, where the staged file itself becomes the stored one. Then `hashed`
    may say that the first N bytes already went into a hasher (see tailhash), and `src` is
    positioned after them.
    """
    if dst is None and compression != "none":
        raise ValueError("compression needs a destination")
    if hashed is not None and dst is not None:
        raise ValueError("a partial hash only continues where nothing is written")
    sha = hashed[1] if hashed is not None else xxhash.xxh3_128()
    size = hashed[0] if hashed is not None else 0
    out = _CountingWriter(dst) if dst is not None else None
    if compression == "zstd":
        assert out is not None
        # threads=-1: one worker per CPU inside the codec, so files are packed one after another.
        cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1)
        with cctx.stream_writer(
            cast(IO[bytes], out), closefd=False, write_size=CHUNK_BYTES
        ) as writer:
            for chunk in _Chunks(src):
                sha.update(chunk)
                writer.write(chunk)
                size += len(chunk)
    elif compression == "lz4":
        assert out is not None
        lz4c = lz4.frame.LZ4FrameCompressor()
        out.write(lz4c.begin())
        for chunk in _Chunks(src):
            sha.update(chunk)
            out.write(lz4c.compress(chunk))
            size += len(chunk)
        out.write(lz4c.flush())
    else:
        mapped = _hash_mapped(src, sha) if out is None else None
        if mapped is not None:
            size += mapped
        else:
            for chunk in _Chunks(src):
                sha.update(chunk)
                if out is not None:
                    out.write(chunk)
                size += len(chunk)
    stored = out.count if out is not None else size
    return Streamed(size_bytes=size, stored_size_bytes=stored, xxh3_128=sha.hexdigest())


def unpack(src: Reader, dst: Writer | None, compression: Compression, max_bytes: int) -> Streamed:
    """Decode `src` into `dst` (or only hash it with `dst=None`), stopping past `max_bytes`.

    Stopping early bounds the work a corrupt file can cause; the caller compares the returned size
    and checksum with the manifest. `stored_size_bytes` is not measured here and is reported as 0.
    """
    sha = xxhash.xxh3_128()
    size = 0
    chunks: Iterator[bytes | memoryview]
    if compression == "zstd":
        chunks = _zstd_chunks(src)
    elif compression == "lz4":
        chunks = _lz4_chunks(src)
    else:
        chunks = iter(_Chunks(src))
    try:
        for chunk in chunks:
            sha.update(chunk)
            if dst is not None:
                dst.write(chunk)
            size += len(chunk)
            if size > max_bytes:
                break
    except (zstandard.ZstdError, RuntimeError, EOFError) as e:
        raise DecompressionError(str(e) or type(e).__name__) from e
    return Streamed(size_bytes=size, stored_size_bytes=0, xxh3_128=sha.hexdigest())


def _zstd_chunks(src: Reader) -> Iterator[bytes]:
    # A truncated frame just ends early here; the size check of the caller catches it.
    reader = zstandard.ZstdDecompressor().stream_reader(
        cast(IO[bytes], src), read_size=CHUNK_BYTES, closefd=False
    )
    with reader:
        while chunk := reader.read(CHUNK_BYTES):
            yield chunk


def _lz4_chunks(src: Reader) -> Iterator[bytes]:
    # Small compressed reads bound the output of one call (lz4 expands at most ~255x), and are
    # several times faster than lz4.frame.LZ4FrameFile, which feeds the codec 8 KiB at a time.
    decompressor = lz4.frame.LZ4FrameDecompressor()
    while data := src.read(_LZ4_READ_BYTES):
        if decompressor.eof:
            raise DecompressionError("data after the end of the lz4 frame")
        yield decompressor.decompress(data)
        if decompressor.eof and decompressor.unused_data:
            raise DecompressionError("data after the end of the lz4 frame")
    if not decompressor.eof:
        raise DecompressionError("lz4 frame ends early")


def cpu_workers(n_items: int) -> int:
    """Threads for `n_items` files: xxhash and the codecs release the GIL on large buffers."""
    return max(1, min(n_items, os.cpu_count() or 1, 8))


# `auto` compresses only when a sample says it pays: a checkpoint of tensors or random data barely
# shrinks (zstd -1 ratios of 1.01-1.09 were measured here) while costing CPU on the hot path.
AUTO_SAMPLES = 64
AUTO_SAMPLE_BYTES = 64 << 10
AUTO_MAX_RATIO = 0.5  # compress when the sample shrinks to half or less


def choose_compression(staging: Path, names: list[str]) -> Compression:
    """Decide `auto`: sample AUTO_SAMPLES blocks spread over the staged images (biggest first,
    by size), compress them with zstd, and pick zstd only when they shrink enough."""
    sizes = {n: (staging / n).stat().st_size for n in names}
    total = sum(sizes.values())
    if total < (1 << 20):
        return "none"  # small checkpoints: compressing saves nothing worth having
    sample_step = max(total // AUTO_SAMPLES, AUTO_SAMPLE_BYTES)
    raw = 0
    packed = 0
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    offset_in_total = 0
    for name in sorted(names, key=lambda n: -sizes[n]):
        size = sizes[name]
        with open(staging / name, "rb", buffering=0) as f:
            pos = (sample_step - offset_in_total % sample_step) % sample_step
            while pos < size:
                f.seek(pos)
                block = f.read(AUTO_SAMPLE_BYTES)
                raw += len(block)
                packed += len(cctx.compress(block))
                pos += sample_step
        offset_in_total += size
    return "zstd" if raw and packed <= raw * AUTO_MAX_RATIO else "none"
