"""The reader of a store: how a checkpoint's images reach CRIU, and every byte checked first.

What a restore hands CRIU is what was checked against the signed manifest (trust.py): its own
copy of each chunk (streamed, served by range, or decoded into a private directory), or files in
place only where nobody but root can change them (`images_in_place`). `choose` says which of
those ways fits a checkpoint on this store: in place, streamed (a local store, read while CRIU
restores), by range (a lazy restore's pages served on demand) or fetched whole into scratch.
Unencrypted checkpoints of formats 1 and 2, which only xxh3 checks, are never read for a restore
(`require_cryptographic_sums`).
"""

from __future__ import annotations

import builtins
import os
import re
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import xxhash

from stasis.errors import ReaderGone, StasisError, StoreError, UsageError
from stasis.store._place import NO_SPACE, Place, corrupt, reason
from stasis.store._private import only_root_writes
from stasis.store._tree import in_parallel
from stasis.store.catalog import Catalog
from stasis.store.chunked import ChunkDecoder, ChunkError, ChunkSpec, unpack_chunked
from stasis.store.compression import (
    DecompressionError,
    Reader,
    Streamed,
    Writer,
    cpu_workers,
    unpack,
)
from stasis.store.crypt import ChunkCipher, KeyFiles, open_data_key
from stasis.store.manifest import Compression, FileEntry, Manifest
from stasis.store.trust import require_cryptographic_sums

# A full restore from a remote store fetches each chunked file in ranged GETs of this many
# chunks (16 MiB of plain bytes at most: what is held per range), this many at once: one stream
# per file leaves most of an object store's bandwidth unused.
RANGE_CHUNKS = 16
RANGES_IN_FLIGHT = 8
# Where fetched or decoded images go for a full restore when memory allows: they are read
# back at once and deleted, and a disk would have to take them first (1 GiB from S3: 1.4 s to
# /dev/shm, 4.1 s to the state directory's scratch on disk); decrypted ones, the plain pages,
# then never touch a disk either.
MEMORY_SCRATCH = Path("/dev/shm")
# The page images of a checkpoint: what a lazy restore serves by range and a streamed one
# streams; every other image is small and fetched whole first.
PAGES = re.compile(r"^pages-[0-9]+\.img$")

Way = Literal["inplace", "streamed", "ranged", "fetched"]


@dataclass(frozen=True)
class Choice:
    """How a checkpoint's images should reach CRIU (`ImageReader.choose`): `way`, the manifest
    it was chosen for, and for "inplace" the checkpoint's own directory. "streamed" and
    "ranged" may still turn out not to fit once the small images are read (pages in a parent
    checkpoint): then the images are fetched."""

    way: Way
    manifest: Manifest
    in_place: Path | None = None


