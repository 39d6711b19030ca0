"""The stored form of an image file: a sequence of chunks, each decodable and checkable alone.

A file of N bytes is cut into chunks of CHUNK_BYTES plain bytes (the last one shorter). Each is
compressed on its own (zstd frame or lz4 block, or left as it is), then, for an encrypted
checkpoint, sealed with AES-256-GCM (crypt.py); the stored file is those chunks one after another,
with no header. The manifest's `Chunks` table holds each chunk's stored size (hence its offset)
and, unless encrypted, the BLAKE3 of its plain bytes, or when encrypted its seal (nonce and tag:
a sealed chunk stores no more bytes than it seals); the manifest, signed, binds both. Checkpoints
of formats 1 and 2 have xxh3-64 instead: still decoded, but xxh3 only detects damage (the store
refuses to restore those unless encrypted, trust.py): any range of the file can be fetched and
verified by itself, which is what a lazy restore serving pages from the store needs, and whole
files decode on several threads.

Why 1 MiB: a range read fetches and decodes whole chunks, so a page fault served from the store
costs one chunk (1 MiB: ~0.1 ms to decode, one modest GET from an object store) rather than 4 or
8; per chunk the table costs ~100 bytes of manifest (its BLAKE3 in hex: ~100 KiB per GiB, so the
64 MiB a manifest may have hold ~650 GiB of images), zstd level 1 and AES-GCM run
as fast on 1 MiB as on larger pieces here (~6-9 GB/s for AES-GCM), and the 28 bytes of nonce and
tag are 0.003% of it (in the manifest: ~57 KiB per GiB).

`ChunkWriter` takes one file's chunks in order and writes them to a `Writer` (or, with none, only
checksums them: a plain stored file that is the staged one), on worker threads when asked; for an
uncompressed encrypted image that writer may be the staged file itself (tailhash.InPlaceOutput):
each chunk's ciphertext overwrites its plain bytes;
`unpack_chunked` decodes a whole stored file; `ChunkDecoder` decodes single chunks (range reads).
Failures of a chunk raise `ChunkError`, whose message names the chunk.
"""

from __future__ import annotations

import hmac
import io
import os
import stat
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import blake3
import lz4.block
import xxhash
import zstandard

from stasis.store.compression import ZSTD_LEVEL, Reader, Streamed, Writer, feed_mapped
from stasis.store.crypt import TAG_BYTES, ChunkCipher, DecryptionError, join
from stasis.store.manifest import Chunks, Compression, file_digest

CHUNK_BYTES = 1 << 20
# Chunks handed to worker threads ahead of the one being written, per worker: enough to keep
# every worker busy while the writer waits on its destination, little memory (a few MiB).
_AHEAD_PER_WORKER = 2


class ChunkError(Exception):
    """One stored chunk did not decode to what the manifest says."""


@dataclass(frozen=True)
class ChunkSpec:
    """How one checkpoint's files are chunked: codec, cipher (None: in the clear), chunk size."""

    compression: Compression
    cipher: ChunkCipher | None = None
    chunk_bytes: int = CHUNK_BYTES

    @property
    def encrypted(self) -> bool:
        return self.cipher is not None

    @property
    def identity(self) -> bool:
        """Stored bytes are the plain bytes: the staged file itself can be the stored one."""
        return self.compression == "none" and self.cipher is None


_local = threading.local()


def _zstd_compressor() -> zstandard.ZstdCompressor:
    # One per thread: a ZstdCompressor must not be used by two threads at once.
    cctx: zstandard.ZstdCompressor | None = getattr(_local, "cctx", None)
    if cctx is None:
        cctx = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return cctx


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


# One chunk as stored, and its seal (None unless encrypted).
Encoded = tuple[bytes | memoryview, bytes | None]


def encode_chunk(
    spec: ChunkSpec, name: str, index: int, last: bool, data: bytes | memoryview
) -> Encoded:
    """One chunk as stored, and its seal for the chunk table when encrypted."""
    blob: bytes | memoryview
    if spec.compression == "zstd":
        blob = _zstd_compressor().compress(data)
    elif spec.compression == "lz4":
        blob = lz4.block.compress(data, store_size=False)
    else:
        blob = data
    if spec.cipher is not None:
        return spec.cipher.seal(name, index, last, blob)
    return blob, None


