"""The publisher of a store: turning what CRIU dumped into a listed checkpoint.

Staging (a fresh root-only local directory per dump), the follower that hashes, chunks,
compresses and seals the images while CRIU still writes them (where the tree can take them:
`Tree.follow`), and publishing: sizes, BLAKE3 hashes per chunk and per file, the label index
entry, the images stored, manifest.json signed and written last, then retention of the label.
A publish refreshes a heartbeat from its first upload to its manifest, so that no node's gc
takes it for dead. A failed publish leaves nothing listed.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path

from stasis.errors import (
    NotFoundError,
    StasisError,
    StoreError,
    UnreadableManifestError,
    UntrustedCheckpointError,
    UsageError,
)
from stasis.store._place import Place
from stasis.store._repeating import Repeating
from stasis.store._tree import Following, Publication, staged_names
from stasis.store.catalog import Catalog, entry_of
from stasis.store.compression import choose_compression
from stasis.store.crypt import DataKey, KeyFiles, new_data_key
from stasis.store.manifest import (
    COMPRESSIONS,
    MAX_SEQ,
    CheckpointInfo,
    Compression,
    CompressionRequest,
    Manifest,
    validate_checkpoint_id,
    validate_label,
)
from stasis.store.tailhash import Partial, TailHasher
from stasis.store.trust import Trust

log = logging.getLogger(__name__)

# A publish refreshes its heartbeat (`Tree.heartbeat`) this often, from the dump's first upload
# to its manifest: gc leaves alone what a publish refreshed within its `idle_s`, which must be
# well above this.
HEARTBEAT_S = 60.0


class Publisher:
    """`encryption`: the key files that encrypt new checkpoints (`new_data_key`)."""

    def __init__(self, place: Place, trust: Trust, catalog: Catalog, encryption: KeyFiles) -> None:
        self._place = place
        self._tree = place.tree
        self._trust = trust
        self._catalog = catalog
        self.encryption = encryption
        # Heartbeats of the publishes under way in this process, by checkpoint id.
        self._beats: dict[str, Repeating] = {}
        self._beats_lock = threading.Lock()

    def staging_dir(self, checkpoint_id: str) -> Path:
        """A fresh, empty, root-only local directory for CRIU to dump the images of `checkpoint_id`.

        Pass the id to `publish` (via CheckpointInfo) or `discard` afterwards. Never listed.
        """
        validate_checkpoint_id(checkpoint_id)
        try:
            return self._tree.staging_dir(checkpoint_id)
        except OSError as e:
            raise self._place.write_error(checkpoint_id, e) from e

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

    def follow(
        self, checkpoint_id: str, compression: CompressionRequest, data_key: DataKey | None = None
    ) -> TailHasher | None:
        """Start hashing the images of `checkpoint_id` while CRIU writes them into `staging_dir`:
        writing them back to disk (uncompressed) or compressing them into the files the store
        keeps (zstd, lz4, auto; sealed with `data_key`) where the store is local, uploading
        them where it is remote; None where the tree cannot. Pass `finish()`'s result to
        `publish` as `hashed`, and its `compression` (when not None) as the compression, with
        the same `data_key`.

        This shortens the whole dump (publish hashes or compresses the last MiBs, its fsync waits
        for the tail) but slows CRIU's own writes a little: for dumps whose total time counts."""
        validate_checkpoint_id(checkpoint_id)
        # Uploads that begin now (a remote store's) must look alive to gc until publish or
        # discard ends them.
        return self._tree.follow(
            checkpoint_id, Following(compression, data_key, lambda: self._beat(checkpoint_id))
        )

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
                raise StoreError(
                    f"cannot write checkpoint {info.id} to {self._place.url}: {e}"
                ) from e
            # Before the manifest: a published checkpoint always has its entry (index.py).
            entry = entry_of(info)
            self._catalog.put_entry(info)
            manifest = self._tree.publish(
                Publication(info, compression, self._trust.seal, source, hashed, data_key)
            )
        except BaseException as e:
            self._end_beat(info.id, beat)
            if entry is not None:
                self._catalog.forget_entry(info.label, info.uid, entry)
            # The index entry can fail before the tree's publish starts (the server went
            # away while CRIU wrote): the staged images and their streams are consumed anyway.
            self._discard_quietly(info.id, source)
            if isinstance(e, StasisError) or not isinstance(e, Exception):
                raise
            # OSError, or the own types of fsspec backends
            raise self._place.write_error(info.id, e) from e
        self._end_beat(info.id, beat)
        try:
            self._catalog.retain(info.label, info.uid, protect=info.id)
        except StasisError as e:
            # The checkpoint is safe; a failed cleanup must not make the dump look failed.
            log.warning(
                "retention for label %s failed after publishing %s: %s", info.label, info.id, e
            )
        return manifest

    def _beat(self, checkpoint_id: str) -> Repeating:
        """The heartbeat of the publish of `checkpoint_id`, started now unless `follow` did."""
        with self._beats_lock:
            beat = self._beats.get(checkpoint_id)
            if beat is None:
                beat = self._beats[checkpoint_id] = Repeating(
                    HEARTBEAT_S,
                    lambda: self._tree.heartbeat(checkpoint_id),
                    f"the publish of {checkpoint_id}",
                )
            return beat

    def _end_beat(self, checkpoint_id: str, beat: Repeating | None = None) -> None:
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
            highest = self._catalog.latest(info.label, uid=info.uid).seq or 0
        except NotFoundError:
            pass
        if info.parent is not None:
            try:
                parent = self._catalog.get(info.parent)
            except (NotFoundError, UnreadableManifestError, UntrustedCheckpointError):
                parent = None  # deleted or not ours to trust: nothing to be above
            if parent is not None and parent.label == info.label and parent.uid == info.uid:
                highest = max(highest, parent.seq or 0)
        return min(highest + 1, MAX_SEQ)

    def _choose(self, checkpoint_id: str, source: Path | None) -> Compression:
        staged = source or self._tree.staged_path(checkpoint_id)
        try:
            return choose_compression(staged, staged_names(staged))
        except OSError as e:
            raise self._place.write_error(checkpoint_id, e) from e

    def _discard_quietly(self, checkpoint_id: str, source: Path | None) -> None:
        self._end_beat(checkpoint_id)
        try:
            self._tree.discard(checkpoint_id)
        except Exception as e:  # what is left is a stale staging entry: gc removes it
            log.debug("cannot discard the staging of %s: %s", checkpoint_id, e)
        if source is not None:
            shutil.rmtree(source, ignore_errors=True)
