"""`Store`: the checkpoints any node sharing one directory or fsspec URL can list and restore.

Owns the life cycle of a checkpoint: staging (CRIU dumps into a local directory), publishing
(sizes, BLAKE3 hashes per chunk and per file, compression, manifest.json written last), listing,
verified fetching for restore, deletion and retention per (owner, label). Every id and file name reaching the filesystem
is validated first; every foreign error leaves as one readable StoreError line.

Every manifest is signed when published and verified whenever it is read (signing.py): a
manifest without a signature, with one that does not verify, or signed by a key the store's
keyring does not trust is never listed, never restored, never counted by retention. What a
restore hands CRIU is what was checked against it: its own copy of each chunk (streamed, served,
or decoded into a private directory), or files in place only where nobody but root can change
them (`images_in_place`). Unencrypted checkpoints of formats 1 and 2, which only xxh3 checks,
are listed but not restored (`require_cryptographic_sums`).

    store = node_store(settings)                      # as the node's daemon and helpers see it
    staging = store.staging_dir(checkpoint_id)        # criu dump --images-dir staging
    manifest = store.publish(info, compression="zstd")  # or store.discard(checkpoint_id) on failure
    with store.open_images(checkpoint_id, scratch) as (manifest, images_dir):
        ...                                           # criu restore --images-dir images_dir
"""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import fsspec
import fsspec.implementations.local
import xxhash
from pydantic import ValidationError

from stasis.config import Settings
from stasis.errors import (
    CorruptCheckpointError,
    NotFoundError,
    ReaderGone,
    StasisError,
    StoreError,
    UnreadableManifestError,
    UntrustedCheckpointError,
    UsageError,
)
from stasis.store._local import LocalTree
from stasis.store._private import only_root_writes
from stasis.store._remote import RemoteTree
from stasis.store._s3 import SHARED_OPTIONS, S3Tree, describe
from stasis.store._tree import Tree, in_parallel, manifest_bytes, remove_idle, staged_names
from stasis.store.chunked import ChunkDecoder, ChunkError, ChunkSpec, unpack_chunked
from stasis.store.compression import (
    DecompressionError,
    Reader,
    Streamed,
    Writer,
    choose_compression,
    cpu_workers,
    unpack,
)
from stasis.store.crypt import ChunkCipher, DataKey, KeyFiles, new_data_key, open_data_key, rewrap
from stasis.store.index import Entry, entry_name
from stasis.store.manifest import (
    COMPRESSIONS,
    FORMATS,
    MAX_SEQ,
    CheckpointInfo,
    Compression,
    CompressionRequest,
    FileEntry,
    Manifest,
    is_checkpoint_id,
    order_key,
    validate_checkpoint_id,
    validate_label,
)
from stasis.store.marker import KnownStores
from stasis.store.signing import (
    Signature,
    Signer,
    Verdict,
    node_keyring,
    process_keyring,
    read_secret_file,
)
from stasis.store.tailhash import Partial, TailHasher, local_opener

log = logging.getLogger(__name__)

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# A dump writes its images continuously; one whose staging directory sat idle this long is dead.
STALE_STAGING_S = 3600.0
# A full restore from a remote store fetches each chunked file in ranged GETs of this many
# chunks (16 MiB of plain bytes at most: what is held per range), this many at once: one stream
# per file leaves most of an object store's bandwidth unused.
RANGE_CHUNKS = 16
RANGES_IN_FLIGHT = 8
# What a manifest's signature is for (signing.py): it verifies nothing else.
MANIFEST_PURPOSE = "manifest"
# Beside a checkpoint's images: some node restored it (`Store.mark_restored`).
RESTORED_NOTE = "restored.json"
# Beside a checkpoint's images: the newest verdict of `stasis verify` on it, signed
# (`Store.record_verdict`); what its signature is for, so that it verifies nothing else.
VERDICT_NOTE = "verdict.json"
VERDICT_PURPOSE = "verify-verdict"
_VERDICT_MAX = 1 << 16  # a verdict is a few hundred bytes; what lies past this is not read
# Index entries `latest` reads in one go: S3's page.
_FIRST_PAGE = 1000
# Pins (`Store.pin`): notes beside a checkpoint's images, named so, refreshed by the pinning
# process this often; one not refreshed for PIN_TTL_S (its node died) lapses. Ages are
# measured by the store's clock (`Tree.clock`), so a node whose clock is off neither keeps a
# dead pin forever nor takes a live one for dead.
PIN_PREFIX = "pin-"
PIN_REFRESH_S = 60.0
PIN_TTL_S = 600.0
# A publish refreshes its heartbeat (`Tree.heartbeat`) this often, from the dump's first upload
# to its manifest: gc leaves alone what a publish refreshed within its `idle_s`, which must be
# well above this.
HEARTBEAT_S = 60.0


@dataclass
class GcReport:
    """What `Store.gc` removed (and the index entries it added)."""

    staging: list[str] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)  # checkpoints without a manifest
    uploads: list[str] = field(default_factory=list)  # keys of aborted multipart uploads
    entries_removed: int = 0
    entries_added: int = 0


class _UnreadableManifest(Exception):
    """Not a manifest this stasis can read: garbage, or (`known_format` False) one of a format
    it does not know, which a newer stasis sharing the store may have written."""

    def __init__(self, why: str, known_format: bool = True) -> None:
        super().__init__(why)
        self.known_format = known_format