def chunk_hash(data: bytes | bytearray | memoryview) -> str:
    """BLAKE3 of one chunk's plain bytes, in hex (the blake3 module lets go of the GIL)."""
    return blake3.blake3(data).hexdigest()


def decode_chunk(
    spec: ChunkSpec,
    name: str,
    index: int,
    last: bool,
    plain_bytes: int,
    stored: bytes | bytearray | memoryview,
    xxh3_64: str | None,
    seal: bytes | None = None,
    joined: bool = False,
    blake3_hex: str | None = None,
) -> bytes | memoryview:
    """The plain bytes of one stored chunk, checked (tag, length, hash); else ChunkError.
    `joined`: `stored` is followed by the tag of `seal` already (crypt.join).

    `stored` must be this process's own copy (bytes read, never a mapping of a file another
    can write): what is checked here is what the caller hands on."""
    blob: bytes | bytearray | memoryview = stored
    try:
        if spec.cipher is not None:
            if seal is None:
                raise DecryptionError(f"chunk {index} has no seal")
            blob = spec.cipher.open(name, index, last, blob if joined else join(blob, seal), seal)
        if spec.compression == "zstd":
            # The frame says how much it holds: refused before anything that large is made.
            if zstandard.frame_content_size(blob) != plain_bytes:
                raise ChunkError(f"chunk {index} does not hold {plain_bytes} bytes")
            blob = _zstd_decompressor().decompress(blob, max_output_size=plain_bytes)
        elif spec.compression == "lz4":
            blob = lz4.block.decompress(blob, uncompressed_size=plain_bytes)
    except DecryptionError as e:
        raise ChunkError(f"{e} (damaged, moved, or sealed for another place)") from None
    except (zstandard.ZstdError, lz4.block.LZ4BlockError, ValueError) as e:
        raise ChunkError(f"chunk {index} cannot be decompressed ({e})") from None
    if len(blob) != plain_bytes:
        raise ChunkError(f"chunk {index} holds {len(blob)} bytes instead of {plain_bytes}")
    if blake3_hex is not None:
        if not hmac.compare_digest(chunk_hash(blob), blake3_hex):
            raise ChunkError(f"chunk {index} fails its checksum (its signed BLAKE3 hash)")
    # Formats 1 and 2 only: xxh3 catches damage, not a forger (the store restores an unencrypted
    # checkpoint of those formats only where it was told to trust them).
    elif xxh3_64 is not None and xxhash.xxh3_64_hexdigest(blob) != xxh3_64:
        raise ChunkError(f"chunk {index} fails its checksum")
    return blob if not isinstance(blob, bytearray) else memoryview(blob)


