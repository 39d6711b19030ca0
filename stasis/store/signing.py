"""Who may have written a manifest: a keyed MAC (HMAC-SHA256) with a node or site key.

A checkpoint's manifest says whose process it is (uid), what to run and the BLAKE3 hash of every
image chunk and file (format 3; AES-GCM seals when encrypted; formats 1 and 2 had xxh3 sums, which
a forger can match, and are restored only when encrypted). The MAC covers them all. Whoever can write the store (a shared directory, a bucket several nodes write)
could otherwise edit it and have root restore any process as any user. So every manifest is
signed: HMAC-SHA256, with a key only root on the signing node holds, over a canonical
serialisation of the whole manifest (every field but the signature itself, files and their
checksums included). Readers refuse a manifest without a signature, with one that does not verify,
or signed by a key they do not trust.

    keys = node_keyring(settings, create=True)   # the daemon: <state_dir>/keys/node.key
    signature = keys.sign("manifest", document)  # document: the manifest as JSON values
    keys.verify("manifest", document, signature) # Verdict.VALID / UNKNOWN_KEY / MISMATCH

Keys are 32 random bytes (at least) in a root-only file. The key id written next to the MAC is a
hash of the key, never the key; it names which key to trust. The signing key is the site key when
one is configured (every node of a site signs with the same key, so all trust each other), else
the node's own. A node trusts its own key, the site key and every key named by `trusted_keys`.
A MAC key is a secret: a node that trusts another's key can also sign as that node. Keep key
files root-only and copy them only between nodes of the same site.

`Signer` is the interface the store signs and verifies through, for other key holders (a KMS, a
control plane) to implement; `Keyring` is the file-based one. This module does no I/O but reading
and creating key files.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from stasis.atomicfile import create_once
from stasis.config import Settings
from stasis.errors import UsageError
from stasis.fdio import NotRegularFile, open_regular

KEY_BYTES = 32
# A key file is a few bytes; anything much larger is not one.
_MAX_KEY_BYTES = 4096
NODE_KEY = "node.key"


class Signature(BaseModel):
    """What a signed document carries: which key signed it (a hash of the key) and the MAC."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    hmac_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Verdict(enum.Enum):
    VALID = "valid"
    UNKNOWN_KEY = "signed by a key this node does not trust"
    MISMATCH = "does not match its signature"


class Signer(Protocol):
    """Signs documents and checks their signatures; `purpose` keeps documents of different
    kinds from standing in for each other (a manifest's MAC never verifies anything else)."""

    @property
    def key_id(self) -> str: ...

    def sign(self, purpose: str, document: Mapping[str, Any]) -> Signature: ...

    def verify(
        self, purpose: str, document: Mapping[str, Any], signature: Signature
    ) -> Verdict: ...


def key_id(key: bytes) -> str:
    """The public name of `key`: 16 bytes of SHA-256 over it, in hex (it does not reveal it)."""
    return hashlib.sha256(b"stasis key id\0" + key).hexdigest()[:32]


def canonical(document: Mapping[str, Any]) -> bytes:
    """One byte string per JSON value, whoever wrote it and however it was indented: sorted
    keys, no spaces, ASCII only (escapes stay escapes, so nothing fails to encode)."""
    return json.dumps(
        document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True
    ).encode("ascii")


def _payload(purpose: str, document: Mapping[str, Any]) -> bytes:
    return b"stasis-signed-v1\0" + purpose.encode() + b"\0" + canonical(document)