class ImageReader:
    """`encryption`: the key files that open encrypted checkpoints."""

    def __init__(self, place: Place, catalog: Catalog, encryption: KeyFiles) -> None:
        self._place = place
        self._tree = place.tree
        self._catalog = catalog
        self.encryption = encryption
        # Opened data keys, by (checkpoint, wrapped key): range reads come one page run at a
        # time, and each would otherwise read the key file and unwrap again.
        self._ciphers: dict[tuple[str, str], ChunkCipher] = {}
        self._ciphers_lock = threading.Lock()

    require_cryptographic_sums = staticmethod(require_cryptographic_sums)

    def choose(self, manifest: Manifest, lazy: bool) -> Choice:
        """The way the images of `manifest` reach CRIU on this store, best first: in place
        where nobody but root can change them (a restore hashes them while CRIU reads), streamed
        from a local store, by range for a lazy restore of a chunked checkpoint, else fetched.
        UntrustedCheckpointError for images only xxh3 checks."""
        require_cryptographic_sums(manifest)
        in_place = self.images_in_place(manifest.id)
        if in_place is not None:
            return Choice("inplace", in_place[0], in_place[1])
        if not lazy and self.is_local(manifest.id):
            return Choice("streamed", manifest)
        if lazy and self.by_range(manifest):
            return Choice("ranged", manifest)
        return Choice("fetched", manifest)

    def by_range(self, manifest: Manifest) -> bool:
        """Whether the page images can be read by range (`read_range_views`): not those of a
        checkpoint stored before images were chunked (no table to read ranges by)."""
        return all(f.chunks is not None for f in manifest.files if PAGES.match(f.name))

    @contextmanager
    def open_images(self, checkpoint_id: str, scratch: Path) -> Iterator[tuple[Manifest, Path]]:
        """Yield the manifest and a private local directory of verified, uncompressed images.

        The images are fetched and decoded into a fresh directory under MEMORY_SCRATCH when
        memory holds them (`_memory_scratch`), else under `scratch`, removed on exit; every
        byte written there was checked first (BLAKE3 or AES-GCM, against the signed manifest).
        Never the checkpoint's own directory, even in a local store where CRIU could read it:
        whoever can write the store could change a file between its check and CRIU's read (a
        hard link would share that inode too). Any missing, truncated, forged or corrupt file
        raises CorruptCheckpointError before anything is yielded; a checkpoint whose images
        only xxh3 checks, UntrustedCheckpointError (`require_cryptographic_sums`).
        """
        manifest = self._catalog.get(checkpoint_id)
        require_cryptographic_sums(manifest)
        # Before anything is written: a missing key leaves no scratch behind.
        self._cipher(manifest)
        memory = _memory_scratch(manifest.size_bytes)
        try:
            scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
            # mkdtemp: a fresh 0700 directory of a random name, also in a sticky shared one.
            target = (
                Path(tempfile.mkdtemp(prefix=f"stasis-restore-{checkpoint_id}-", dir=memory))
                if memory is not None
                else Path(tempfile.mkdtemp(prefix=f"{checkpoint_id}-", dir=scratch))
            )
        except OSError as e:
            raise StoreError(
                f"cannot create a directory under {scratch} to restore {checkpoint_id}: "
                f"{reason(e)}"
            ) from e
        try:
            self._verify(manifest, target)
            yield manifest, target
        finally:
            shutil.rmtree(target, ignore_errors=True)

    @contextmanager
    def checked_images(self, checkpoint_id: str, scratch: Path) -> Iterator[tuple[Manifest, Path]]:
        """Yield the manifest and a local directory of images all checked before it is
        yielded: the checkpoint's own where nobody but root can change it (`images_in_place`:
        checked whole there rather than copied), else a private copy (`open_images`)."""
        in_place = self.images_in_place(checkpoint_id)
        if in_place is not None:
            self.verify(in_place[0])
            yield in_place
            return
        with self.open_images(checkpoint_id, scratch) as found:
            yield found

    def images_in_place(self, checkpoint_id: str) -> tuple[Manifest, Path] | None:
        """The manifest and the checkpoint's own directory, NOT yet verified, when CRIU may read
        the images where they are: a local uncompressed checkpoint that nobody but root can
        change (`_private.only_root_writes`: root-owned and not writable by others, up to /,
        on a local filesystem). Else None: use a path that hands CRIU only bytes it checked
        (stasis/daemon/streamed.py, lazystore.py, or `open_images`).

        Lets a restore verify (`verify`) while CRIU already reads, gating the resume of the
        restored tree on the result: nobody can change a byte between the two reads.
        """
        manifest = self._catalog.get(checkpoint_id)
        require_cryptographic_sums(manifest)
        in_place = self._tree.local_dir(checkpoint_id)
        if (
            in_place is None
            or not _plain(manifest)
            or not only_root_writes(in_place, [f.stored_name for f in manifest.files])
        ):
            return None
        return manifest, in_place

    def is_local(self, checkpoint_id: str) -> bool:
        """Whether the checkpoint's files are on a local filesystem (read by range cheaply)."""
        return self._tree.local_dir(checkpoint_id) is not None

    def fetch_files(
        self, manifest: Manifest, target: Path, only: Callable[[FileEntry], bool]
    ) -> None:
        """Decode the files `only` selects into the existing directory `target`, verified
        (CorruptCheckpointError); the sizes of all are checked. For a restore that fetches the
        rest itself (the page server of a lazy restore, stasis/daemon/lazystore.py)."""
        self._verify(manifest, target, only)

    def verify(self, manifest: Manifest, only: Callable[[FileEntry], bool] | None = None) -> None:
        """Check a checkpoint's files where they are (decoding what is stored compressed or
        sealed, keeping nothing); CorruptCheckpointError if one fails, EncryptionKeyError when
        it is encrypted with a key this node does not have.

        Sizes are always checked for every file; `only` limits which files are also hashed.
        """
        self._verify(manifest, None, only)

    def read_range(self, manifest: Manifest, name: str, offset: int, length: int) -> bytes:
        """`read_range_views`, joined into one bytes object."""
        views = self.read_range_views(manifest, name, offset, length)
        return bytes(views[0]) if len(views) == 1 else b"".join(views)

    def read_range_views(
        self, manifest: Manifest, name: str, offset: int, length: int
    ) -> builtins.list[memoryview]:
        """Plain bytes [offset, offset + length) of image file `name` of `manifest` (one that
        `get` returned: its signature is what vouches for the chunk table), fetching only the
        chunks they lie in and verifying each (its tag when encrypted, else its checksum): a
        mismatch raises CorruptCheckpointError, never wrong bytes. Thread-safe.

        UsageError for a range outside the file or an unknown file; StoreError for a
        checkpoint of format 1, whose files have no chunk table (restore those in full).
        """
        require_cryptographic_sums(manifest)
        entry = _entry(manifest, name)
        if offset < 0 or length < 0 or offset + length > entry.size_bytes:
            raise UsageError(
                f"bytes {offset}..{offset + length} are not within {name} of "
                f"checkpoint {manifest.id} ({entry.size_bytes} bytes)"
            )
        if length == 0:
            return []
        if entry.chunks is None:
            raise StoreError(
                f"checkpoint {manifest.id} was stored before images were "
                f"chunked: {name} has no chunk table for range reads; restore it "
                "in full"
            )
        decoder = self._decoder(manifest, entry)
        first, last = decoder.span(offset, length)
        offsets = entry.chunks.offsets
        start, end = offsets[first], offsets[last + 1]
        try:
            stored = self._tree.read_stored_range(manifest.id, entry.stored_name, start, end)
        except FileNotFoundError:
            raise corrupt(manifest.id, name, "is missing") from None
        except Exception as e:
            raise self._place.read_error(manifest.id, e) from e
        if len(stored) != end - start:
            raise corrupt(
                manifest.id,
                name,
                f"ends at byte {start + len(stored)} of "
                f"{entry.stored_size_bytes} stored (truncated?)",
            )
        view = memoryview(stored)
        pieces = []
        try:
            for index in range(first, last + 1):
                pieces.append(
                    decoder.decode(index, view[offsets[index] - start : offsets[index + 1] - start])
                )
        except ChunkError as e:
            raise corrupt(manifest.id, name, str(e)) from None
        # Views, not copies: a lazy restore sends these straight to lazy-pages (sendmsg), and
        # each copy of a GiB costs ~0.2 s of fresh memory on these machines.
        views, skip, left = [], offset - first * entry.chunks.size_bytes, length
        for piece in pieces:
            view = memoryview(piece)[skip : skip + left]
            views.append(view)
            left -= len(view)
            skip = 0
        return views

    def stream_file(self, manifest: Manifest, name: str, dst: Writer) -> None:
        """Decode image file `name` of `manifest` into `dst`, in order, every chunk checked
        (tag or checksum) before it is written, the file's size after (a whole-file checksum
        only where its chunks have none of their own): CorruptCheckpointError, never wrong
        bytes written. For a restore that reads its images
        as they are decoded (CRIU's image streamer, stasis/daemon/streamed.py)."""
        require_cryptographic_sums(manifest)
        entry = _entry(manifest, name)
        self._cipher(manifest)
        self._check_stored_size(manifest, entry)

        def decode() -> Streamed:
            with self._tree.open_stored(manifest.id, entry.stored_name) as src:
                if entry.chunks is None:
                    return unpack(src, dst, manifest.compression, entry.size_bytes)
                return unpack_chunked(src, dst, self._decoder(manifest, entry), whole_sum=False)

        self._checked(manifest, entry, None, decode)

    # -- checking ---------------------------------------------------------------------------

    def _cipher(self, manifest: Manifest) -> ChunkCipher | None:
        """The cipher of an encrypted checkpoint (None for one in the clear); EncryptionKeyError
        naming the key it needs when this node has not got it."""
        enc = manifest.encryption
        if enc is None:
            return None
        cache_key = (manifest.id, enc.wrapped_key)
        with self._ciphers_lock:
            cipher = self._ciphers.get(cache_key)
        if cipher is None:
            cipher = open_data_key(self.encryption, enc, manifest.id)
            with self._ciphers_lock:
                if len(self._ciphers) >= 64:
                    self._ciphers.clear()
                self._ciphers[cache_key] = cipher
        return cipher

    def _decoder(self, manifest: Manifest, entry: FileEntry) -> ChunkDecoder:
        """The decoder of a chunked file of `manifest` (EncryptionKeyError without its key)."""
        assert entry.chunks is not None
        return _decoder(entry, manifest.compression, self._cipher(manifest))

    def _verify(
        self,
        manifest: Manifest,
        target: Path | None,
        only: Callable[[FileEntry], bool] | None = None,
    ) -> None:
        """Check every file against the manifest, decoding it into `target` when one is given."""
        require_cryptographic_sums(manifest)
        checkpoint_id = manifest.id
        cipher = self._cipher(manifest)
        # Cheap size checks first: a truncated image fails at once, not after hashing GiBs.
        for entry in manifest.files:
            self._check_stored_size(manifest, entry)

        ranges = (
            ThreadPoolExecutor(RANGES_IN_FLIGHT, thread_name_prefix="stasis-fetch")
            if target is not None and self._tree.local_dir(checkpoint_id) is None
            else None
        )

        def check(entry: FileEntry) -> None:
            if (
                ranges is not None
                and target is not None
                and entry.chunks is not None
                and len(entry.chunks.stored_bytes) > 1
            ):
                self._checked(
                    manifest,
                    entry,
                    target,
                    lambda: self._fetch_ranged(manifest, entry, target, cipher, ranges),
                )
                return

            def decode() -> Streamed:
                with self._tree.open_stored(checkpoint_id, entry.stored_name) as src:
                    return _unpack_to(src, target, entry, manifest.compression, cipher, workers)

            self._checked(manifest, entry, target, decode)

        files = [f for f in manifest.files if only is None or only(f)]
        # Files on threads, and the chunks of each large one on threads of their own.
        workers = cpu_workers(len(files))
        try:
            in_parallel(check, files, workers)
        finally:
            if ranges is not None:
                ranges.shutdown(wait=True, cancel_futures=True)

    def _check_stored_size(self, manifest: Manifest, entry: FileEntry) -> None:
        try:
            stored = self._tree.stored_size(manifest.id, entry.stored_name)
        except FileNotFoundError:
            raise corrupt(manifest.id, entry.name, "is missing") from None
        except Exception as e:
            raise self._place.read_error(manifest.id, e) from e
        if stored != entry.stored_size_bytes:
            raise corrupt(
                manifest.id,
                entry.name,
                f"has {stored} bytes stored instead of {entry.stored_size_bytes} (truncated?)",
            )

    def _checked(
        self,
        manifest: Manifest,
        entry: FileEntry,
        target: Path | None,
        decode: Callable[[], Streamed],
    ) -> None:
        """Run `decode` of `entry` and hold what it got against the manifest; its failures as
        one line each (CorruptCheckpointError, StoreError)."""
        checkpoint_id = manifest.id
        try:
            got = decode()
        except ChunkError as e:
            raise corrupt(checkpoint_id, entry.name, str(e)) from None
        except DecompressionError as e:
            raise corrupt(checkpoint_id, entry.name, f"cannot be decompressed ({e})") from e
        except FileNotFoundError:
            raise corrupt(checkpoint_id, entry.name, "is missing") from None
        except OSError as e:
            if target is not None and e.errno in NO_SPACE:
                raise StoreError(
                    f"no space left on {target.parent} while unpacking checkpoint "
                    f"{checkpoint_id}: "
                    "free space or restore with another scratch directory"
                ) from e
            raise self._place.read_error(checkpoint_id, e) from e
        except (StasisError, ReaderGone):
            raise
        except Exception as e:
            raise self._place.read_error(checkpoint_id, e) from e
        if got.size_bytes != entry.size_bytes:
            # Decoding stops soon after the expected size, so "more" has no exact count.
            found = (
                "more than"
                if got.size_bytes > entry.size_bytes
                else f"{got.size_bytes} bytes instead of"
            )
            raise corrupt(checkpoint_id, entry.name, f"holds {found} {entry.size_bytes} bytes")
        # "": its chunks vouched for it (BLAKE3 or AES-GCM each); formats 1 and 2 only, else.
        if got.xxh3_128 and got.xxh3_128 != entry.xxh3_128:
            raise corrupt(checkpoint_id, entry.name, "fails its checksum")

    def _fetch_ranged(
        self,
        manifest: Manifest,
        entry: FileEntry,
        target: Path,
        cipher: ChunkCipher | None,
        pool: ThreadPoolExecutor,
    ) -> Streamed:
        """Decode a chunked file into `target` from ranged reads of several chunks each, up to
        RANGES_IN_FLIGHT at once on `pool`, each chunk checked and written at its offset; the
        whole file's checksum is still taken in order (ChunkError on any bad chunk)."""
        chunks = entry.chunks
        assert chunks is not None
        decoder = _decoder(entry, manifest.compression, cipher)
        offsets = chunks.offsets
        spans = [
            (first, min(first + RANGE_CHUNKS, decoder.count))
            for first in range(0, decoder.count, RANGE_CHUNKS)
        ]
        with open(target / entry.name, "xb") as dst:
            fd = dst.fileno()

            def one(span: tuple[int, int]) -> list[bytes | memoryview]:
                first, end_index = span
                start, end = offsets[first], offsets[end_index]
                stored = self._tree.read_stored_range(manifest.id, entry.stored_name, start, end)
                if len(stored) != end - start:
                    raise ChunkError(
                        f"ends in chunk {first} or after ({start + len(stored)} "
                        "bytes stored: truncated?)"
                    )
                view = memoryview(stored)
                covered: list[bytes | memoryview] = []
                for index in range(first, end_index):
                    piece = view[offsets[index] - start : offsets[index + 1] - start]
                    plain = decoder.decode(index, piece)
                    _pwrite_all(fd, plain, index * chunks.size_bytes)
                    covered.append(piece if decoder.spec.encrypted else plain)
                return covered

            # Formats 1 and 2 only (xxh3: damage, not forgers); format 3 chunks carry BLAKE3.
            whole = (
                xxhash.xxh3_128() if entry.xxh3_128 is not None and chunks.blake3 is None else None
            )
            ahead: deque[Future[list[bytes | memoryview]]] = deque()
            try:
                for span in spans:
                    ahead.append(pool.submit(one, span))
                    if len(ahead) >= RANGES_IN_FLIGHT:
                        for piece in ahead.popleft().result():
                            if whole is not None:
                                whole.update(piece)
                while ahead:
                    for piece in ahead.popleft().result():
                        if whole is not None:
                            whole.update(piece)
            finally:
                for future in ahead:
                    future.cancel()
                wait(ahead)
        # Each chunk decoded to exactly its plain size (decode checks): the file is whole.
        return Streamed(
            size_bytes=entry.size_bytes,
            stored_size_bytes=offsets[-1],
            xxh3_128=whole.hexdigest() if whole is not None else "",
        )


