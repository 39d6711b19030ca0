"""Encryption at rest: key files, per-checkpoint data keys, and the AEAD that seals each chunk.

    keys = KeyFiles(settings.encryption_key_file, settings.old_encryption_key_files)
    data_key = new_data_key(keys.current(), checkpoint_id)   # fresh 32 bytes, wrapped
    ciphertext, seal = data_key.cipher.seal("pages-1.img", 0, last=False, data=plain)
    manifest.encryption = data_key.encryption                  # algorithm, key id, wrapped key
    cipher = open_data_key(keys, manifest.encryption, checkpoint_id)  # restore

A key file holds 32 random bytes, raw or base64 (44 characters; surrounding whitespace is
ignored), in a file only root may read. Its id, written in manifests, is a domain-separated hash
of it (never the key): it names which key a checkpoint needs. Each checkpoint gets a data key
of its own, 32 random bytes, wrapped (AES-256-GCM) by the key file's key with the key id and
the checkpoint id as associated data, so a wrapped key copied into another checkpoint's
manifest does not open. Rotation re-wraps the data key; the images are never rewritten.

Each chunk of an image is sealed with AES-256-GCM under the data key: a random 96-bit nonce
(random rather than derived: a chunk sealed twice, by a follower and then again by publish, must
never reuse a nonce with other bytes), and associated data binding the checkpoint id, the file
name, the chunk's index and whether it is the last, so a chunk cannot be moved to another place,
file or checkpoint, and a file cannot be cut short at a chunk boundary. The stored chunk is the
bare ciphertext, as long as the plain bytes; its nonce and tag (the `seal`, 28 bytes) go to the
manifest's chunk table. So an uncompressed image is sealed in place, each chunk overwritten by
its ciphertext where CRIU wrote it, and published by a rename like a plain one (no second copy).
AES-GCM runs at ~7 GB/s on one core of these machines (AES-NI) and holds the GIL: threads do not
speed it up. Nothing here logs, and no error message carries a key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from stasis.errors import EncryptionKeyError, UsageError
from stasis.store.manifest import Encryption
from stasis.store.signing import read_secret_file

ALGORITHM = "aes-256-gcm"
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
# What sealing adds to each chunk, kept in the chunk table: its nonce and its tag.
SEAL_BYTES = NONCE_BYTES + TAG_BYTES
_MAX_KEY_FILE_BYTES = 4096
_KEY_ID_DOMAIN = b"stasis encryption key id\0"
_WRAP_DOMAIN = b"stasis-data-key-v1\0"
_CHUNK_DOMAIN = b"stasis-chunk-v1\0"


class DecryptionError(Exception):
    """A sealed chunk failed its tag: damaged, moved, or not sealed with this data key."""


def encryption_key_id(key: bytes) -> str:
    """The public name of an encryption key: 16 bytes of SHA-256 over it, in hex. Domain-separated
    from signing's key ids, so one file used for both never shows the same id."""
    return hashlib.sha256(_KEY_ID_DOMAIN + key).hexdigest()[:32]


@dataclass(frozen=True)
class Key:
    """A key file's key and where it came from (for messages); repr never shows the key."""

    path: str
    key_id: str
    secret: bytes = field(repr=False)


def read_key_file(path: str) -> Key:
    """The key in `path`: 32 bytes raw, or base64 of them. UsageError (one line, no key bytes)
    when it is missing, not root's alone, or not a key."""
    data = read_secret_file(
        Path(path),
        "encryption key file",
        _MAX_KEY_FILE_BYTES,
        f"make one with `head -c {KEY_BYTES} /dev/urandom > {path} && chmod 600 {path}`",
    )
    secret = _decode_key(data)
    if secret is None:
        raise UsageError(
            f"encryption key file {path} holds no key ({len(data)} bytes; a key is {KEY_BYTES} "
            f"random bytes, raw or base64): make one with "
            f"`head -c {KEY_BYTES} /dev/urandom > {path}`"
        )
    return Key(path=path, key_id=encryption_key_id(secret), secret=secret)


def _decode_key(data: bytes) -> bytes | None:
    if len(data) == KEY_BYTES:
        return data
    text = data.strip()
    if len(text) != 44:
        return None
    try:
        secret = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return secret if len(secret) == KEY_BYTES else None


class KeyFiles:
    """The configured key files, read each time they are needed (what a file holds can change
    under a running daemon; which files are named is settled at its start): `current` encrypts new checkpoints, the old ones still open what they wrapped."""

    def __init__(self, current: str = "", old: Sequence[str] = ()) -> None:
        self.current_path = current
        self.old_paths = tuple(old)

    def __repr__(self) -> str:
        return f"KeyFiles(current={self.current_path!r}, old={self.old_paths!r})"

    @property
    def configured(self) -> bool:
        return bool(self.current_path)

    def current(self) -> Key:
        if not self.current_path:
            raise UsageError(
                "encryption asked for, but no key is configured: set encryption_key_file "
                "(STASIS_ENCRYPTION_KEY_FILE) to a root-only file of 32 random bytes, e.g. "
                "`head -c 32 /dev/urandom > /etc/stasis/encryption.key && "
                "chmod 600 /etc/stasis/encryption.key`, and restart the daemon"
            )
        return read_key_file(self.current_path)

    def all(self) -> list[Key]:
        """Every configured key, current first; a file that cannot be read is an error."""
        paths = ([self.current_path] if self.current_path else []) + list(self.old_paths)
        return [read_key_file(p) for p in paths]

    def find(self, key_id: str) -> Key | None:
        for key in self.all():
            if key.key_id == key_id:
                return key
        return None