class _UntrustedManifest(Exception):
    """A well-formed manifest whose signature is missing, wrong or made with a key not trusted."""

    def __init__(
        self, verdict: Verdict | None, key_id: str | None, claims: Manifest | None = None
    ) -> None:
        super().__init__(verdict.value if verdict else "not signed")
        self.verdict = verdict
        self.key_id = key_id
        # What the manifest says of itself, unverified: a hint for an error message only.
        self.claims = claims


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
        self.keep = keep
        self.max_age_s = max_age_s
        self.keys: Signer = keys if keys is not None else process_keyring()
        self.encryption = encryption if encryption is not None else KeyFiles()
        self._tree = _open_tree(
            url,
            staging_root,
            options or {},
            KnownStores(known_stores) if known_stores is not None else None,
            store_id,
        )
        # Checkpoints already warned about: a store with many bad ones must not flood the log.
        self._warned: set[str] = set()
        # Opened data keys, by (checkpoint, wrapped key): range reads come one page run at a
        # time, and each would otherwise read the key file and unwrap again.
        self._ciphers: dict[tuple[str, str], ChunkCipher] = {}
        self._ciphers_lock = threading.Lock()
        # Heartbeats of the publishes under way in this process, by checkpoint id.
        self._beats: dict[str, _Repeating] = {}
        self._beats_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Store({self.url!r}, keep={self.keep})"

    # -- writing ----------------------------------------------------------------------------

    def staging_dir(self, checkpoint_id: str) -> Path:
        """A fresh, empty, root-only local directory for CRIU to dump the images of `checkpoint_id`.

        Pass the id to `publish` (via CheckpointInfo) or `discard` afterwards. Never listed.
        """
        validate_checkpoint_id(checkpoint_id)
        try:
            return self._tree.staging_dir(checkpoint_id)
        except OSError as e:
            raise self._write_error(checkpoint_id, e) from e

    def discard(self, checkpoint_id: str) -> None:
        """Remove the staging directory of a dump that failed; nothing happens if there is none."""
        validate_checkpoint_id(checkpoint_id)
        self._end_beat(checkpoint_id)
        self._tree.discard(checkpoint_id)

    def new_data_key(self, checkpoint_id: str) -> DataKey:
        """A fresh data key for `checkpoint_id`, wrapped by the current key file: pass it to
        `follow` and `publish`. Ask for it before CRIU runs: UsageError (one line) when no key
        file is configured or it cannot be used, and nothing was dumped yet."""
        validate_checkpoint_id(checkpoint_id)
        return new_data_key(self.encryption.current(), checkpoint_id)

    def publish(
        self,
        info: CheckpointInfo,
        compression: CompressionRequest = "none",
        source: Path | None = None,
        hashed: Mapping[str, Partial] | None = None,
        data_key: DataKey | None = None,
    ) -> Manifest:
        """Turn the images staged for `info.id` into a listed checkpoint and return its manifest.

        Hashes every file, compresses it if asked, stores it and writes manifest.json last. The
        staging directory is consumed either way: on success it became the checkpoint; on any
        failure everything written is removed, nothing is listed, and StoreError says why (for a
        full disk: "no space left on ..."). Then the oldest checkpoints of the label beyond `keep`
        are deleted: those of the same owner (`info.uid`) only, since a label belongs to its owner.

        `source`: the images were staged outside the store (see `stage_fast`); they are read
        from there, and the directory is removed either way. `hashed`: what a `follow` of the
        staging directory hashed while CRIU wrote it. `data_key` (`new_data_key`): encrypt the
        images; the plain staged files are removed either way.
        """
        validate_checkpoint_id(info.id)
        validate_label(info.label)
        if compression == "auto":
            compression = self._choose(info.id, source)
        if compression not in COMPRESSIONS:
            raise UsageError(
                f"unknown compression {compression!r}: use one of {', '.join(COMPRESSIONS)}"
            )
        entry: str | None = None
        beat = self._beat(info.id)
        try:
            try:
                info = info.model_copy(update={"seq": self._next_seq(info)})
            except StoreError as e:
                # Said as a failed write, as any failure of the publish is: the store went away
                # while CRIU wrote, and this read was the first to find out.
                raise StoreError(f"cannot write checkpoint {info.id} to {self.url}: {e}") from e
            entry = _entry_of(info)
            # Before the manifest: a published checkpoint always has its entry (index.py).
            self._tree.index_put(info.label, info.uid, entry)
            manifest = self._tree.publish(
                info, compression, source, hashed, seal=self._seal, data_key=data_key
            )
        except BaseException as e:
            self._end_beat(info.id, beat)
            if entry is not None:
                self._forget_entry(info.label, info.uid, entry)
            # The index entry can fail before the tree's publish starts (the server went
            # away while CRIU wrote): the staged images and their streams are consumed anyway.
            self._discard_quietly(info.id, source)
            if isinstance(e, StasisError) or not isinstance(e, Exception):
                raise
            # OSError, or the own types of fsspec backends
            raise self._write_error(info.id, e) from e
        self._end_beat(info.id, beat)
        try:
            self._retain(info.label, info.uid, protect=info.id)
        except StasisError as e:
            # The checkpoint is safe; a failed cleanup must not make the dump look failed.
            log.warning(
                "retention for label %s failed after publishing %s: %s", info.label, info.id, e
            )
        return manifest

    def _beat(self, checkpoint_id: str) -> _Repeating:
        """The heartbeat of the publish of `checkpoint_id`, started now unless `follow` did."""
        with self._beats_lock:
            beat = self._beats.get(checkpoint_id)
            if beat is None:
                beat = self._beats[checkpoint_id] = _Repeating(
                    HEARTBEAT_S,
                    lambda: self._tree.heartbeat(checkpoint_id),
                    f"the publish of {checkpoint_id}",
                )
            return beat

    def _end_beat(self, checkpoint_id: str, beat: _Repeating | None = None) -> None:
        with self._beats_lock:
            beat = self._beats.pop(checkpoint_id, beat)
        if beat is None:
            return
        beat.stop()
        try:
            self._tree.end_heartbeat(checkpoint_id)
        except Exception as e:  # a stale heartbeat is what a dead publish leaves: gc takes it
            log.debug("cannot remove the heartbeat of %s: %s", checkpoint_id, e)

    def _next_seq(self, info: CheckpointInfo) -> int:
        """`info`'s place in its (owner, label) series: one above the newest listed and above its
        parent's. Two nodes publishing into one series at once may both take the same number;
        neither can be the other's parent (a parent is published before its child's job starts),
        so lineage still holds, and `order_key` tells the two apart by clock, then by id."""
        highest = 0
        try:
            highest = self.latest(info.label, uid=info.uid).seq or 0
        except NotFoundError:
            pass
        if info.parent is not None:
            try:
                parent = self.get(info.parent)
            except (NotFoundError, UnreadableManifestError, UntrustedCheckpointError):
                parent = None  # deleted or not ours to trust: nothing to be above
            if parent is not None and parent.label == info.label and parent.uid == info.uid:
                highest = max(highest, parent.seq or 0)
        return min(highest + 1, MAX_SEQ)

    def remove_stale_staging(self, idle_s: float = STALE_STAGING_S) -> list[str]:
        """Remove what dumps that never finished (a daemon killed mid-dump, a node crash) left
        in the staging area: entries nothing was written to for `idle_s`. Those are never listed
        (no manifest) but hold disk space. The age rule, not "everything", because a local store
        may be shared with other nodes whose dumps are running. Returns the names removed."""
        try:
            area = self._tree.staging_area()
            return remove_idle(area, idle_s, _clock_of(area))
        except OSError as e:
            raise StoreError(
                f"cannot clean the staging area of {self._tree.where}: {_reason(e)}"
            ) from e

    def remove_unreadable(self, older_than_s: float) -> list[str]:
        """Delete the checkpoints whose manifest.json is garbage and was written more than
        `older_than_s` ago; return their ids. Nobody can restore them or tell whose they are,
        and retention, which counts per (owner, label), never sees them.

        Left alone: manifests of a format this stasis does not know (a newer node sharing the
        store wrote them), well-formed ones that are unsigned or signed by a key this node does
        not trust (a shared store may hold another site's checkpoints: root decides, with
        `checkpoints rm`), those whose age cannot be told, and anything that cannot be read."""
        ids = self._ids()
        now = time.time()
        removed = []
        for checkpoint_id in ids:
            try:
                self._load(checkpoint_id)
                continue
            except _UnreadableManifest as e:
                if not e.known_format:
                    continue
                why = str(e)
            except Exception:  # missing, untrusted, unreadable file: not garbage we can judge
                continue
            try:
                age_s = now - self._tree.manifest_mtime(checkpoint_id)
            except Exception:
                continue
            if age_s < older_than_s:
                continue
            try:
                self.delete(checkpoint_id)
            except NotFoundError:
                continue  # another node got there first
            log.info(
                "removed checkpoint %s from %s: its manifest has been unreadable for " "%d s (%s)",
                checkpoint_id,
                self.url,
                age_s,
                why,
            )
            removed.append(checkpoint_id)
        return removed

    def follow(
        self, checkpoint_id: str, compression: CompressionRequest, data_key: DataKey | None = None
    ) -> TailHasher | None:
        """Start hashing the images of `checkpoint_id` while CRIU writes them into `staging_dir`:
        writing them back to disk (uncompressed), or compressing them into the files the store
        keeps (zstd, lz4, auto; sealed with `data_key`), where the store is local; else None.
        Pass `finish()`'s result to `publish` as `hashed`, and its `compression` (when not None)
        as the compression, with the same `data_key`.

        This shortens the whole dump (publish hashes or compresses the last MiBs, its fsync waits
        for the tail) but slows CRIU's own writes a little: for dumps whose total time counts."""
        validate_checkpoint_id(checkpoint_id)
        if isinstance(self._tree, RemoteTree):
            return self._stream(checkpoint_id, compression, data_key)
        if self._tree.local_dir(checkpoint_id) is None:
            return None
        staged = self._tree.staged_path(checkpoint_id)
        # sync_file_range on tmpfs is a no-op: no need to tell disks from memory here.
        if compression == "none" and data_key is None:
            return TailHasher(staged, writeback=True)
        cipher = data_key.cipher if data_key is not None else None
        if compression == "none":
            # Sealed in place (tailhash.InPlaceOutput): no second copy to write, none to remove.
            return TailHasher(staged, writeback=True, cipher=cipher, seal_in_place=True)
        try:
            pack_into = self._tree.packing_dir(checkpoint_id)
        except OSError as e:
            # Following is a shortcut: publish does all of it and reports a real disk problem.
            log.debug("not compressing %s while CRIU writes: %s", checkpoint_id, e)
            return None
        return TailHasher(
            staged,
            writeback=True,
            compression=compression,
            open_out=local_opener(pack_into, writeback=True),
            cipher=cipher,
            seal_in_place=True,
        )

    def _stream(
        self, checkpoint_id: str, compression: CompressionRequest, data_key: DataKey | None
    ) -> TailHasher | None:
        """`follow` for a remote store: every image (compressed or not, sealed or not) is
        uploaded while CRIU writes it; publish sends the tails and the manifest."""
        assert isinstance(self._tree, RemoteTree)
        try:
            opener = self._tree.stream_opener(checkpoint_id)
        except Exception as e:
            # A shortcut only: publish uploads everything itself and reports what is wrong.
            log.debug("not uploading %s while CRIU writes: %s", checkpoint_id, e)
            return None
        # Uploads begin now: gc must see them alive until publish or discard ends them.
        self._beat(checkpoint_id)
        return TailHasher(
            self._tree.staged_path(checkpoint_id),
            compression=compression,
            open_out=opener,
            copy_plain=True,
            cipher=data_key.cipher if data_key is not None else None,
        )

    def _choose(self, checkpoint_id: str, source: Path | None) -> Compression:
        staged = source or self._tree.staged_path(checkpoint_id)
        try:
            return choose_compression(staged, staged_names(staged))
        except OSError as e:
            raise self._write_error(checkpoint_id, e) from e

    def _discard_quietly(self, checkpoint_id: str, source: Path | None) -> None:
        self._end_beat(checkpoint_id)
        try:
            self._tree.discard(checkpoint_id)
        except Exception as e:  # what is left is a stale staging entry: gc removes it
            log.debug("cannot discard the staging of %s: %s", checkpoint_id, e)
        if source is not None:
            shutil.rmtree(source, ignore_errors=True)

    def _forget_entry(self, label: str, uid: int, entry: str) -> None:
        try:
            self._tree.index_remove(label, uid, entry)
        except Exception as e:  # the server is gone, say: gc removes the entry later
            log.debug("cannot remove index entry %s of %s: %s", entry, label, e)

    def delete(self, checkpoint_id: str) -> None:
        """Remove a checkpoint: manifest.json first, so a half-deleted one is never listed;
        its index entry last."""
        validate_checkpoint_id(checkpoint_id)
        try:
            known: Manifest | None = self._load(checkpoint_id)
        except Exception:
            known = None  # unreadable or gone: gc finds its entry, if any
        try:
            self._tree.remove(checkpoint_id)
        except FileNotFoundError:
            raise NotFoundError(f"no checkpoint {checkpoint_id} in store {self.url}") from None
        except StasisError:
            raise
        except Exception as e:
            raise StoreError(
                f"cannot delete checkpoint {checkpoint_id} from {self.url}: {self._why(e)}"
            ) from e
        if known is not None:
            self._forget_entry(known.label, known.uid, _entry_of(known))

    def delete_unless_pinned(self, checkpoint_id: str) -> bool:
        """`delete` for a cleanup nobody asked for by id (retention, retiring a label, pruning):
        False, and nothing deleted, while some node's restore pins the checkpoint (`pin`)."""
        validate_checkpoint_id(checkpoint_id)
        if self._pinned([checkpoint_id]):
            log.info("checkpoint %s is kept for now: a restore pinned it", checkpoint_id)
            return False
        self.delete(checkpoint_id)
        return True

    def mark_restored(self, checkpoint_id: str, host: str) -> None:
        """Say in the store that `checkpoint_id` was restored on `host`: the node that dumped it
        then lifts the network lock it holds for it (stasis/daemon/netlocks.py). Unsigned on
        purpose: whoever forges one can only make that node lift a lock early."""
        validate_checkpoint_id(checkpoint_id)
        data = json.dumps({"host": host, "at": time.time()}).encode()
        try:
            self._tree.put_note(checkpoint_id, RESTORED_NOTE, data)
        except FileNotFoundError:
            raise NotFoundError(f"no checkpoint {checkpoint_id} in store {self.url}") from None
        except Exception as e:
            raise self._write_error(checkpoint_id, e) from e

    def record_verdict(self, manifest: Manifest, verdict: Mapping[str, object]) -> None:
        """Write `verdict` (stasis.wire.VerifyVerdict) beside `manifest`'s images, replacing
        the one before: signed with this node's signing key (the site key where there is one)
        over the verdict and the manifest's own MAC, so that it neither stands for another
        checkpoint nor can be written by whoever can merely write the store."""
        document = {"verdict": dict(verdict), "manifest": _manifest_mac(manifest)}
        signature = self.keys.sign(VERDICT_PURPOSE, document)
        data = json.dumps({**document, "signature": signature.model_dump()}).encode()
        try:
            self._tree.put_note(manifest.id, VERDICT_NOTE, data)
        except FileNotFoundError:
            raise NotFoundError(f"no checkpoint {manifest.id} in store {self.url}") from None
        except Exception as e:
            raise self._write_error(manifest.id, e) from e

    def verdict(self, manifest: Manifest) -> dict[str, object] | None:
        """The newest verdict recorded on `manifest` (`record_verdict`), or None: none, or one
        that is not signed by a key this node trusts, or not for this very manifest (a forged
        or copied one is logged once and never shown)."""
        try:
            data = self._tree.read_stored_range(manifest.id, VERDICT_NOTE, 0, _VERDICT_MAX)
        except FileNotFoundError:
            return None
        except Exception as e:
            log.warning("cannot read the verdict of checkpoint %s: %s", manifest.id, _reason(e))
            return None
        try:
            raw = json.loads(data)
            signature = Signature.model_validate(raw["signature"])
            document = {"verdict": raw["verdict"], "manifest": raw["manifest"]}
            good = (
                isinstance(raw["verdict"], dict)
                and raw["verdict"].get("checkpoint") == manifest.id
                and raw["manifest"] == _manifest_mac(manifest)
                and self.keys.verify(VERDICT_PURPOSE, document, signature) is Verdict.VALID
            )
        except (ValueError, TypeError, KeyError, ValidationError):
            good = False
        if not good:
            self._warn_verdict_once(manifest.id)
            return None
        return dict(raw["verdict"])

    def _warn_verdict_once(self, checkpoint_id: str) -> None:
        key = f"verdict:{checkpoint_id}"
        if key not in self._warned:
            self._warned.add(key)
            log.warning(
                "ignoring the verdict of checkpoint %s in %s: it is not signed by a key "
                "this node trusts for this checkpoint",
                checkpoint_id,
                self.url,
            )

    def was_restored(self, checkpoint_id: str) -> bool:
        """Whether some node said it restored `checkpoint_id` (see `mark_restored`)."""
        validate_checkpoint_id(checkpoint_id)
        try:
            return self._tree.has_note(checkpoint_id, RESTORED_NOTE)
        except Exception as e:
            raise self._read_error(checkpoint_id, e) from e

    def exists(self, checkpoint_id: str) -> bool:
        """Whether the store holds `checkpoint_id` (published, or half-deleted)."""
        validate_checkpoint_id(checkpoint_id)
        try:
            return self._tree.exists(checkpoint_id)
        except StasisError:
            raise
        except Exception as e:
            raise self._read_error(checkpoint_id, e) from e

    @contextmanager
    def pin(self, checkpoint_id: str, why: str) -> Iterator[None]:
        """Keep `checkpoint_id` from retention (keep-N, the age limit, `expire`) for as long as
        the block runs, on every node sharing the store: take it before reading anything a
        restore needs. A pin is a note beside the images (`pin-*.json`: host, pid, why),
        refreshed every PIN_REFRESH_S; a node that dies holding one lets it lapse PIN_TTL_S
        later. NotFoundError when the checkpoint is gone (nothing to restore), StoreError when
        the pin cannot be written. An explicit `delete` (root or the owner asked) still goes."""
        validate_checkpoint_id(checkpoint_id)
        name = f"{PIN_PREFIX}{secrets.token_hex(8)}.json"
        data = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "why": why[:200]}
        ).encode()

        def put() -> None:
            self._tree.put_note(checkpoint_id, name, data)

        try:
            put()
        except FileNotFoundError:
            raise NotFoundError(f"no checkpoint {checkpoint_id} in store {self.url}") from None
        except Exception as e:
            raise self._write_error(checkpoint_id, e) from e
        refresh = _Repeating(
            PIN_REFRESH_S, put, f"the pin of {checkpoint_id} ({why})", at_once=False
        )
        try:
            yield
        finally:
            refresh.stop()
            try:
                self._tree.remove_note(checkpoint_id, name)
            except Exception as e:  # it lapses PIN_TTL_S from its last refresh
                log.warning(
                    "cannot remove the pin of checkpoint %s from %s: %s",
                    checkpoint_id,
                    self.url,
                    self._why(e),
                )

    def pinned(self, checkpoint_id: str) -> bool:
        """Whether some node holds a live pin on `checkpoint_id` (`pin`). True also when that
        cannot be told (the store answers with an error): keeping one is the safe mistake."""
        return checkpoint_id in self._pinned([checkpoint_id])

    def _pinned(self, checkpoint_ids: builtins.list[str]) -> set[str]:
        pinned: set[str] = set()
        now: float | None = None
        for checkpoint_id in checkpoint_ids:
            try:
                times = self._tree.note_times(checkpoint_id, PIN_PREFIX)
                if times and now is None:
                    now = self._tree.clock()
            except FileNotFoundError:
                continue  # gone already
            except Exception as e:
                log.warning(
                    "cannot tell whether checkpoint %s is pinned (%s): kept",
                    checkpoint_id,
                    self._why(e),
                )
                pinned.add(checkpoint_id)
                continue
            if now is not None and any(now - t < PIN_TTL_S for t in times.values()):
                pinned.add(checkpoint_id)
        return pinned

    def apply_retention(self, label: str, *, uid: int | None = None) -> list[str]:
        """Delete the checkpoints of `label` beyond the newest `keep` of owner `uid` (None: of
        each owner, counted apart); return the deleted ids."""
        validate_label(label)
        if uid is not None:
            return self._retain(label, uid, protect=None)
        owners = sorted({m.uid for m in self.list(label)})
        return [deleted for owner in owners for deleted in self._retain(label, owner, None)]

    def _retain(self, label: str, uid: int, protect: str | None) -> list[str]:
        if self.keep == 0 and self.max_age_s == 0:
            return []
        series = self.list(label, uid=uid)
        doomed = [m.id for m in series[self.keep :]] if self.keep else []
        if self.max_age_s:
            # The newest always stays: it is what the next restore of the label resumes from.
            cutoff = time.time() - self.max_age_s
            doomed += [
                m.id for m in series[1:] if m.created.timestamp() < cutoff and m.id not in doomed
            ]
        doomed = [d for d in doomed if d != protect]
        # Checked right before deleting: a restore pins before it reads a byte.
        pinned = self._pinned(doomed)
        for checkpoint_id in sorted(pinned):
            log.info(
                "checkpoint %s of label %s is kept beyond retention for now: a restore "
                "pinned it",
                checkpoint_id,
                label,
            )
        doomed = [d for d in doomed if d not in pinned]
        deleted = []
        for checkpoint_id in doomed:
            try:
                self.delete(checkpoint_id)
            except NotFoundError:
                continue  # another node's retention got there first
            deleted.append(checkpoint_id)
        return deleted

    def expire(self) -> builtins.list[str]:
        """Apply retention (keep-N and the age limit) to every label of every owner; return the
        deleted ids. Publishing applies it to its own label; this catches labels nobody dumps
        any more."""
        if self._index_ready():
            try:
                labels = self._tree.index_labels()
            except StasisError:
                raise
            except Exception as e:
                raise StoreError(f"cannot list the labels of {self.url}: {self._why(e)}") from e
        else:
            labels = sorted({m.label for m in self.list()})
        return [deleted for label in labels for deleted in self.apply_retention(label)]

    def gc(self, idle_s: float = STALE_STAGING_S) -> GcReport:
        """Remove what dead dumps and dead nodes left behind, all of it idle for `idle_s`:
        staging directories, checkpoint directories without a manifest (a publish cut off),
        unfinished multipart uploads (S3), index entries leading nowhere; and add the index
        entries that are missing. Never touches a complete checkpoint."""
        report = GcReport(staging=self.remove_stale_staging(idle_s))
        tree = self._tree
        try:
            # Every age below by the store's clock, not this node's (which may be off by days).
            now = tree.clock()
            ids = set(tree.ids())
            # Publishes under way (their heartbeat, or their writes, are recent): not garbage,
            # however old their multipart uploads are.
            alive = _staged_ids(tree.staging_area())
            for checkpoint_id in sorted(ids):
                try:
                    tree.read_manifest(checkpoint_id)
                    continue
                except FileNotFoundError:
                    pass
                newest = tree.newest_write(checkpoint_id)
                if newest is not None and now - newest < idle_s:
                    alive.add(checkpoint_id)
                    continue  # a publish under way, maybe on another node
                try:
                    tree.remove(checkpoint_id)
                except FileNotFoundError:
                    pass
                ids.discard(checkpoint_id)
                report.partial.append(checkpoint_id)
            if isinstance(tree, S3Tree):
                for key, upload_id in tree.abandoned_uploads(
                    idle_s, datetime.fromtimestamp(now, UTC)
                ):
                    if tree.checkpoint_of(key) in alive:
                        continue  # its publish is alive, only slow: it ends the upload
                    tree.abort_upload(key, upload_id)
                    report.uploads.append(key)
            for label in tree.index_labels():
                for entry in tree.index_list(label, None):
                    if (
                        entry.checkpoint_id in ids
                        or entry.checkpoint_id in alive
                        or now - entry.created.timestamp() < idle_s
                    ):
                        continue
                    tree.index_remove(label, entry.uid, entry.name)
                    report.entries_removed += 1
        except StasisError:
            raise
        except Exception as e:
            raise StoreError(f"cannot collect garbage in {self.url}: {self._why(e)}") from e
        report.entries_added = self._add_missing_entries()
        return report

    # -- reading ----------------------------------------------------------------------------

    def _ids(self) -> list[str]:
        try:
            return self._tree.ids()
        except StasisError:
            raise
        except Exception as e:
            raise StoreError(f"cannot list checkpoints in {self.url}: {self._why(e)}") from e

    def list(self, label: str | None = None, *, uid: int | None = None) -> list[Manifest]:
        """Complete checkpoints, newest first; skips unreadable ones. `label` and `uid` (the
        owner) narrow the list: a label is only meaningful with its owner, (uid, label) names
        one series of checkpoints, and a caller must never be handed another user's."""
        if label is not None:
            validate_label(label)
        indexed = label is not None and self._index_ready()
        ids = [e.checkpoint_id for e in self._entries(label, uid)] if indexed else self._ids()

        def one(checkpoint_id: str) -> Manifest | None:
            try:
                return self._load(checkpoint_id)
            except FileNotFoundError:
                return None  # being published, or half-deleted
            except StasisError:
                raise
            except _UntrustedManifest as e:
                self._warn_once(checkpoint_id, self._untrusted_why(e))
                return None
            except Exception as e:  # garbage, or a file we may not read: one bad apple only
                self._warn_once(checkpoint_id, str(e))
                return None

        # A remote store answers each read after a round trip: several at once.
        workers = 1 if isinstance(self._tree, LocalTree) else 16
        manifests = [
            m
            for m in in_parallel(one, ids, min(workers, len(ids)))
            if m is not None
            and (label is None or m.label == label)
            and (uid is None or m.uid == uid)
        ]
        return _newest_first(manifests)

    def get(self, checkpoint_id: str) -> Manifest:
        """The manifest of `checkpoint_id`; NotFoundError if it is unknown or incomplete."""
        validate_checkpoint_id(checkpoint_id)
        try:
            return self._load(checkpoint_id)
        except FileNotFoundError:
            raise NotFoundError(f"no checkpoint {checkpoint_id} in store {self.url}") from None
        except _UnreadableManifest as e:
            # Not the owner's to delete: nobody can tell who the owner is.
            raise UnreadableManifestError(
                f"checkpoint {checkpoint_id} is corrupt: manifest.json is unreadable ({e}); "
                f"nobody can tell whose it is: root can delete it with "
                f"`stasis checkpoints rm {checkpoint_id}`"
            ) from None
        except _UntrustedManifest as e:
            raise self._untrusted(checkpoint_id, e) from None
        except StasisError:
            raise
        except Exception as e:
            raise StoreError(
                f"cannot read checkpoint {checkpoint_id} from {self.url}: {_reason(e)}"
            ) from e

    def untrusted_signers(self, label: str, *, uid: int) -> builtins.list[str]:
        """The ids of the keys, none of which this node trusts, that signed the checkpoints
        claiming to be `uid`'s of `label`: why a restore by label found nothing (`list` skips
        those). Their claims are unverified: a hint for that one line, never acted on."""
        validate_label(label)
        indexed = self._index_ready()
        ids = [e.checkpoint_id for e in self._entries(label, uid)] if indexed else self._ids()

        def one(checkpoint_id: str) -> str | None:
            try:
                self._load(checkpoint_id)
            except _UntrustedManifest as e:
                claims = e.claims
                if (
                    e.verdict is Verdict.UNKNOWN_KEY
                    and claims is not None
                    and claims.label == label
                    and claims.uid == uid
                ):
                    return e.key_id
            except Exception:  # garbage or unreadable: not a signer to name
                return None
            return None

        workers = 1 if isinstance(self._tree, LocalTree) else 16
        return sorted(
            {k for k in in_parallel(one, ids, min(workers, max(1, len(ids)))) if k is not None}
        )

    def latest(self, label: str, *, uid: int) -> Manifest:
        """The newest checkpoint of `label` owned by `uid`; NotFoundError if it has none.

        With the index (index.py): one listing and, normally, one manifest read, whatever the
        size of the store."""
        validate_label(label)
        if self._index_ready():
            for entry in self._entries(label, uid, limit=_FIRST_PAGE):
                found = self._indexed(entry, label)
                if found is not None:
                    return found
            # Only entries of publishes under way or dead on the first page: read them all.
        manifests = self.list(label, uid=uid)
        if not manifests:
            raise NotFoundError(
                f"no checkpoint with label {label} owned by uid {uid} in store {self.url}"
            )
        return manifests[0]

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
        manifest = self.get(checkpoint_id)
        self.require_cryptographic_sums(manifest)
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
                f"{_reason(e)}"
            ) from e
        try:
            self._verify(manifest, target)
            yield manifest, target
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def images_in_place(self, checkpoint_id: str) -> tuple[Manifest, Path] | None:
        """The manifest and the checkpoint's own directory, NOT yet verified, when CRIU may read
        the images where they are: a local uncompressed checkpoint that nobody but root can
        change (`_private.only_root_writes`: root-owned and not writable by others, up to /,
        on a local filesystem). Else None: use a path that hands CRIU only bytes it checked
        (stasis/daemon/streamed.py, lazystore.py, or `open_images`).

        Lets a restore verify (`verify`) while CRIU already reads, gating the resume of the
        restored tree on the result: nobody can change a byte between the two reads.
        """
        manifest = self.get(checkpoint_id)
        self.require_cryptographic_sums(manifest)
        in_place = self._tree.local_dir(checkpoint_id)
        if (
            in_place is None
            or not _plain(manifest)
            or not only_root_writes(in_place, [f.stored_name for f in manifest.files])
        ):
            return None
        return manifest, in_place

    def require_cryptographic_sums(self, manifest: Manifest) -> None:
        """UntrustedCheckpointError (one line) for a checkpoint whose images nothing but xxh3
        checks (formats 1 and 2, not encrypted): a store writer can rewrite its images keeping
        every xxh3 sum, and a restore runs as root. Re-dumping makes a format 3 checkpoint."""
        if manifest.has_cryptographic_sums:
            return
        raise UntrustedCheckpointError(
            f"checkpoint {manifest.id} is not restored: it predates cryptographic image hashes "
            f"(format {manifest.format}, stored in the clear, checked by xxh3 only, which "
            "whoever can write the store can forge); restore it with the stasis that made it "
            "and dump the job again with this one, or delete it with "
            f"`stasis checkpoints rm {manifest.id}`"
        )

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

    # -- the label index --------------------------------------------------------------------

    def _index_ready(self) -> bool:
        try:
            return self._tree.index_ready()
        except StasisError:
            raise  # said whole already (a store gone from under its mount point)
        except Exception as e:
            raise StoreError(f"cannot read the index of {self.url}: {self._why(e)}") from e

    def _entries(
        self, label: str | None, uid: int | None, limit: int | None = None
    ) -> builtins.list[Entry]:
        assert label is not None
        try:
            return self._tree.index_list(label, uid, limit)
        except StasisError:
            raise
        except Exception as e:
            raise StoreError(f"cannot list checkpoints in {self.url}: {self._why(e)}") from e

    def _indexed(self, entry: Entry, label: str) -> Manifest | None:
        """The manifest an index entry leads to, when it is complete, trusted and matches."""
        try:
            manifest = self._load(entry.checkpoint_id)
        except FileNotFoundError:
            return None  # being published, or its publish died (gc removes the entry)
        except StasisError:
            raise
        except _UntrustedManifest as e:
            self._warn_once(entry.checkpoint_id, self._untrusted_why(e))
            return None
        except Exception as e:
            self._warn_once(entry.checkpoint_id, str(e))
            return None
        # The entry is a hint; the signed manifest decides, also of its place in the order.
        if (
            manifest.label != label
            or manifest.uid != entry.uid
            or entry.name != _entry_of(manifest)
        ):
            return None
        return manifest

    def ensure_index(self) -> int:
        """Make the label index complete: add an entry for every checkpoint that lacks one (a
        store written before stasis kept an index), then mark it complete. Reads every manifest
        once, the first time only; returns how many entries were added (0 when complete)."""
        if self._index_ready():
            return 0
        added = self._add_missing_entries()
        try:
            self._tree.mark_index_ready()
        except Exception as e:
            raise self._write_error("index", e) from e
        return added

    def _add_missing_entries(self) -> int:
        added = 0
        by_series: dict[tuple[str, int], set[str]] = {}
        for manifest in self.list():
            key = (manifest.label, manifest.uid)
            if key not in by_series:
                by_series[key] = {e.name for e in self._entries(*key)}
            name = _entry_of(manifest)
            if name not in by_series[key]:
                try:
                    self._tree.index_put(manifest.label, manifest.uid, name)
                except Exception as e:
                    raise self._write_error(manifest.id, e) from e
                added += 1
        return added

    # -- helpers ----------------------------------------------------------------------------

    def _why(self, e: BaseException) -> str:
        if isinstance(self._tree, S3Tree):
            said = describe(e, self.url)
            if said is not None:
                return said
        return _reason(e)

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
        self.require_cryptographic_sums(manifest)
        entry = next((f for f in manifest.files if f.name == name), None)
        if entry is None:
            raise UsageError(f"checkpoint {manifest.id} has no image file {name!r}")
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
        decoder = ChunkDecoder(
            name,
            entry.size_bytes,
            entry.chunks,
            ChunkSpec(manifest.compression, self._cipher(manifest), entry.chunks.size_bytes),
        )
        first, last = decoder.span(offset, length)
        offsets = entry.chunks.offsets
        start, end = offsets[first], offsets[last + 1]
        try:
            stored = self._tree.read_stored_range(manifest.id, entry.stored_name, start, end)
        except FileNotFoundError:
            raise self._corrupt(manifest.id, name, "is missing") from None
        except Exception as e:
            raise self._read_error(manifest.id, e) from e
        if len(stored) != end - start:
            raise self._corrupt(
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
            raise self._corrupt(manifest.id, name, str(e)) from None
        # Views, not copies: a lazy restore sends these straight to lazy-pages (sendmsg), and
        # each copy of a GiB costs ~0.2 s of fresh memory on these machines.
        views, skip, left = [], offset - first * entry.chunks.size_bytes, length
        for piece in pieces:
            view = memoryview(piece)[skip : skip + left]
            views.append(view)
            left -= len(view)
            skip = 0
        return views

    def rekey(self) -> RekeyResult:
        """Wrap the data key of every encrypted checkpoint (this node trusts) that an old key
        file wraps with the current one instead: only manifest.json is rewritten (re-signed,
        atomically), never an image. Checkpoints whose key is not configured are counted and
        left as they are."""
        current = self.encryption.current()
        keys = {k.key_id: k for k in self.encryption.all()}
        result = RekeyResult()
        for manifest in self.list():
            enc = manifest.encryption
            if enc is None:
                continue
            if enc.key_id == current.key_id:
                result.current += 1
                continue
            old = keys.get(enc.key_id)
            if old is None:
                result.unknown_key += 1
                log.warning(
                    "cannot rekey checkpoint %s: its key %s is not among the key files",
                    manifest.id,
                    enc.key_id,
                )
                continue
            try:
                wrapped = rewrap(old, current, manifest.id, enc)
            except Exception:
                result.unknown_key += 1
                log.warning(
                    "cannot rekey checkpoint %s: its wrapped data key does not open " "with key %s",
                    manifest.id,
                    enc.key_id,
                )
                continue
            updated = self._seal(
                manifest.model_copy(update={"encryption": wrapped, "signature": None})
            )
            try:
                self._tree.write_manifest(manifest.id, manifest_bytes(updated))
            except FileNotFoundError:
                continue  # deleted meanwhile
            except Exception as e:
                raise self._write_error(manifest.id, e) from e
            result.rekeyed.append(manifest.id)
        return result

    # -- helpers ----------------------------------------------------------------------------

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

    def _seal(self, manifest: Manifest) -> Manifest:
        signature = self.keys.sign(MANIFEST_PURPOSE, _signed_part(manifest))
        return manifest.model_copy(update={"signature": signature})

    def _load(self, checkpoint_id: str) -> Manifest:
        """The manifest of `checkpoint_id`, once it parsed and its signature verified."""
        data = self._tree.read_manifest(checkpoint_id)
        try:
            document = json.loads(data)
        except ValueError as e:  # not JSON, not UTF-8
            raise _UnreadableManifest(_reason(e)) from e
        if not isinstance(document, dict):
            raise _UnreadableManifest("not a JSON object")
        if document.get("format", 1) not in FORMATS:
            raise _UnreadableManifest(
                f"format {document.get('format')!r}, which this stasis does not know "
                "(written by a newer one?)",
                known_format=False,
            )
        try:
            manifest = Manifest.model_validate(document)
        except (ValidationError, ValueError) as e:
            raise _UnreadableManifest(_first_problem(e)) from e
        if manifest.id != checkpoint_id:
            raise _UnreadableManifest(f"it names checkpoint {manifest.id}")
        if manifest.signature is None:
            raise _UntrustedManifest(None, None, manifest)
        # Exactly what was read, not the model's view of it: a field this version ignores is
        # signed too, and a change to it is a change.
        del document["signature"]
        verdict = self.keys.verify(MANIFEST_PURPOSE, document, manifest.signature)
        if verdict is not Verdict.VALID:
            raise _UntrustedManifest(verdict, manifest.signature.key_id, manifest)
        return manifest

    def _warn_once(self, checkpoint_id: str, why: str) -> None:
        if checkpoint_id not in self._warned:
            self._warned.add(checkpoint_id)
            log.warning("skipping checkpoint %s in %s: %s", checkpoint_id, self.url, why)

    @staticmethod
    def _untrusted_why(e: _UntrustedManifest) -> str:
        if e.verdict is None:
            return "its manifest is not signed"
        if e.verdict is Verdict.UNKNOWN_KEY:
            return f"its manifest is signed by key {e.key_id}, which this node does not trust"
        return "its manifest does not match its signature (changed after it was signed)"

    def _untrusted(self, checkpoint_id: str, e: _UntrustedManifest) -> UntrustedCheckpointError:
        rm = f"root can delete it with `stasis checkpoints rm {checkpoint_id}`"
        if e.verdict is Verdict.UNKNOWN_KEY:
            return UntrustedCheckpointError(
                f"checkpoint {checkpoint_id} is not trusted: its manifest is signed by key "
                f"{e.key_id}, which this node does not trust; if another node of your site made "
                f"it, add that node's key to trusted_keys (or give both one site_key) and restart "
                f"the daemon, else {rm}"
            )
        if e.verdict is None:
            what = (
                "is not signed: it was written by a stasis that did not sign manifests, or "
                "by someone else who can write the store"
            )
        else:
            what = (
                "does not match its signature: it was changed after it was signed "
                "(tampering or damage)"
            )
        return UntrustedCheckpointError(
            f"checkpoint {checkpoint_id} is not trusted and is not restored: its manifest {what}; "
            f"{rm}"
        )

    def _verify(
        self,
        manifest: Manifest,
        target: Path | None,
        only: Callable[[FileEntry], bool] | None = None,
    ) -> None:
        """Check every file against the manifest, decoding it into `target` when one is given."""
        self.require_cryptographic_sums(manifest)
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

    def stream_file(self, manifest: Manifest, name: str, dst: Writer) -> None:
        """Decode image file `name` of `manifest` into `dst`, in order, every chunk checked
        (tag or checksum) before it is written, the file's size after (a whole-file checksum
        only where its chunks have none of their own): CorruptCheckpointError, never wrong
        bytes written. For a restore that reads its images
        as they are decoded (CRIU's image streamer, stasis/daemon/streamed.py)."""
        self.require_cryptographic_sums(manifest)
        entry = next((f for f in manifest.files if f.name == name), None)
        if entry is None:
            raise UsageError(f"checkpoint {manifest.id} has no image file {name!r}")
        cipher = self._cipher(manifest)
        self._check_stored_size(manifest, entry)

        def decode() -> Streamed:
            with self._tree.open_stored(manifest.id, entry.stored_name) as src:
                if entry.chunks is None:
                    return unpack(src, dst, manifest.compression, entry.size_bytes)
                return unpack_chunked(
                    src,
                    dst,
                    ChunkDecoder(
                        entry.name,
                        entry.size_bytes,
                        entry.chunks,
                        ChunkSpec(manifest.compression, cipher, entry.chunks.size_bytes),
                    ),
                    whole_sum=False,
                )

        self._checked(manifest, entry, None, decode)

    def _check_stored_size(self, manifest: Manifest, entry: FileEntry) -> None:
        try:
            stored = self._tree.stored_size(manifest.id, entry.stored_name)
        except FileNotFoundError:
            raise self._corrupt(manifest.id, entry.name, "is missing") from None
        except Exception as e:
            raise self._read_error(manifest.id, e) from e
        if stored != entry.stored_size_bytes:
            raise self._corrupt(
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
            raise self._corrupt(checkpoint_id, entry.name, str(e)) from None
        except DecompressionError as e:
            raise self._corrupt(checkpoint_id, entry.name, f"cannot be decompressed ({e})") from e
        except FileNotFoundError:
            raise self._corrupt(checkpoint_id, entry.name, "is missing") from None
        except OSError as e:
            if target is not None and e.errno in _NO_SPACE:
                raise StoreError(
                    f"no space left on {target.parent} while unpacking checkpoint "
                    f"{checkpoint_id}: "
                    "free space or restore with another scratch directory"
                ) from e
            raise self._read_error(checkpoint_id, e) from e
        except (StasisError, ReaderGone):
            raise
        except Exception as e:
            raise self._read_error(checkpoint_id, e) from e
        if got.size_bytes != entry.size_bytes:
            # Decoding stops soon after the expected size, so "more" has no exact count.
            found = (
                "more than"
                if got.size_bytes > entry.size_bytes
                else f"{got.size_bytes} bytes instead of"
            )
            raise self._corrupt(
                checkpoint_id, entry.name, f"holds {found} {entry.size_bytes} bytes"
            )
        # "": its chunks vouched for it (BLAKE3 or AES-GCM each); formats 1 and 2 only, else.
        if got.xxh3_128 and got.xxh3_128 != entry.xxh3_128:
            raise self._corrupt(checkpoint_id, entry.name, "fails its checksum")

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
        decoder = ChunkDecoder(
            entry.name,
            entry.size_bytes,
            chunks,
            ChunkSpec(manifest.compression, cipher, chunks.size_bytes),
        )
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

    def _corrupt(self, checkpoint_id: str, file: str, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"checkpoint {checkpoint_id} is corrupt: {file} {what}; "
            f"delete it with `stasis checkpoints rm {checkpoint_id}`"
        )

    def _read_error(self, checkpoint_id: str, e: Exception) -> StoreError:
        return StoreError(
            f"cannot read checkpoint {checkpoint_id} from {self.url}: " f"{self._why(e)}"
        )

    def _write_error(self, checkpoint_id: str, e: Exception) -> StoreError:
        if _errno_in_chain(e) in _NO_SPACE:
            return StoreError(
                f"no space left on {self.url} while writing checkpoint {checkpoint_id}: "
                "free space or point STASIS_STORE elsewhere"
            )
        return StoreError(
            f"cannot write checkpoint {checkpoint_id} to {self.url}: " f"{self._why(e)}"
        )


class _Repeating:
    """Calls `fn` every `interval_s` on a thread of its own until `stop`; its failures are
    logged (once each kind), never raised: a missed refresh is retried at the next."""

    def __init__(
        self, interval_s: float, fn: Callable[[], None], what: str, at_once: bool = True
    ) -> None:
        self._at_once = at_once
        self._stopped = threading.Event()
        self._fn = fn
        self._what = what
        self._interval_s = interval_s
        fn_thread = threading.Thread(target=self._run, name=f"refresh {what}", daemon=True)
        self._thread = fn_thread
        fn_thread.start()

    def _run(self) -> None:
        said: set[str] = set()
        first = self._at_once
        while first or not self._stopped.wait(self._interval_s):
            first = False
            try:
                self._fn()
            except Exception as e:
                if type(e).__name__ not in said:
                    said.add(type(e).__name__)
                    log.warning("cannot refresh %s: %s", self._what, _reason(e))

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def _clock_of(area: Path) -> float:
    """The time by the clock that stamps the files of local directory `area` (a network
    filesystem's server's, when a local store is shared); this node's when it cannot tell."""
    try:
        fd, name = tempfile.mkstemp(prefix=".clock-", dir=area)
    except OSError:
        return time.time()
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        os.unlink(name)


def _staged_ids(area: Path) -> set[str]:
    """The checkpoints with a staging entry in `area`: dumps and publishes under way (gc has
    just removed the idle ones)."""
    try:
        names = os.listdir(area)
    except OSError:
        return set()
    return {
        n.removesuffix(".publish") for n in names if is_checkpoint_id(n.removesuffix(".publish"))
    }


def _newest_first(manifests: list[Manifest]) -> list[Manifest]:
    """`manifests` newest first: each (owner, label) series by `order_key` (lineage, then its
    sequence, not clocks), the series among themselves by the dumping nodes' clocks (all a
    listing of several series has: their numbers do not compare). Each series keeps the places
    the clocks give its members and fills them in its own order."""
    by_clock = sorted(manifests, key=lambda m: (m.created, m.id), reverse=True)
    series: dict[tuple[str, int], list[Manifest]] = {}
    for m in by_clock:
        series.setdefault((m.label, m.uid), []).append(m)
    ordered = {
        key: iter(sorted(members, key=order_key, reverse=True)) for key, members in series.items()
    }
    return [next(ordered[(m.label, m.uid)]) for m in by_clock]


def _entry_of(info: CheckpointInfo) -> str:
    """The index entry of `info`: where its sequence number and clock place it (index.py)."""
    return entry_name(info.created, info.id, info.seq)


def _signed_part(manifest: Manifest) -> dict[str, object]:
    """The manifest as the JSON values written to manifest.json, less the signature: what a
    reader gets back from the file and verifies."""
    signed: dict[str, object] = json.loads(manifest.model_dump_json(exclude={"signature"}))
    return signed


def _manifest_mac(manifest: Manifest) -> str:
    return manifest.signature.hmac_sha256 if manifest.signature is not None else ""


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
        raise UsageError(f"cannot use checkpoint store {url}: {_reason(e)}") from e
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


# Where fetched or decoded images go for a full restore when memory allows: they are read
# back at once and deleted, and a disk would have to take them first (1 GiB from S3: 1.4 s to
# /dev/shm, 4.1 s to the state directory's scratch on disk); decrypted ones, the plain pages,
# then never touch a disk either.
MEMORY_SCRATCH = Path("/dev/shm")


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
    decoder = ChunkDecoder(
        entry.name,
        entry.size_bytes,
        entry.chunks,
        ChunkSpec(compression, cipher, entry.chunks.size_bytes),
    )
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


def _errno_in_chain(e: BaseException) -> int | None:
    """The errno of `e` or of the OSError it wraps: codecs and fsspec re-raise write errors."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    return None


def _reason(e: BaseException) -> str:
    """One line about `e`: the OS's words and the file, without the errno noise."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _first_problem(e: ValueError) -> str:
    if isinstance(e, ValidationError):
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}" if where else str(first["msg"])
    return _reason(e)


@dataclass
class RekeyResult:
    """What `Store.rekey` did: checkpoints re-wrapped, already on the current key, and left
    because their key is not configured here."""

    rekeyed: list[str] = field(default_factory=list)
    current: int = 0
    unknown_key: int = 0


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
