"""The checkpoint store: CRIU images plus a manifest.json each, on a directory or an fsspec URL.

Owns where checkpoints live and what they contain: staging directories for dumps, publishing
(hashing, compression, the manifest written last), listing, verified fetching for restore,
deletion and retention per (owner, label). The store is the source of truth: any node that sees
the same store can list and restore its checkpoints. It does not run CRIU (the engine does) and
keeps no state outside the store itself, but for the ids of the local stores a node has used
(marker.py): so that an unmounted one is "cannot tell", not empty.

`Store` (store.py) composes the parts: `catalog` (catalog.py: listing, label index, pins,
retention, gc, rekeying; what it lists is trusted: trust.py), `publisher` (publisher.py:
staging, the follower, publishing) and `reader` (reader.py: how images reach CRIU, checked),
over one tree per backend (_local.py, _remote.py, _s3.py, behind the protocol in _tree.py).
"""

from stasis.store.crypt import DataKey, KeyFiles
from stasis.store.manifest import (
    COMPRESSIONS,
    CheckpointInfo,
    Compression,
    CompressionRequest,
    FileEntry,
    Manifest,
    RecordedFacts,
    RecordedJobNet,
    is_checkpoint_id,
    new_checkpoint_id,
    order_key,
    validate_checkpoint_id,
    validate_label,
)
from stasis.store.signing import Keyring, Signature, Signer, node_keyring
from stasis.store.store import Store, node_store

__all__ = [
    "COMPRESSIONS",
    "CheckpointInfo",
    "Compression",
    "CompressionRequest",
    "DataKey",
    "FileEntry",
    "KeyFiles",
    "Keyring",
    "Manifest",
    "RecordedFacts",
    "RecordedJobNet",
    "Signature",
    "Signer",
    "Store",
    "is_checkpoint_id",
    "new_checkpoint_id",
    "node_keyring",
    "node_store",
    "order_key",
    "validate_checkpoint_id",
    "validate_label",
]
