"""What a checkpoint is on paper: its manifest, its id, its label.

Owns the `manifest.json` schema (`Manifest`, `FileEntry` with its `Chunks` table, the
`Encryption` and `Signature` it carries), the facts
a caller supplies when publishing (`CheckpointInfo`, with what a restore depends on:
`RecordedFacts`, the shape of stasis.wire.RestoreFacts), and the validation of every name that
reaches the filesystem: checkpoint ids, labels and image file names. Nothing here does I/O.
"""

from __future__ import annotations

import hmac
import re
import secrets
from datetime import UTC, datetime
from functools import cached_property
from ipaddress import IPv4Address
from itertools import accumulate
from typing import Any, Literal

import blake3 as _blake3
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from stasis.errors import UsageError
from stasis.store.signing import Signature

# The methods (and what a dump may ask for: one, or `auto`, the store samples the images and
# decides) are the API's: declared once, in stasis.wire.
from stasis.wire import Compression as Compression
from stasis.wire import CompressionRequest as CompressionRequest

COMPRESSIONS: tuple[Compression, ...] = ("none", "zstd", "lz4")

MANIFEST_NAME = "manifest.json"
# Format 2: image files are stored as tables of chunks (`FileEntry.chunks`), and may be
# encrypted. A stasis that knows only format 1 would read those chunks as one stream and call the
# checkpoint corrupt; with 2 it skips it as "written by a newer one" and leaves it alone. Format
# 1 manifests (one zstd/lz4 stream or a plain file each, no chunk table) are still read.
# Format 3: images are bound to the signed manifest by BLAKE3 (per chunk, and per file over the
# chunks' digests or seals) instead of xxh3, which a store writer can forge (a 1 KiB block of a
# page image rewritten keeping every xxh3 in milliseconds). A stasis that knows only format 2
# would otherwise miss the sums and refuse the checkpoint as garbage.
FORMAT: Literal[3] = 3
FORMATS = (1, 2, 3)
# Formats whose images only xxh3 checks: restored only when encrypted (`has_cryptographic_sums`).
LEGACY_FORMATS = (1, 2)

ID_PATTERN = r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{6}$"
LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_ID_RE = re.compile(ID_PATTERN)
_LABEL_RE = re.compile(LABEL_PATTERN)


def new_checkpoint_id(now: datetime | None = None) -> str:
    """A fresh id such as "20261130T001512Z-3f9a1c": UTC time then 6 random hex digits.

    Ids sort by creation time as plain strings. A naive `now` is taken as local time.
    """
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    return f"{moment:%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def is_checkpoint_id(name: str) -> bool:
    return isinstance(name, str) and _ID_RE.fullmatch(name) is not None


def validate_checkpoint_id(checkpoint_id: str) -> str:
    """Return `checkpoint_id`, or raise UsageError: ids come from requests and become paths."""
    if not is_checkpoint_id(checkpoint_id):
        raise UsageError(
            f"invalid checkpoint id {checkpoint_id!r}: expected one like 20261130T001512Z-3f9a1c"
        )
    return checkpoint_id