class ChunkWriter:
    """One file's chunks, in order: checksummed, encoded and written to `dst` (None: only
    checksummed, the plain file being the stored one). `add` takes exactly `chunk_bytes` at a
    time but for the file's last piece; `finish` returns what was stored and the table.

    The chunk added last is sealed only once the next one arrives (or at `finish`): whether it
    is the file's last is part of what its tag binds. `workers` > 1 encodes on that many
    threads (zstd, lz4 and xxhash release the GIL); it may be raised between calls (a follower
    runs on one thread, the publish that finishes its files on all).
    """

    def __init__(self, name: str, spec: ChunkSpec, dst: Writer | None, workers: int = 1) -> None:
        if dst is None and not spec.identity:
            raise ValueError("encoded chunks need a destination")
        self.name = name
        self.spec = spec
        self.dst = dst
        self.workers = workers
        self.offset = 0  # plain bytes taken
        # BLAKE3 per chunk of plain bytes (None when sealed: each seal's tag vouches instead).
        self._sums: list[str] | None = None if spec.encrypted else []
        self._seals: list[str] | None = [] if spec.encrypted else None
        self._stored: list[int] = []
        self.stored_total = 0  # stored bytes written so far
        self.encoded = 0  # plain bytes of the chunks written so far
        self._pending: bytes | None = None
        self._ended = False
        self._next = 0
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: deque[Future[Encoded]] = deque()

    def add(self, chunk: bytes | memoryview, last: bool | None = None) -> None:
        """Take the next chunk; `last` says whether it is the file's last, where the caller
        knows (then it is encoded at once, from `chunk` itself when on this thread)."""
        n = len(chunk)
        if n == 0:
            return
        if self._ended or n > self.spec.chunk_bytes:
            raise ValueError("chunks must be whole but for the file's last")
        self._ended = n < self.spec.chunk_bytes
        self.offset += n
        if self._sums is not None:
            # Hashed here, as the follower reads what CRIU writes (tailhash.py): the pass the
            # dump needs anyway, on the thread that already has the bytes in cache.
            self._sums.append(chunk_hash(chunk))
        if self.dst is None:
            self._stored.append(n)
            self.stored_total += n
            self.encoded += n
            return
        if self._pending is not None:
            self._submit(self._pending, last=False)
            self._pending = None
        if last is None:
            self._pending = bytes(chunk)
            return
        self._ended = self._ended or last
        inline = self.workers <= 1 and not self._ahead
        self._submit(chunk if inline else bytes(chunk), last)

    def add_from(self, src: Reader) -> None:
        """Add the rest of `src`, from where it is, to its end."""
        if self.dst is None and self._add_mapped(src):
            return
        end = _regular_size(src)
        for chunk in read_chunks(src, self.spec.chunk_bytes):
            self.add(chunk, None if end is None else self.offset + len(chunk) >= end)

    def _add_mapped(self, src: Reader) -> bool:
        """Checksum the rest of a local regular file through a read-only mapping (no copy into
        a buffer: ~0.27 s instead of 0.3-0.9 s per GiB here); False where `src` is not one.

        Only for files nobody changes under us (a truncated mapping raises SIGBUS and kills the
        daemon): the staging files this node's CRIU just wrote, never stored checkpoints.
        """
        return feed_mapped(src, self.spec.chunk_bytes, self.add) is not None

    def _submit(self, data: bytes | memoryview, last: bool) -> None:
        index, self._next = self._next, self._next + 1
        if self.workers <= 1 and not self._ahead:
            self._emit(encode_chunk(self.spec, self.name, index, last, data))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max(2, self.workers), thread_name_prefix="stasis-chunks"
            )
        self._ahead.append(self._pool.submit(encode_chunk, self.spec, self.name, index, last, data))
        while len(self._ahead) > _AHEAD_PER_WORKER * max(1, self.workers):
            self._emit(self._ahead.popleft().result())

    def _emit(self, encoded: Encoded) -> None:
        assert self.dst is not None
        blob, seal = encoded
        self.dst.write(blob)
        n = len(blob)
        if self._seals is not None:
            assert seal is not None
            self._seals.append(seal.hex())
        self._stored.append(n)
        self.stored_total += n
        self.encoded = min(self.offset, len(self._stored) * self.spec.chunk_bytes)

    def finish(self) -> tuple[Streamed, Chunks]:
        try:
            if self._pending is not None:
                self._submit(self._pending, last=True)
                self._pending = None
            while self._ahead:
                self._emit(self._ahead.popleft().result())
        finally:
            self.close()
        table = Chunks(
            size_bytes=self.spec.chunk_bytes,
            stored_bytes=self._stored,
            blake3=self._sums,
            seals=self._seals,
        )
        streamed = Streamed(
            size_bytes=self.offset,
            stored_size_bytes=sum(self._stored),
            xxh3_128="",
            blake3=file_digest(self.offset, table),
        )
        return streamed, table

    def close(self) -> None:
        """Stop the workers (what they still encode is dropped); `finish` does it too."""
        for future in self._ahead:
            future.cancel()
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _regular_size(src: Reader) -> int | None:
    """The size of a local regular file (then each chunk can be told last or not as it is
    read); None for anything else."""
    if not isinstance(src, io.FileIO):
        return None
    st = os.fstat(src.fileno())
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def read_chunks(src: Reader, size: int) -> Iterator[memoryview]:
    """Views of one reused buffer, each `size` bytes filled from `src` but for the last: readinto
    may return less (pipes, fsspec files), and chunks must be whole."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    while True:
        filled = 0
        while filled < size:
            n = src.readinto(view[filled:])
            if not n:
                break
            filled += n
        if filled:
            yield view[:filled]
        if filled < size:
            return


def _read_exact(src: Reader, n: int) -> bytes:
    parts = []
    left = n
    while left > 0:
        data = src.read(left)
        if not data:
            break
        parts.append(data)
        left -= len(data)
    return b"".join(parts) if len(parts) != 1 else parts[0]


def _read_into(src: Reader, view: memoryview) -> int:
    filled = 0
    while filled < len(view):
        n = src.readinto(view[filled:])
        if not n:
            break
        filled += n
    return filled


class ChunkDecoder:
    """Decodes the chunks of one stored file, described by its manifest entry's table."""

    def __init__(self, name: str, size_bytes: int, chunks: Chunks, spec: ChunkSpec) -> None:
        self.name = name
        self.size_bytes = size_bytes
        self.chunks = chunks
        self.spec = spec
        self.count = len(chunks.stored_bytes)

    def plain_bytes(self, index: int) -> int:
        return min(self.chunks.size_bytes, self.size_bytes - index * self.chunks.size_bytes)

    def decode(
        self, index: int, stored: bytes | bytearray | memoryview, joined: bool = False
    ) -> bytes | memoryview:
        """Chunk `index` from its stored bytes (`joined`: followed by its tag, crypt.join)."""
        sums = self.chunks.xxh3_64
        hashes = self.chunks.blake3
        seals = self.chunks.seals
        return decode_chunk(
            self.spec,
            self.name,
            index,
            index == self.count - 1,
            self.plain_bytes(index),
            stored,
            sums[index] if sums else None,
            bytes.fromhex(seals[index]) if seals else None,
            joined,
            hashes[index] if hashes else None,
        )

    def span(self, offset: int, length: int) -> tuple[int, int]:
        """The chunks [first, last] that plain bytes [offset, offset + length) lie in."""
        step = self.chunks.size_bytes
        return offset // step, (offset + length - 1) // step