def _entry(manifest: Manifest, name: str) -> FileEntry:
    entry = next((f for f in manifest.files if f.name == name), None)
    if entry is None:
        raise UsageError(f"checkpoint {manifest.id} has no image file {name!r}")
    return entry


def _decoder(
    entry: FileEntry, compression: Compression, cipher: ChunkCipher | None
) -> ChunkDecoder:
    assert entry.chunks is not None
    return ChunkDecoder(
        entry.name,
        entry.size_bytes,
        entry.chunks,
        ChunkSpec(compression, cipher, entry.chunks.size_bytes),
    )


def _memory_scratch(size_bytes: int) -> Path | None:
    """MEMORY_SCRATCH when it is there and memory holds the images twice over (their copy, and
    the restored process reading them) with room to spare; else None."""
    try:
        st = os.statvfs(MEMORY_SCRATCH)
        with open("/proc/meminfo", "rb") as f:
            available = next(
                int(line.split()[1]) * 1024 for line in f if line.startswith(b"MemAvailable:")
            )
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    free = st.f_bavail * st.f_frsize
    margin = 256 << 20
    if free < size_bytes + margin or available < 3 * size_bytes + margin:
        return None
    return MEMORY_SCRATCH


def _plain(manifest: Manifest) -> bool:
    """Whether every stored file is its image as CRIU wrote it (readable in place)."""
    return manifest.compression == "none" and manifest.encryption is None


def _unpack_to(
    src: Reader,
    target: Path | None,
    entry: FileEntry,
    compression: Compression,
    cipher: ChunkCipher | None,
    workers: int,
) -> Streamed:
    if entry.chunks is None:  # format 1: one stream per file
        if target is None:
            return unpack(src, None, compression, entry.size_bytes)
        with open(target / entry.name, "xb") as dst:
            return unpack(src, dst, compression, entry.size_bytes)
    decoder = _decoder(entry, compression, cipher)
    if target is None:
        if decoder.spec.identity and entry.chunks.blake3 is None:
            # Formats 1 and 2, a plain file: its whole checksum says all its chunks' do.
            return unpack(src, None, "none", entry.size_bytes)
        return unpack_chunked(src, None, decoder, workers, dst_copies=True)
    with open(target / entry.name, "xb") as dst:
        return unpack_chunked(src, dst, decoder, workers, dst_copies=True)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
