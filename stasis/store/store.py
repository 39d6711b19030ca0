"""`Store`: the checkpoints any node sharing one directory or fsspec URL can list and restore.

A store is three parts over one tree (a local directory, an fsspec filesystem or S3: _tree.py):
- `catalog` (catalog.py): listing, the label index, deletion, pins, retention, gc, rekeying;
  what it lists is trusted (trust.py: every manifest signed when published and verified
  whenever it is read; a manifest without a valid signature by a trusted key never counts);
- `publisher` (publisher.py): staging, the follower that hashes, compresses and seals while
  CRIU writes, publishing (manifest.json written last);
- `reader` (reader.py): how images reach CRIU (in place, streamed, by range, fetched), every
  byte checked against the signed manifest first.
Every id and file name reaching the filesystem is validated first; every foreign error leaves
as one readable StoreError line. `Store` holds the three and answers for them (`store.get` is
`store.catalog.get`), so that a caller holds one object.

    store = node_store(settings)                      # as the node's daemon and helpers see it
    staging = store.staging_dir(checkpoint_id)        # criu dump --images-dir staging
    manifest = store.publish(info, compression="zstd")  # or store.discard(checkpoint_id) on failure
    with store.open_images(checkpoint_id, scratch) as (manifest, images_dir):
        ...                                           # criu restore --images-dir images_dir
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import fsspec
import fsspec.implementations.local

from stasis.config import Settings
from stasis.errors import UsageError
from stasis.store._local import LocalTree
from stasis.store._place import Place, reason
from stasis.store._remote import RemoteTree
from stasis.store._s3 import SHARED_OPTIONS, S3Tree
from stasis.store._tree import Tree
from stasis.store.catalog import STALE_STAGING_S, Catalog, GcReport, RekeyResult
from stasis.store.crypt import KeyFiles
from stasis.store.marker import KnownStores
from stasis.store.publisher import Publisher
from stasis.store.reader import ImageReader
from stasis.store.signing import Signer, node_keyring, process_keyring, read_secret_file
from stasis.store.trust import MANIFEST_PURPOSE, VERDICT_NOTE, Trust

__all__ = [
    "MANIFEST_PURPOSE",
    "STALE_STAGING_S",
    "VERDICT_NOTE",
    "GcReport",
    "RekeyResult",
    "Store",
    "node_store",
    "store_options",
]


class Store:
    """Checkpoints under `url`: a plain directory path or an fsspec URL (memory://x, s3://b/p...).

    `staging_root` is a local directory for dumps when the store is not a local directory (a local
    store stages inside itself, so that publishing is a rename). `keep` is how many checkpoints
    are kept per (owner, label), 0 for all. `keys` signs what is published and says which
    signatures are trusted: the daemon, and anything else that decides on what it reads, passes
    the node's (`signing.node_keyring`). Without it the store signs with a key that lives as long
    as this process and trusts nothing else: for tests and benchmarks of the store alone.
    `encryption`: the key files that encrypt new checkpoints (`new_data_key`) and open
    encrypted ones; none by default. `known_stores`: where this node remembers the local
    stores it has used (marker.py), so that one that goes missing (unmounted) is "cannot tell",
    not empty; None remembers nothing. `store_id`: the id a local store must have ("": any).
    """

    def __init__(
        self,
        url: str,
        *,
        staging_root: Path,
        keep: int = 5,
        keys: Signer | None = None,
        max_age_s: float = 0,
        options: Mapping[str, object] | None = None,
        encryption: KeyFiles | None = None,
        known_stores: Path | None = None,
        store_id: str = "",
    ) -> None:
        if keep < 0:
            raise UsageError(f"keep must be 0 (keep all) or more, not {keep}")
        if not url:
            raise UsageError("no checkpoint store given: set STASIS_STORE to a directory or URL")
        if max_age_s < 0:
            raise UsageError(f"max_age_s must be 0 (no age limit) or more, not {max_age_s}")
        self.url = url
        self.encryption = encryption if encryption is not None else KeyFiles()
        self._tree = _open_tree(
            url,
            staging_root,
            options or {},
            KnownStores(known_stores) if known_stores is not None else None,
            store_id,
        )
        place = Place(url, self._tree)
        self.trust = Trust(place, keys if keys is not None else process_keyring())
        self.catalog = Catalog(place, self.trust, keep, max_age_s)
        self.publisher = Publisher(place, self.trust, self.catalog, self.encryption)
        self.reader = ImageReader(place, self.catalog, self.encryption)
        # What callers outside the store ask of it, answered by the part that owns it.
        catalog, publisher, reader = self.catalog, self.publisher, self.reader
        self.get = catalog.get
        self.list = catalog.list
        self.latest = catalog.latest
        self.exists = catalog.exists
        self.untrusted_signers = catalog.untrusted_signers
        self.delete = catalog.delete
        self.delete_unless_pinned = catalog.delete_unless_pinned
        self.mark_restored = catalog.mark_restored
        self.was_restored = catalog.was_restored
        self.pin = catalog.pin
        self.pinned = catalog.pinned
        self.apply_retention = catalog.apply_retention
        self.expire = catalog.expire
        self.gc = catalog.gc
        self.remove_stale_staging = catalog.remove_stale_staging
        self.remove_unreadable = catalog.remove_unreadable
        self.ensure_index = catalog.ensure_index
        self.record_verdict = self.trust.record_verdict
        self.verdict = self.trust.verdict
        self.staging_dir = publisher.staging_dir
        self.discard = publisher.discard
        self.new_data_key = publisher.new_data_key
        self.follow = publisher.follow
        self.publish = publisher.publish
        self.open_images = reader.open_images
        self.images_in_place = reader.images_in_place
        self.require_cryptographic_sums = reader.require_cryptographic_sums
        self.is_local = reader.is_local
        self.fetch_files = reader.fetch_files
        self.verify = reader.verify
        self.read_range = reader.read_range
        self.read_range_views = reader.read_range_views
        self.stream_file = reader.stream_file

    def __repr__(self) -> str:
        return f"Store({self.url!r}, keep={self.keep})"

    @property
    def keep(self) -> int:
        """How many checkpoints retention keeps per (owner, label), 0 for all."""
        return self.catalog.keep

    @keep.setter
    def keep(self, keep: int) -> None:
        self.catalog.keep = keep

    @property
    def keys(self) -> Signer:
        """What signs what is published, and says which signatures are trusted."""
        return self.trust.keys

    @keys.setter
    def keys(self, keys: Signer) -> None:
        self.trust.keys = keys

    def rekey(self) -> RekeyResult:
        """Wrap the data key of every encrypted checkpoint an old key file wraps with the
        current one (`Catalog.rekey`)."""
        return self.catalog.rekey(self.encryption)


def _open_tree(
    url: str,
    staging_root: Path,
    options: Mapping[str, object],
    known: KnownStores | None = None,
    store_id: str = "",
) -> Tree:
    if "://" not in url and "::" not in url:
        return LocalTree(Path(url).absolute(), known, store_id)
    s3 = url.startswith(("s3://", "s3a://"))
    if s3:
        options = {**SHARED_OPTIONS, **options}
        if not url.split("://", 1)[1].split("/", 1)[0]:
            raise UsageError(f"checkpoint store {url} names no bucket: use s3://BUCKET/PREFIX")
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError, TypeError) as e:
        raise UsageError(f"cannot use checkpoint store {url}: {reason(e)}") from e
    if type(fs) is fsspec.implementations.local.LocalFileSystem:
        return LocalTree(Path(root), known, store_id)
    if s3:
        return S3Tree(fs, str(root), url, staging_root)
    return RemoteTree(fs, str(root), url, staging_root)


def store_options(settings: Settings) -> dict[str, object]:
    """fsspec options for the configured store: the S3 endpoint, region and keys of the config
    file (else botocore finds them where AWS tools look: AWS_* variables, ~/.aws)."""
    if not settings.store_url.startswith(("s3://", "s3a://")):
        return {}
    client: dict[str, str] = {}
    if settings.s3_endpoint_url:
        client["endpoint_url"] = settings.s3_endpoint_url
    if settings.s3_region:
        client["region_name"] = settings.s3_region
    options: dict[str, object] = {"client_kwargs": client} if client else {}
    secret = settings.s3_secret_access_key
    if settings.s3_secret_access_key_file:
        secret = _read_secret(Path(settings.s3_secret_access_key_file))
    if settings.s3_access_key_id or secret:
        options["key"] = settings.s3_access_key_id
        options["secret"] = secret
    return options


def _read_secret(path: Path) -> str:
    # An S3 secret key is some 40 characters; 4 KiB is far more than any.
    return (
        read_secret_file(path, "s3_secret_access_key_file", 4096).decode(errors="replace").strip()
    )


def node_store(settings: Settings, keys: Signer | None = None) -> Store:
    """The store as this node's daemon (and its helpers) use it: the configured URL, staging
    under the state directory, the node's keyring (`keys`: the one the daemon made at its
    start; else read from the state directory)."""
    return Store(
        settings.store_url,
        staging_root=settings.layout.staging,
        keep=settings.keep,
        keys=keys if keys is not None else node_keyring(settings),
        max_age_s=settings.keep_max_age_s,
        options=store_options(settings),
        encryption=KeyFiles(settings.encryption_key_file, settings.old_encryption_key_files),
        known_stores=settings.layout.known_stores,
        store_id=settings.store_id,
    )
