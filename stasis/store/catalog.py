"""The catalog of a store: which checkpoints it holds and which of them count.

Listing (only complete, trusted checkpoints: trust.py), the label index that finds a series'
newest without reading every manifest (index.py), deletion, pins that keep a checkpoint from
retention while a restore reads it, retention per (owner, label), garbage collection of what
dead dumps and nodes left, the notes beside a checkpoint (restored somewhere), and rekeying.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from stasis.errors import (
    NotFoundError,
    StasisError,
    StoreError,
    UnreadableManifestError,
)
from stasis.store._place import Place, reason
from stasis.store._repeating import Repeating
from stasis.store._tree import in_parallel, manifest_bytes, remove_idle
from stasis.store.crypt import KeyFiles, rewrap
from stasis.store.index import Entry, entry_name
from stasis.store.manifest import (
    CheckpointInfo,
    Manifest,
    is_checkpoint_id,
    order_key,
    validate_checkpoint_id,
    validate_label,
)
from stasis.store.signing import Verdict
from stasis.store.trust import Trust, UnreadableManifest, UntrustedManifest

log = logging.getLogger(__name__)

T = TypeVar("T")

# A dump writes its images continuously; one whose staging directory sat idle this long is dead.
STALE_STAGING_S = 3600.0
# Beside a checkpoint's images: some node restored it (`Catalog.mark_restored`).
RESTORED_NOTE = "restored.json"
# Index entries `latest` reads in one go: S3's page.
_FIRST_PAGE = 1000
# Pins (`Catalog.pin`): notes beside a checkpoint's images, named so, refreshed by the pinning
# process this often; one not refreshed for PIN_TTL_S (its node died) lapses. Ages are
# measured by the store's clock (`Tree.clock`), so a node whose clock is off neither keeps a
# dead pin forever nor takes a live one for dead.
PIN_PREFIX = "pin-"
PIN_REFRESH_S = 60.0
PIN_TTL_S = 600.0


@dataclass
class GcReport:
    """What `Catalog.gc` removed (and the index entries it added)."""

    staging: list[str] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)  # checkpoints without a manifest
    uploads: list[str] = field(default_factory=list)  # keys of aborted multipart uploads
    entries_removed: int = 0
    entries_added: int = 0


@dataclass
class RekeyResult:
    """What `Catalog.rekey` did: checkpoints re-wrapped, already on the current key, and left
    because their key is not configured here."""

    rekeyed: list[str] = field(default_factory=list)
    current: int = 0
    unknown_key: int = 0


class Catalog:
    """`keep` is how many checkpoints are kept per (owner, label), 0 for all; `max_age_s` the
    age past which all but the newest of a series go, 0 for none."""

    def __init__(self, place: Place, trust: Trust, keep: int, max_age_s: float) -> None:
        self._place = place
        self._tree = place.tree
        self._trust = trust
        self.keep = keep
        self.max_age_s = max_age_s

    # -- reading ----------------------------------------------------------------------------

    def get(self, checkpoint_id: str) -> Manifest:
        """The manifest of `checkpoint_id`; NotFoundError if it is unknown or incomplete."""
        validate_checkpoint_id(checkpoint_id)
        try:
            return self._trust.load(checkpoint_id)
        except FileNotFoundError:
            raise self._place.not_found(checkpoint_id) from None
        except UnreadableManifest as e:
            # Not the owner's to delete: nobody can tell who the owner is.
            raise UnreadableManifestError(
                f"checkpoint {checkpoint_id} is corrupt: manifest.json is unreadable ({e}); "
                f"nobody can tell whose it is: root can delete it with "
                f"`stasis checkpoints rm {checkpoint_id}`"
            ) from None
        except UntrustedManifest as e:
            raise self._trust.untrusted(checkpoint_id, e) from None
        except StasisError:
            raise
        except Exception as e:
            raise StoreError(
                f"cannot read checkpoint {checkpoint_id} from {self._place.url}: {reason(e)}"
            ) from e

    def list(self, label: str | None = None, *, uid: int | None = None) -> builtins.list[Manifest]:
        """Complete checkpoints, newest first; skips unreadable ones. `label` and `uid` (the
        owner) narrow the list: a label is only meaningful with its owner, (uid, label) names
        one series of checkpoints, and a caller must never be handed another user's."""
        if label is not None:
            validate_label(label)
        ids = self._candidates(label, uid)

        def one(checkpoint_id: str) -> Manifest | None:
            try:
                return self._trust.load(checkpoint_id)
            except FileNotFoundError:
                return None  # being published, or half-deleted
            except StasisError:
                raise
            except Exception as e:  # untrusted, garbage, a file we may not read: one bad apple
                self._trust.skip(checkpoint_id, e)
                return None

        manifests = [
            m
            for m in self._read_all(one, ids)
            if m is not None
            and (label is None or m.label == label)
            and (uid is None or m.uid == uid)
        ]
        return newest_first(manifests)

    def untrusted_signers(self, label: str, *, uid: int) -> builtins.list[str]:
        """The ids of the keys, none of which this node trusts, that signed the checkpoints
        claiming to be `uid`'s of `label`: why a restore by label found nothing (`list` skips
        those). Their claims are unverified: a hint for that one line, never acted on."""
        validate_label(label)

        def one(checkpoint_id: str) -> str | None:
            try:
                self._trust.load(checkpoint_id)
            except UntrustedManifest as e:
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

        return sorted({k for k in self._read_all(one, self._candidates(label, uid)) if k})

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
                f"no checkpoint with label {label} owned by uid {uid} in store {self._place.url}"
            )
        return manifests[0]

    def exists(self, checkpoint_id: str) -> bool:
        """Whether the store holds `checkpoint_id` (published, or half-deleted)."""
        validate_checkpoint_id(checkpoint_id)
        try:
            return self._tree.exists(checkpoint_id)
        except StasisError:
            raise
        except Exception as e:
            raise self._place.read_error(checkpoint_id, e) from e

    def _ids(self) -> builtins.list[str]:
        try:
            return self._tree.ids()
        except StasisError:
            raise
        except Exception as e:
            raise self._place.failed("list checkpoints in", e) from e

    def _candidates(self, label: str | None, uid: int | None) -> builtins.list[str]:
        """The checkpoints that may be `label`'s: its index entries, or every one there is."""
        if label is not None and self._index_ready():
            return [e.checkpoint_id for e in self._entries(label, uid)]
        return self._ids()

    def _read_all(self, one: Callable[[str], T], ids: builtins.list[str]) -> builtins.list[T]:
        # A remote store answers each read after a round trip: several at once.
        return in_parallel(one, ids, min(self._tree.read_workers, max(1, len(ids))))

    # -- deleting and notes -----------------------------------------------------------------

    def delete(self, checkpoint_id: str) -> None:
        """Remove a checkpoint: manifest.json first, so a half-deleted one is never listed;
        its index entry last."""
        validate_checkpoint_id(checkpoint_id)
        try:
            known: Manifest | None = self._trust.load(checkpoint_id)
        except Exception:
            known = None  # unreadable or gone: gc finds its entry, if any
        try:
            self._tree.remove(checkpoint_id)
        except FileNotFoundError:
            raise self._place.not_found(checkpoint_id) from None
        except StasisError:
            raise
        except Exception as e:
            raise StoreError(
                f"cannot delete checkpoint {checkpoint_id} from {self._place.url}: "
                f"{self._place.why(e)}"
            ) from e
        if known is not None:
            self.forget_entry(known.label, known.uid, entry_of(known))

    def delete_unless_pinned(self, checkpoint_id: str) -> bool:
        """`delete` for a cleanup nobody asked for by id (retention, retiring a label, pruning):
        False, and nothing deleted, while some node's restore pins the checkpoint (`pin`)."""
        validate_checkpoint_id(checkpoint_id)
        if self._pinned([checkpoint_id]):
            log.info("checkpoint %s is kept for now: a restore pinned it", checkpoint_id)
            return False
        self.delete(checkpoint_id)
        return True

    def retire(self, checkpoint_ids: Iterable[str]) -> builtins.list[str]:
        """Delete the checkpoints of a label whose work is done, each unless a restore pinned it
        (another node resuming it now keeps it); those deleted. One gone meanwhile is skipped."""
        retired: builtins.list[str] = []
        for checkpoint_id in checkpoint_ids:
            try:
                if self.delete_unless_pinned(checkpoint_id):
                    retired.append(checkpoint_id)
            except NotFoundError:
                continue
        return retired

    def _put_note(self, checkpoint_id: str, name: str, data: bytes) -> None:
        try:
            self._tree.put_note(checkpoint_id, name, data)
        except FileNotFoundError:
            raise self._place.not_found(checkpoint_id) from None
        except Exception as e:
            raise self._place.write_error(checkpoint_id, e) from e

    def mark_restored(self, checkpoint_id: str, host: str) -> None:
        """Say in the store that `checkpoint_id` was restored on `host`: the node that dumped it
        then lifts the network lock it holds for it (stasis/daemon/netlocks.py). Unsigned on
        purpose: whoever forges one can only make that node lift a lock early."""
        validate_checkpoint_id(checkpoint_id)
        self._put_note(
            checkpoint_id, RESTORED_NOTE, json.dumps({"host": host, "at": time.time()}).encode()
        )

    def was_restored(self, checkpoint_id: str) -> bool:
        """Whether some node said it restored `checkpoint_id` (see `mark_restored`)."""
        validate_checkpoint_id(checkpoint_id)
        try:
            return self._tree.has_note(checkpoint_id, RESTORED_NOTE)
        except Exception as e:
            raise self._place.read_error(checkpoint_id, e) from e

    # -- pins -------------------------------------------------------------------------------

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
        self._put_note(checkpoint_id, name, data)
        refresh = Repeating(
            PIN_REFRESH_S,
            lambda: self._tree.put_note(checkpoint_id, name, data),
            f"the pin of {checkpoint_id} ({why})",
            at_once=False,
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
                    self._place.url,
                    self._place.why(e),
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
                    self._place.why(e),
                )
                pinned.add(checkpoint_id)
                continue
            if now is not None and any(now - t < PIN_TTL_S for t in times.values()):
                pinned.add(checkpoint_id)
        return pinned

    # -- retention --------------------------------------------------------------------------

    def apply_retention(self, label: str, *, uid: int | None = None) -> builtins.list[str]:
        """Delete the checkpoints of `label` beyond the newest `keep` of owner `uid` (None: of
        each owner, counted apart); return the deleted ids."""
        validate_label(label)
        if uid is not None:
            return self.retain(label, uid, protect=None)
        owners = sorted({m.uid for m in self.list(label)})
        return [deleted for owner in owners for deleted in self.retain(label, owner, None)]

    def retain(self, label: str, uid: int, protect: str | None) -> builtins.list[str]:
        """Retention for the series (label, uid), never deleting `protect` (just published)."""
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
        deleted = []
        for checkpoint_id in (d for d in doomed if d not in pinned):
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
                raise self._place.failed("list the labels of", e) from e
        else:
            labels = sorted({m.label for m in self.list()})
        return [deleted for label in labels for deleted in self.apply_retention(label)]

    # -- garbage ----------------------------------------------------------------------------

    def remove_stale_staging(self, idle_s: float = STALE_STAGING_S) -> builtins.list[str]:
        """Remove what dumps that never finished (a daemon killed mid-dump, a node crash) left
        in the staging area: entries nothing was written to for `idle_s`. Those are never listed
        (no manifest) but hold disk space. The age rule, not "everything", because a local store
        may be shared with other nodes whose dumps are running. Returns the names removed."""
        try:
            area = self._tree.staging_area()
            return remove_idle(area, idle_s, _clock_of(area))
        except OSError as e:
            raise StoreError(
                f"cannot clean the staging area of {self._tree.where}: {reason(e)}"
            ) from e

    def remove_unreadable(self, older_than_s: float) -> builtins.list[str]:
        """Delete the checkpoints whose manifest.json is garbage and was written more than
        `older_than_s` ago; return their ids. Nobody can restore them or tell whose they are,
        and retention, which counts per (owner, label), never sees them.

        Left alone: manifests of a format this stasis does not know (a newer node sharing the
        store wrote them), well-formed ones that are unsigned or signed by a key this node does
        not trust (a shared store may hold another site's checkpoints: root decides, with
        `checkpoints rm`), those whose age cannot be told, and anything that cannot be read."""
        now = time.time()
        removed = []
        for checkpoint_id in self._ids():
            try:
                self._trust.load(checkpoint_id)
                continue
            except UnreadableManifest as e:
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
                "removed checkpoint %s from %s: its manifest has been unreadable for %d s (%s)",
                checkpoint_id,
                self._place.url,
                age_s,
                why,
            )
            removed.append(checkpoint_id)
        return removed

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
            report.uploads = tree.abort_abandoned_uploads(
                idle_s, datetime.fromtimestamp(now, UTC), alive
            )
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
            raise self._place.failed("collect garbage in", e) from e
        report.entries_added = self._add_missing_entries()
        return report

    # -- the label index --------------------------------------------------------------------

    def put_entry(self, info: CheckpointInfo) -> None:
        """Index `info` (before its manifest: a published checkpoint always has its entry)."""
        self._tree.index_put(info.label, info.uid, entry_of(info))

    def forget_entry(self, label: str, uid: int, entry: str) -> None:
        try:
            self._tree.index_remove(label, uid, entry)
        except Exception as e:  # the server is gone, say: gc removes the entry later
            log.debug("cannot remove index entry %s of %s: %s", entry, label, e)

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
            raise self._place.write_error("index", e) from e
        return added

    def _index_ready(self) -> bool:
        try:
            return self._tree.index_ready()
        except StasisError:
            raise  # said whole already (a store gone from under its mount point)
        except Exception as e:
            raise self._place.failed("read the index of", e) from e

    def _entries(
        self, label: str, uid: int | None, limit: int | None = None
    ) -> builtins.list[Entry]:
        try:
            return self._tree.index_list(label, uid, limit)
        except StasisError:
            raise
        except Exception as e:
            raise self._place.failed("list checkpoints in", e) from e

    def _indexed(self, entry: Entry, label: str) -> Manifest | None:
        """The manifest an index entry leads to, when it is complete, trusted and matches."""
        try:
            manifest = self._trust.load(entry.checkpoint_id)
        except FileNotFoundError:
            return None  # being published, or its publish died (gc removes the entry)
        except StasisError:
            raise
        except Exception as e:
            self._trust.skip(entry.checkpoint_id, e)
            return None
        # The entry is a hint; the signed manifest decides, also of its place in the order.
        if manifest.label != label or manifest.uid != entry.uid or entry.name != entry_of(manifest):
            return None
        return manifest

    def _add_missing_entries(self) -> int:
        added = 0
        by_series: dict[tuple[str, int], set[str]] = {}
        for manifest in self.list():
            key = (manifest.label, manifest.uid)
            if key not in by_series:
                by_series[key] = {e.name for e in self._entries(*key)}
            if entry_of(manifest) not in by_series[key]:
                try:
                    self.put_entry(manifest)
                except Exception as e:
                    raise self._place.write_error(manifest.id, e) from e
                added += 1
        return added

    # -- rekeying ---------------------------------------------------------------------------

    def rekey(self, encryption: KeyFiles) -> RekeyResult:
        """Wrap the data key of every encrypted checkpoint (this node trusts) that an old key
        file wraps with the current one instead: only manifest.json is rewritten (re-signed,
        atomically), never an image. Checkpoints whose key is not configured are counted and
        left as they are."""
        current = encryption.current()
        keys = {k.key_id: k for k in encryption.all()}
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
                    "cannot rekey checkpoint %s: its wrapped data key does not open with key %s",
                    manifest.id,
                    enc.key_id,
                )
                continue
            updated = self._trust.seal(
                manifest.model_copy(update={"encryption": wrapped, "signature": None})
            )
            try:
                self._tree.write_manifest(manifest.id, manifest_bytes(updated))
            except FileNotFoundError:
                continue  # deleted meanwhile
            except Exception as e:
                raise self._place.write_error(manifest.id, e) from e
            result.rekeyed.append(manifest.id)
        return result


def newest_first(manifests: builtins.list[Manifest]) -> builtins.list[Manifest]:
    """`manifests` newest first: each (owner, label) series by `order_key` (lineage, then its
    sequence, not clocks), the series among themselves by the dumping nodes' clocks (all a
    listing of several series has: their numbers do not compare). Each series keeps the places
    the clocks give its members and fills them in its own order."""
    by_clock = sorted(manifests, key=lambda m: (m.created, m.id), reverse=True)
    series: dict[tuple[str, int], builtins.list[Manifest]] = {}
    for m in by_clock:
        series.setdefault((m.label, m.uid), []).append(m)
    ordered = {
        key: iter(sorted(members, key=order_key, reverse=True)) for key, members in series.items()
    }
    return [next(ordered[(m.label, m.uid)]) for m in by_clock]


def entry_of(info: CheckpointInfo) -> str:
    """The index entry of `info`: where its sequence number and clock place it (index.py)."""
    return entry_name(info.created, info.id, info.seq)


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
