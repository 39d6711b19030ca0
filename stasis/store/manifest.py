"""What a checkpoint is on paper: its manifest, its id, its label.

Owns the `manifest.json` schema (`Manifest`, `FileEntry` with its `Chunks` table, the
`Encryption` and `Signature` it carries), the facts
a caller supplies when publishing (`CheckpointInfo`, with what a restore depends on:
`RecordedFacts`, the shape of stasis.wire.RestoreFacts), and the validation of every name that
reaches the filesystem: checkpoint ids, labels and image file names. Nothing here does I/O.
"""

from __future__ import annotations

import re
import secrets
from datetime import UTC, datetime
from functools import cached_property
from itertools import accumulate
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator, model_validator

from stasis.errors import UsageError
from stasis.store.signing import Signature

Compression = Literal["none", "zstd", "lz4"]
COMPRESSIONS: tuple[Compression, ...] = ("none", "zstd", "lz4")
# What a dump may ask for: a method, or `auto` (the store samples the images and decides).
CompressionRequest = Literal["none", "zstd", "lz4", "auto"]

MANIFEST_NAME = "manifest.json"
# Format 2: image files are stored as tables of chunks (`FileEntry.chunks`), and may be
# encrypted. A stasis that knows only format 1 would read those chunks as one stream and call the
# checkpoint corrupt; with 2 it skips it as "written by a newer one" and leaves it alone. Format
# 1 manifests (one zstd/lz4 stream or a plain file each, no chunk table) are still read.
FORMAT: Literal[2] = 2
FORMATS = (1, 2)

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


def _to_utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


class Chunks(BaseModel):
    """How one stored file is cut: chunks of `size_bytes` plain bytes (the last one shorter),
    each compressed and sealed on its own, stored one after another. What a reader needs to
    fetch and check any range of the file without the rest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size_bytes: int = Field(gt=0)
    stored_bytes: list[int]  # per chunk, in order: its offset is the sum of those before it
    # Per chunk, of its plain bytes: so that even a range of an unencrypted file verifies on
    # its own. None when the checkpoint is encrypted: each chunk's AEAD tag checks it, and a
    # checksum of plain bytes would let whoever reads the manifest confirm a guess of them.
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

    @field_validator("xxh3_64")
    @classmethod
    def _sums(cls, sums: list[str] | None) -> list[str] | None:
        if sums is not None and not all(_XXH64_RE.fullmatch(s) for s in sums):
            raise ValueError("a chunk checksum is not 16 hex digits")
        return sums

    @field_validator("seals")
    @classmethod
    def _seals(cls, seals: list[str] | None) -> list[str] | None:
        if seals is not None and not all(_SEAL_RE.fullmatch(s) for s in seals):
            raise ValueError("a chunk seal is not 56 hex digits")
        return seals

    @cached_property
    def offsets(self) -> list[int]:
        """Where each chunk starts in the stored file, and (last) where the file ends."""
        return [0, *accumulate(self.stored_bytes)]


_XXH64_RE = re.compile(r"^[0-9a-f]{16}$")
_SEAL_RE = re.compile(r"^[0-9a-f]{56}$")


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
    size_bytes: int = Field(ge=0)  # uncompressed
    stored_name: str  # name in the store, e.g. "pages-1.img.zst"
    stored_size_bytes: int = Field(ge=0)
    # xxh3-128 of the uncompressed bytes: it guards against damage, and at ~16 GB/s it costs a
    # dump or restore next to nothing. It is not a MAC: the signed manifest binds these
    # checksums to the checkpoint, but xxh3 itself does not resist a deliberate forger.
    # Of the bytes as stored when the checkpoint is encrypted (see Chunks.xxh3_64 for why).
    xxh3_128: str = Field(pattern=r"^[0-9a-f]{32}$")
    chunks: Chunks | None = None  # None: format 1, one stream (or plain file) without a table

    _check_names = field_validator("name", "stored_name")(_safe_file_name)

    @model_validator(mode="after")
    def _table_fits(self) -> FileEntry:
        if self.chunks is None:
            return self
        count = -(-self.size_bytes // self.chunks.size_bytes)
        if len(self.chunks.stored_bytes) != count:
            raise ValueError(f"{self.name}: {len(self.chunks.stored_bytes)} chunks for "
                             f"{self.size_bytes} bytes, not {count}")
        if self.chunks.xxh3_64 is not None and len(self.chunks.xxh3_64) != count:
            raise ValueError(f"{self.name}: {len(self.chunks.xxh3_64)} chunk checksums "
                             f"for {count} chunks")
        if self.chunks.seals is not None and len(self.chunks.seals) != count:
            raise ValueError(f"{self.name}: {len(self.chunks.seals)} chunk seals "
                             f"for {count} chunks")
        if sum(self.chunks.stored_bytes) != self.stored_size_bytes:
            raise ValueError(f"{self.name}: its chunks do not add up to its stored size")
        return self


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
    extra: dict[str, Any] = {}  # room for later: parent checkpoint, gpu, slurm job id...
    # None in manifests written before stasis recorded them: those restore unchecked.
    restore_facts: RecordedFacts | None = None

    _utc = field_validator("created")(_to_utc)


class Manifest(CheckpointInfo):
    """The content of `<store>/<id>/manifest.json`; its presence makes the checkpoint exist."""

    # Readers skip manifests of a format they do not know instead of misreading them.
    format: Literal[1, 2] = FORMAT
    size_bytes: int = Field(ge=0)  # total uncompressed image bytes
    stored_size_bytes: int = Field(ge=0)
    compression: Compression
    files: list[FileEntry]
    encryption: Encryption | None = None  # None: stored in the clear
    # HMAC-SHA256 over every other field (stasis/store/signing.py); None only before publishing:
    # a manifest read without one is refused.
    signature: Signature | None = None

    @model_validator(mode="after")
    def _names_unique(self) -> Manifest:
        for attr in ("name", "stored_name"):
            names = [getattr(f, attr) for f in self.files]
            if len(set(names)) != len(names):
                raise ValueError(f"duplicate file {attr} in manifest")
        if self.encryption is not None and any(f.chunks is None or f.chunks.seals is None
                                               for f in self.files):
            raise ValueError("an encrypted checkpoint without chunk seals")
        if self.encryption is None and any(f.chunks is not None and f.chunks.seals is not None
                                           for f in self.files):
            raise ValueError("chunk seals in a checkpoint that is not encrypted")
        return self

    @classmethod
    def build(
        cls, info: CheckpointInfo, compression: Compression, files: list[FileEntry],
        encryption: Encryption | None = None,
    ) -> Manifest:
        """The manifest of a checkpoint described by `info` holding `files`."""
        return cls(
            **info.model_dump(),
            compression=compression,
            encryption=encryption,
            files=sorted(files, key=lambda f: f.name),
            size_bytes=sum(f.size_bytes for f in files),
            stored_size_bytes=sum(f.stored_size_bytes for f in files),
        )