def needs_whole_sum(chunks: Chunks) -> bool:
    """Whether only the whole file's checksum checks these chunks (a table of sizes alone)."""
    return chunks.blake3 is None and chunks.seals is None and chunks.xxh3_64 is None


def _unpack_plain(src: Reader, dst: Writer | None, decoder: ChunkDecoder) -> Streamed:
    """`unpack_chunked` of a plain file with BLAKE3 per chunk into a `dst` that copies what it
    is given (a file) or none: each chunk read into one buffer, over and over, checked, then
    written. A fresh MiB per chunk costs its page faults (~0.3 s/GiB here); and what is
    checked is this process's own copy, which nobody else can change before it is written."""
    hashes = decoder.chunks.blake3
    assert hashes is not None
    buffer = bytearray(decoder.chunks.size_bytes)
    size = 0
    for index, n in enumerate(decoder.chunks.stored_bytes):
        view = memoryview(buffer)[:n]
        got = _read_into(src, view)
        if got != n:
            raise ChunkError(f"ends in chunk {index} ({size + got} bytes stored: truncated?)")
        if n != decoder.plain_bytes(index):
            raise ChunkError(
                f"chunk {index} holds {n} bytes instead of " f"{decoder.plain_bytes(index)}"
            )
        if not hmac.compare_digest(chunk_hash(view), hashes[index]):
            raise ChunkError(f"chunk {index} fails its checksum (its signed BLAKE3 hash)")
        if dst is not None:
            dst.write(view)
        size += n
    if src.read(1):
        raise ChunkError("has bytes after its last chunk")
    return Streamed(size_bytes=size, stored_size_bytes=size, xxh3_128="")