def _wrap_ad(key_id: str, checkpoint_id: str) -> bytes:
    return _WRAP_DOMAIN + key_id.encode() + b"\0" + checkpoint_id.encode()


def wrap(key: Key, checkpoint_id: str, data_key: bytes) -> Encryption:
    nonce = secrets.token_bytes(NONCE_BYTES)
    sealed = AESGCM(key.secret).encrypt(nonce, data_key, _wrap_ad(key.key_id, checkpoint_id))
    return Encryption(key_id=key.key_id, wrapped_key=base64.b64encode(nonce + sealed).decode())


def unwrap(key: Key, checkpoint_id: str, encryption: Encryption) -> bytes:
    """The data key `encryption` wraps; DecryptionError when `key` did not wrap it for this
    checkpoint (or the manifest's wrapped key was changed)."""
    try:
        blob = base64.b64decode(encryption.wrapped_key, validate=True)
        data_key = AESGCM(key.secret).decrypt(
            blob[:NONCE_BYTES], blob[NONCE_BYTES:], _wrap_ad(key.key_id, checkpoint_id)
        )
    except (InvalidTag, binascii.Error, ValueError) as e:
        raise DecryptionError("the wrapped data key does not open with this key") from e
    if len(data_key) != KEY_BYTES:
        raise DecryptionError("the wrapped data key has the wrong size")
    return data_key


class ChunkCipher:
    """Seals and opens the chunks of one checkpoint's images with its data key."""

    def __init__(self, data_key: bytes, checkpoint_id: str) -> None:
        self._aead = AESGCM(data_key)
        self._checkpoint = checkpoint_id.encode() + b"\0"

    def __repr__(self) -> str:
        return "ChunkCipher(...)"

    def _ad(self, name: str, index: int, last: bool) -> bytes:
        return (
            _CHUNK_DOMAIN
            + self._checkpoint
            + name.encode()
            + b"\0"
            + struct.pack(">QB", index, 1 if last else 0)
        )

    def seal(
        self, name: str, index: int, last: bool, data: bytes | memoryview
    ) -> tuple[memoryview, bytes]:
        """The sealed chunk as (ciphertext, seal): the ciphertext is as long as `data` and is
        what is stored; the seal (nonce and tag) goes to the chunk table."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = memoryview(self._aead.encrypt(nonce, data, self._ad(name, index, last)))
        return sealed[:-TAG_BYTES], nonce + bytes(sealed[-TAG_BYTES:])

    def open(
        self, name: str, index: int, last: bool, joined: bytes | bytearray | memoryview, seal: bytes
    ) -> bytes:
        """The plain bytes of a chunk; `joined` is its ciphertext followed by the tag of `seal`
        (see `join`: a reader that reads into a buffer one tag longer saves a copy)."""
        if len(seal) != SEAL_BYTES or len(joined) < TAG_BYTES:
            raise DecryptionError(f"chunk {index} has no seal")
        try:
            return self._aead.decrypt(seal[:NONCE_BYTES], joined, self._ad(name, index, last))
        except InvalidTag:
            raise DecryptionError(f"chunk {index} fails its authentication tag") from None


def join(ciphertext: bytes | memoryview, seal: bytes) -> bytearray:
    """A stored chunk and the tag of its seal, one after the other, as `ChunkCipher.open` takes
    them."""
    joined = bytearray(len(ciphertext) + TAG_BYTES)
    joined[: len(ciphertext)] = ciphertext
    joined[len(ciphertext) :] = seal[NONCE_BYTES:]
    return joined


@dataclass(frozen=True)
class DataKey:
    """A fresh checkpoint's data key: the cipher that seals its chunks and the manifest field
    that lets a holder of the key file open them."""

    cipher: ChunkCipher
    encryption: Encryption


def new_data_key(key: Key, checkpoint_id: str) -> DataKey:
    data_key = secrets.token_bytes(KEY_BYTES)
    return DataKey(ChunkCipher(data_key, checkpoint_id), wrap(key, checkpoint_id, data_key))


def open_data_key(keys: KeyFiles, encryption: Encryption, checkpoint_id: str) -> ChunkCipher:
    """The cipher of an encrypted checkpoint; EncryptionKeyError (one line, naming the key id
    it needs) when no configured key file has that id, or the one that has it does not open it."""
    key = keys.find(encryption.key_id)
    if key is None:
        have = [k.key_id for k in keys.all()]
        configured = (
            f"this node's key files have id{'s' if len(have) > 1 else ''} " f"{', '.join(have)}"
            if have
            else "this node has no encryption_key_file"
        )
        raise EncryptionKeyError(
            f"checkpoint {checkpoint_id} is encrypted with key {encryption.key_id} and "
            f"{configured}: set encryption_key_file (or old_encryption_key_files) to the key "
            f"file with id {encryption.key_id} (and restart the daemon)"
        )
    try:
        return ChunkCipher(unwrap(key, checkpoint_id, encryption), checkpoint_id)
    except DecryptionError:
        raise EncryptionKeyError(
            f"checkpoint {checkpoint_id} is encrypted with key {encryption.key_id}, but its "
            f"wrapped data key does not open with the key file of that id ({key.path}): the "
            "manifest was damaged; the checkpoint cannot be restored"
        ) from None


def rewrap(old: Key, new: Key, checkpoint_id: str, encryption: Encryption) -> Encryption:
    """`encryption` wrapped by `new` instead of `old` (key rotation); the data key, and so
    every image, stays as it is."""
    return wrap(new, checkpoint_id, unwrap(old, checkpoint_id, encryption))


def key_file_id(path: Path | str) -> str:
    """The id of the key in `path` (for `stasis check` and tests)."""
    return read_key_file(str(path)).key_id