class Keyring:
    """The key this node signs with and every key it trusts (its own included)."""

    def __init__(self, signing_key: bytes, trusted: Iterable[bytes] = ()) -> None:
        for key in (signing_key, *trusted):
            if len(key) < KEY_BYTES:
                raise UsageError(f"a signing key needs at least {KEY_BYTES} bytes, not {len(key)}")
        self._signing_key = signing_key
        self._key_id = key_id(signing_key)
        self._trusted = {key_id(k): k for k in (signing_key, *trusted)}

    @classmethod
    def ephemeral(cls) -> Keyring:
        """A random key that lives as long as this object: what it signs, nobody else trusts."""
        return cls(secrets.token_bytes(KEY_BYTES))

    def __repr__(self) -> str:  # never the keys themselves
        return f"Keyring(signs with {self._key_id}, trusts {len(self._trusted)})"

    @property
    def key_id(self) -> str:
        return self._key_id

    @property
    def trusted_ids(self) -> frozenset[str]:
        return frozenset(self._trusted)

    def sign(self, purpose: str, document: Mapping[str, Any]) -> Signature:
        mac = hmac.new(self._signing_key, _payload(purpose, document), hashlib.sha256)
        return Signature(key_id=self._key_id, hmac_sha256=mac.hexdigest())

    def verify(self, purpose: str, document: Mapping[str, Any], signature: Signature) -> Verdict:
        key = self._trusted.get(signature.key_id)
        if key is None:
            return Verdict.UNKNOWN_KEY
        expected = hmac.new(key, _payload(purpose, document), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, signature.hmac_sha256):
            return Verdict.MISMATCH
        return Verdict.VALID


@cache
def process_keyring() -> Keyring:
    """One ephemeral keyring for this whole process: what a `Store` built without keys signs
    and trusts (tests and benchmarks of the store itself). Never written anywhere."""
    return Keyring.ephemeral()


# -- key files ------------------------------------------------------------------------------


def node_keyring(settings: Settings, create: bool = False) -> Keyring:
    """The keyring the settings describe: the node key `<state_dir>/keys/node.key` (made when
    `create` and missing: the daemon at its start), `site_key`, `trusted_keys`."""
    return load_keyring(settings.layout.keys, settings.site_key, settings.trusted_keys, create)


def load_keyring(
    keys_dir: Path, site_key: str, trusted_keys: Sequence[str], create: bool
) -> Keyring:
    node_path = keys_dir / NODE_KEY
    if create:
        _create_node_key(keys_dir, node_path)
    node = read_key(node_path, "node key")
    trusted = [node]
    signing = node
    if site_key:
        signing = read_key(Path(site_key), "site_key")
        trusted.append(signing)
    for entry in trusted_keys:
        trusted.extend(read_key(path, "trusted key") for path in _key_files(Path(entry)))
    return Keyring(signing, trusted)


def _key_files(path: Path) -> list[Path]:
    """`path` itself, or the key files in it when it is a directory (hidden files left out:
    editors and copies leave those)."""
    try:
        if not path.is_dir():
            return [path]
        return sorted(p for p in path.iterdir() if not p.name.startswith("."))
    except OSError as e:
        raise UsageError(f"cannot read trusted keys in {path}: {e.strerror}") from e


def read_secret_file(path: Path, what: str, max_bytes: int, missing_hint: str = "") -> bytes:
    """The first `max_bytes` + 1 bytes of a file holding a secret (a key, a password); refuses
    (UsageError, one line, never the contents) one that is missing, a link, not a regular file,
    or that others could read or replace. `missing_hint` ends the line for a missing file."""
    try:
        fd, st = open_regular(path)
    except FileNotFoundError:
        raise UsageError(
            f"{what} {path} does not exist" + (f": {missing_hint}" if missing_hint else "")
        ) from None
    except NotRegularFile:
        raise UsageError(f"{what} {path} is not a regular file") from None
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror}") from e
    try:
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o077:
            raise UsageError(
                f"{what} {path} may be read or written by other users (mode "
                f"{st.st_mode & 0o7777:o}, owner uid {st.st_uid}): it is a secret; "
                f"`chown root {path}` and `chmod 600 {path}`"
            )
        return os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)


def read_key(path: Path, what: str) -> bytes:
    """A key file's bytes; refuses one that others could read or replace (UsageError)."""
    key = read_secret_file(path, what, _MAX_KEY_BYTES)
    if not KEY_BYTES <= len(key) <= _MAX_KEY_BYTES:
        raise UsageError(
            f"{what} {path} holds {len(key)} bytes, not a key: make one with "
            f"`head -c {KEY_BYTES} /dev/urandom > {path}`"
        )
    return key


def _create_node_key(keys_dir: Path, path: Path) -> None:
    """32 random bytes in a root-only file, unless one is there: never replaced, since every
    checkpoint it signed would then be refused."""
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(keys_dir, 0o700)
    if os.path.lexists(path):
        return
    # Not replaced if two daemons start at once: the first key stands for both.
    create_once(path, secrets.token_bytes(KEY_BYTES))