def unpack_chunked(
    src: Reader,
    dst: Writer | None,
    decoder: ChunkDecoder,
    workers: int = 1,
    whole_sum: bool = True,
    dst_copies: bool = False,
) -> Streamed:
    """Decode every chunk of `src` (a stored file) into `dst` (None: only check them); the
    returned checksum is of what `FileEntry.xxh3_128` covers (formats 1 and 2). ChunkError on
    any bad chunk.

    `whole_sum=False` skips that checksum (returned as ""): when every chunk has a tag or a
    hash of its own in the signed table, the chunks checked one by one, each at its index,
    vouch for the whole as well, and a restore that decodes while CRIU reads saves the pass.
    A format 3 table (BLAKE3 per chunk, the file's digest checked against it when the manifest
    was read) never needs it.

    `dst_copies`: `dst` is done with what it was given once `write` returns (a file, not a pipe
    that keeps spliced pages): a plain file is then read through one reused buffer."""
    if decoder.spec.identity and decoder.chunks.blake3 is not None and (dst is None or dst_copies):
        return _unpack_plain(src, dst, decoder)
    if needs_whole_sum(decoder.chunks):
        whole_sum = True  # nothing else vouches for these chunks
    elif decoder.chunks.blake3 is not None or decoder.chunks.seals is not None:
        # BLAKE3 per chunk (the file's digest checked against them), or an AES-GCM tag per
        # chunk binding its index and whether it is the last: nothing for a whole sum to add.
        whole_sum = False
    whole = xxhash.xxh3_128() if whole_sum else None
    size = 0
    stored_total = 0
    seals = decoder.chunks.seals
    joined = decoder.spec.encrypted and seals is not None
    # AES-GCM holds the GIL: threads only add hand-overs to sealed, uncompressed chunks, while
    # one buffer read into again and again saves a fresh MiB per chunk (measured: ~0.3 s/GiB).
    reuse = joined and decoder.spec.compression == "none"
    if reuse:
        workers = 1
    buffer = bytearray(decoder.chunks.size_bytes + TAG_BYTES) if reuse else None
    pool = ThreadPoolExecutor(workers, thread_name_prefix="stasis-chunks") if workers > 1 else None
    ahead: deque[Future[bytes | memoryview]] = deque()

    def emit(plain: bytes | memoryview) -> None:
        nonlocal size
        if dst is not None:
            dst.write(plain)
        if whole is not None and not decoder.spec.encrypted:
            whole.update(plain)
        size += len(plain)

    try:
        for index, n in enumerate(decoder.chunks.stored_bytes):
            stored: bytes | bytearray | memoryview
            if joined:
                assert seals is not None
                # Read with room for the tag after it: AES-GCM opens ciphertext and tag in
                # one buffer, and joining them afterwards would copy every MiB once more.
                if buffer is not None and n <= decoder.chunks.size_bytes:
                    stored = memoryview(buffer)[: n + TAG_BYTES]
                else:
                    stored = bytearray(n + TAG_BYTES)
                got = _read_into(src, memoryview(stored)[:n])
                stored[n:] = bytes.fromhex(seals[index][-2 * TAG_BYTES :])
            else:
                stored = _read_exact(src, n)
                got = len(stored)
            if got != n:
                raise ChunkError(
                    f"ends in chunk {index} ({stored_total + got} bytes " "stored: truncated?)"
                )
            stored_total += n
            if whole is not None and decoder.spec.encrypted:
                whole.update(memoryview(stored)[:n])
            if pool is None:
                emit(decoder.decode(index, stored, joined))
                continue
            ahead.append(pool.submit(decoder.decode, index, stored, joined))
            while len(ahead) > _AHEAD_PER_WORKER * workers:
                emit(ahead.popleft().result())
        while ahead:
            emit(ahead.popleft().result())
        if src.read(1):
            raise ChunkError("has bytes after its last chunk")
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return Streamed(
        size_bytes=size,
        stored_size_bytes=stored_total,
        xxh3_128=whole.hexdigest() if whole is not None else "",
    )