def validate_label(label: str) -> str:
    """Return `label` unchanged, or raise UsageError saying what a label may contain."""
    if not isinstance(label, str) or not _LABEL_RE.fullmatch(label):
        raise UsageError(
            f"invalid label {label!r}: use 1 to 128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return label


def is_safe_file_name(name: str) -> bool:
    """True when `name` is one plain file name that cannot escape or shadow the checkpoint dir."""
    return (
        bool(name)
        and len(name) <= 255
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
        and name not in (".", "..")
        # manifest.json and its temporary twin belong to the store, never to the images.
        and not name.startswith((MANIFEST_NAME, "." + MANIFEST_NAME))
    )


def _safe_file_name(name: str) -> str:
    if not is_safe_file_name(name):
        raise ValueError(f"unsafe file name {name!r}")
    return name


# Bigger than any image, small enough for 8 bytes (file_digest).
_MAX_BYTES = 1 << 62


def _to_utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


# The highest sequence number: 11 digits in an index entry's name (index.py).
MAX_SEQ = 10**11 - 1


def order_key(info: CheckpointInfo) -> tuple[int, datetime, str]:
    """Sorts a series' checkpoints oldest first, without trusting any clock where it can: by
    sequence number (a child's is above its parent's, a later publish's above what it listed),
    then by the dumping node's clock between two published at once, then by id. Manifests from
    before sequence numbers come first (0), among themselves by their clocks as before."""
    return (info.seq or 0, info.created, info.id)


class Chunks(BaseModel):
    """How one stored file is cut: chunks of `size_bytes` plain bytes (the last one shorter),
    each compressed and sealed on its own, stored one after another. What a reader needs to
    fetch and check any range of the file without the rest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size_bytes: int = Field(gt=0, le=_MAX_BYTES)
    stored_bytes: list[int]  # per chunk, in order: its offset is the sum of those before it
    # Per chunk, of its plain bytes, BLAKE3 (32 bytes, hex; format 3): so that even a range of
    # an unencrypted file verifies on its own, against a forger too (the signature covers these).
    # None when the checkpoint is encrypted: each chunk's AEAD tag checks it, and a hash of plain
    # bytes would let whoever reads the manifest confirm a guess of them.
    blake3: list[str] | None = None
    # Formats 1 and 2: xxh3-64 per chunk. Read, never written: it detects damage, not a forger,
    # so an unencrypted checkpoint that has only these is not restored (`has_cryptographic_sums`).
    xxh3_64: list[str] | None = None
    # Per chunk of an encrypted file, in hex: its AES-GCM nonce and tag (crypt.py). The stored
    # chunk is the bare ciphertext, as long as what it seals: an uncompressed image is sealed
    # where CRIU wrote it. The signature over the manifest covers these too.
    seals: list[str] | None = None

    @field_validator("stored_bytes")
    @classmethod
    def _sizes(cls, sizes: list[int]) -> list[int]:
        if any(n < 0 for n in sizes):
            raise ValueError("negative chunk size")
        return sizes

    @field_validator("xxh3_64", "blake3", "seals")
    @classmethod
    def _hex(cls, values: list[str] | None, info: ValidationInfo) -> list[str] | None:
        pattern, problem = _CHUNK_HEX[info.field_name or ""]
        if values is not None and not all(pattern.fullmatch(v) for v in values):
            raise ValueError(problem)
        return values

    @cached_property
    def offsets(self) -> list[int]:
        """Where each chunk starts in the stored file, and (last) where the file ends."""
        return [0, *accumulate(self.stored_bytes)]


_XXH64_RE = re.compile(r"^[0-9a-f]{16}$")
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")


def file_digest(size_bytes: int, chunks: Chunks) -> str:
    """BLAKE3 over what binds a chunked file: its plain size, its chunk size and, in order,
    each chunk's BLAKE3 (in the clear) or seal (encrypted), in hex. Equal digests mean equal
    tables; with each chunk checked against its entry as it is read, the file's bytes."""
    items = chunks.blake3 if chunks.blake3 is not None else (chunks.seals or [])
    h = _blake3.blake3(b"stasis file v1\0")
    h.update(
        size_bytes.to_bytes(8, "little")
        + chunks.size_bytes.to_bytes(8, "little")
        + len(items).to_bytes(8, "little")
    )
    for item in items:
        h.update(bytes.fromhex(item))
    return h.hexdigest()


_SEAL_RE = re.compile(r"^[0-9a-f]{56}$")

# The per-chunk lists of hex strings a chunk table holds: their form, and what is wrong if not.
_CHUNK_HEX = {
    "xxh3_64": (_XXH64_RE, "a chunk checksum is not 16 hex digits"),
    "blake3": (_HASH_RE, "a chunk hash is not 64 hex digits"),
    "seals": (_SEAL_RE, "a chunk seal is not 56 hex digits"),
}


class Encryption(BaseModel):
    """How a checkpoint's images are encrypted (stasis/store/crypt.py); signed with the rest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    algorithm: Literal["aes-256-gcm"] = "aes-256-gcm"
    key_id: str = Field(pattern=r"^[0-9a-f]{32}$")  # the key file's id: who can unwrap
    wrapped_key: str = Field(max_length=256)  # base64 of nonce || AES-GCM(data key) || tag


class FileEntry(BaseModel):
    """One image file of a checkpoint."""

    model_config = ConfigDict(frozen=True)

    name: str  # name CRIU gave it, e.g. "pages-1.img"
    size_bytes: int = Field(ge=0, le=_MAX_BYTES)  # uncompressed
    stored_name: str  # name in the store, e.g. "pages-1.img.zst"
    stored_size_bytes: int = Field(ge=0)
    # Format 3: BLAKE3 over the file's chunk table (`file_digest`: its size, chunk size and each
    # chunk's BLAKE3, or seal when encrypted), checked against the table whenever a manifest is
    # read; each chunk is checked against its own entry as it is read. One pass over the bytes
    # (the chunks'), not two, and the signature covers both.
    blake3: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    # Formats 1 and 2: xxh3-128 of the uncompressed bytes (of the stored ones when encrypted). Read,
    # never written: it guards against damage only, a second preimage being practical.
    xxh3_128: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    chunks: Chunks | None = None  # None: format 1, one stream (or plain file) without a table

    _check_names = field_validator("name", "stored_name")(_safe_file_name)

    @model_validator(mode="after")
    def _table_fits(self) -> FileEntry:
        if self.blake3 is None and self.xxh3_128 is None:
            raise ValueError(f"{self.name}: no checksum")
        if self.chunks is None:
            if self.blake3 is not None:
                raise ValueError(f"{self.name}: a BLAKE3 digest without a chunk table")
            return self
        count = -(-self.size_bytes // self.chunks.size_bytes)
        if len(self.chunks.stored_bytes) != count:
            raise ValueError(
                f"{self.name}: {len(self.chunks.stored_bytes)} chunks for "
                f"{self.size_bytes} bytes, not {count}"
            )
        if self.chunks.xxh3_64 is not None and len(self.chunks.xxh3_64) != count:
            raise ValueError(
                f"{self.name}: {len(self.chunks.xxh3_64)} chunk checksums " f"for {count} chunks"
            )
        if self.chunks.blake3 is not None and len(self.chunks.blake3) != count:
            raise ValueError(
                f"{self.name}: {len(self.chunks.blake3)} chunk hashes " f"for {count} chunks"
            )
        if self.chunks.seals is not None and len(self.chunks.seals) != count:
            raise ValueError(
                f"{self.name}: {len(self.chunks.seals)} chunk seals " f"for {count} chunks"
            )
        if sum(self.chunks.stored_bytes) != self.stored_size_bytes:
            raise ValueError(f"{self.name}: its chunks do not add up to its stored size")
        if self.blake3 is not None:
            if self.chunks.blake3 is None and self.chunks.seals is None:
                raise ValueError(f"{self.name}: a BLAKE3 digest without chunk hashes or seals")
            if not hmac.compare_digest(self.blake3, file_digest(self.size_bytes, self.chunks)):
                raise ValueError(f"{self.name}: its BLAKE3 digest does not match its chunks")
        return self

    @property
    def cryptographic(self) -> bool:
        """Every chunk is bound to the manifest by a BLAKE3 hash, checked against the file's."""
        return (
            self.blake3 is not None and self.chunks is not None and self.chunks.blake3 is not None
        )


class RecordedFile(BaseModel):
    """A regular file the job had open at the dump (stasis.wire.OpenFile)."""

    model_config = ConfigDict(frozen=True)

    path: str
    size_bytes: int = Field(ge=0)
    mtime_ns: int
    mode: int = Field(ge=0, le=0o7777)
    access: Literal["read", "write", "append"]


class RecordedFacts(BaseModel):
    """What a restore of the checkpoint depends on, as the dumping node saw it
    (stasis.wire.RestoreFacts; stasis.engine.nodefacts gathers and compares them)."""

    model_config = ConfigDict(frozen=True)

    arch: str
    cpu_model: str
    cpu_flags: list[str]
    kernel: str
    criu_version: str
    stasis_version: str
    user: str
    uid: int
    files: list[RecordedFile] | None


class RecordedJobNet(BaseModel):
    """The job network a part of a multi-node job lived in (stasis/daemon/jobnet.py): the
    job's VXLAN id and the part's address in it. Its restore needs that network's part made on
    the restoring node first, with the same address (the namespace is left out of the images)."""

    model_config = ConfigDict(frozen=True)

    vni: int = Field(ge=1, le=(1 << 24) - 1)
    address: IPv4Address


class CheckpointInfo(BaseModel):
    """What the caller of `Store.publish` knows about a dump; the store adds sizes and files."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(pattern=ID_PATTERN)
    label: str = Field(pattern=LABEL_PATTERN)
    job: str
    host: str
    created: AwareDatetime = Field(default_factory=lambda: datetime.now(UTC))
    criu_version: str
    command: list[str]
    cwd: str
    env: dict[str, str] = {}
    user: str
    uid: int
    gid: int
    log_path: str | None = None
    extra: dict[str, Any] = {}  # room for later: gpu, slurm job id...
    # The checkpoint this one's job was restored from (None: a first run, or a manifest written
    # before stasis recorded it). A checkpoint is newer than its parent whatever the clocks of
    # the nodes that dumped them say (`order_key`).
    parent: str | None = Field(default=None, pattern=ID_PATTERN)
    # Place in its (owner, label) series, assigned by `Store.publish` (above the parent's and
    # above every one it listed); None before stasis numbered them. Signed like the rest.
    seq: int | None = Field(default=None, ge=1, le=MAX_SEQ)
    # None in manifests written before stasis recorded them: those restore unchecked.
    restore_facts: RecordedFacts | None = None
    # The job network the tree lived in (None: the node's own network, and every manifest
    # written before stasis recorded one).
    job_net: RecordedJobNet | None = None

    _utc = field_validator("created")(_to_utc)


class Manifest(CheckpointInfo):
    """The content of `<store>/<id>/manifest.json`; its presence makes the checkpoint exist."""

    # Readers skip manifests of a format they do not know instead of misreading them.
    format: Literal[1, 2, 3] = FORMAT
    size_bytes: int = Field(ge=0)  # total uncompressed image bytes
    stored_size_bytes: int = Field(ge=0)
    compression: Compression
    files: list[FileEntry]
    encryption: Encryption | None = None  # None: stored in the clear
    # HMAC-SHA256 over every other field (stasis/store/signing.py); None only before publishing:
    # a manifest read without one is refused.
    signature: Signature | None = None

    @property
    def has_cryptographic_sums(self) -> bool:
        """Whether a forger without keys cannot change an image byte unseen: every file
        hashed with BLAKE3 (format 3), or every chunk sealed with AES-GCM (encrypted)."""
        if self.encryption is not None:
            return True  # the validator below: every file has a chunk table with seals
        return all(f.cryptographic for f in self.files)

    @model_validator(mode="after")
    def _names_unique(self) -> Manifest:
        for attr in ("name", "stored_name"):
            names = [getattr(f, attr) for f in self.files]
            if len(set(names)) != len(names):
                raise ValueError(f"duplicate file {attr} in manifest")
        if self.encryption is not None and any(
            f.chunks is None or f.chunks.seals is None for f in self.files
        ):
            raise ValueError("an encrypted checkpoint without chunk seals")
        if self.encryption is None and any(
            f.chunks is not None and f.chunks.seals is not None for f in self.files
        ):
            raise ValueError("chunk seals in a checkpoint that is not encrypted")
        if self.encryption is not None and any(
            f.chunks is not None and f.chunks.blake3 for f in self.files
        ):
            raise ValueError("hashes of plain chunks in an encrypted checkpoint")
        if self.format >= 3 and any(f.blake3 is None for f in self.files):
            raise ValueError("a format 3 file without its BLAKE3 digest")
        return self

    @classmethod
    def build(
        cls,
        info: CheckpointInfo,
        compression: Compression,
        files: list[FileEntry],
        encryption: Encryption | None = None,
        format: Literal[1, 2, 3] = FORMAT,
    ) -> Manifest:
        """The manifest of a checkpoint described by `info` holding `files` (`format`: an
        older one, for tests of what older versions wrote)."""
        return cls(
            **info.model_dump(),
            format=format,
            compression=compression,
            encryption=encryption,
            files=sorted(files, key=lambda f: f.name),
            size_bytes=sum(f.size_bytes for f in files),
            stored_size_bytes=sum(f.stored_size_bytes for f in files),
        )
