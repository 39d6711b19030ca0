"""`stasis verify`: a checkpoint restored in a sandbox (stasis/engine/sandbox.py), its whole tree
checked and removed, and the verdict recorded beside it in the store, signed with the node's
signing key (the site key where there is one: stasis/store/trust.py, `record_verdict`).

Who may verify a checkpoint: whoever may restore it (its owner, root). Its images are checked
against the signed manifest as for a restore: read where they lie when nobody but root can
change them there (`Store.images_in_place`, hashed whole before CRIU reads them), else fetched,
checked and decoded into a private scratch directory (`Store.open_images`); a damaged image
fails the verdict with the reason. Verifications run one at a time on a node, at nice 19 and idle I/O priority.

With `verify_new_checkpoints`, every checkpoint this node publishes is verified in the
background (one worker thread, a short queue). `restore --verified` takes the newest checkpoint
of a label whose recorded verdict is ok and signed by a key this node trusts (`verified_only`).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import UTC, datetime
from typing import Any, cast

from stasis import wire
from stasis.daemon.activity import Activity
from stasis.daemon.core import Core
from stasis.daemon.users import Caller, account
from stasis.engine import find_criu, nodelocal, privatetmp, sandbox
from stasis.errors import NotFoundError, StasisError, UsageError
from stasis.store import Manifest, Store, validate_checkpoint_id

log = logging.getLogger("stasis.daemon")

# New checkpoints waiting for a background verification, at most (more are not verified: a
# node publishing faster than it verifies must not pile up work).
_QUEUE_MAX = 16
_REASON_MAX = 1000
# Verifications asked for through the API that may run or wait at once on a node.
_ASKED_MAX = 3


class Verifier:
    def __init__(self, core: Core, criu_version: Callable[[], str]) -> None:
        self.core = core
        self._criu_version = criu_version
        self._one_at_a_time = threading.Lock()
        self._asked = threading.BoundedSemaphore(_ASKED_MAX)
        self._queue: queue.Queue[str] = queue.Queue(_QUEUE_MAX)
        self._worker: threading.Thread | None = None
        # Told of every verdict (asked for or in the background), after it is recorded.
        self.listeners: list[Callable[[wire.VerifyVerdict], object]] = []
        if core.settings.verify_new_checkpoints:
            core.activity.add(self._published)

    def verify(self, checkpoint_id: str, caller: Caller) -> wire.VerifyVerdict:
        """Verify a checkpoint the caller may restore; the verdict, also when it failed."""
        manifest = self.core.store.catalog.get(validate_checkpoint_id(checkpoint_id))
        caller.require_checkpoint(manifest.uid, manifest.user, f"checkpoint {manifest.id}")
        runtime = _container_runtime(manifest)
        if runtime:
            raise UsageError(
                f"checkpoint {manifest.id} is a container's (runtime {runtime}): stasis verify "
                "restores process trees that stasis runs itself; restore the container on a "
                "test node to know it comes back"
            )
        if manifest.job_net is not None:
            raise UsageError(
                f"checkpoint {manifest.id} is a part of a job that spans nodes (job network "
                f"{manifest.job_net.vni}): its tree needs the job's other parts, so stasis "
                "verify does not restore it alone; it is verified by its restore"
            )
        # One runs at a time; a few more may wait. More would each hold one of the daemon's
        # worker threads while waiting, which every user's requests share.
        if not self._asked.acquire(blocking=False):
            raise UsageError(
                f"verify of checkpoint {manifest.id} refused: {_ASKED_MAX} verifications are "
                "running or waiting on this node already (one runs at a time); try again later"
            )
        try:
            return self.verify_manifest(manifest)
        finally:
            self._asked.release()

    def verify_manifest(self, manifest: Manifest) -> wire.VerifyVerdict:
        with self._one_at_a_time:
            started = time.monotonic()
            try:
                ok, reason, processes = self._sandboxed(manifest)
            except StasisError as e:
                ok, reason, processes = False, str(e), 0
            verdict = wire.VerifyVerdict(
                checkpoint=manifest.id,
                ok=ok,
                reason=" ".join(reason.split())[:_REASON_MAX],
                node=self.core.hostname,
                at=datetime.now(UTC).isoformat(timespec="seconds"),
                duration_s=round(time.monotonic() - started, 3),
                processes=processes,
            )
        try:
            self.core.store.trust.record_verdict(manifest, cast("dict[str, object]", verdict))
        except StasisError as e:
            log.warning(
                "checkpoint %s verified (%s), but its verdict is not recorded: %s",
                manifest.id,
                "ok" if ok else "failed",
                e,
            )
        log.info("verified checkpoint %s: %s", manifest.id, "ok" if ok else f"failed: {reason}")
        for listener in list(self.listeners):
            try:
                listener(verdict)
            except Exception as e:  # a listener's trouble is its own
                log.warning("reporting the verdict on %s failed: %s", manifest.id, e)
        return verdict

    def _sandboxed(self, manifest: Manifest) -> tuple[bool, str, int]:
        store, settings = self.core.store, self.core.settings
        store.reader.require_cryptographic_sums(manifest)
        acct = account(manifest.uid)  # a user this node has not got: the verdict says so
        expect = (
            cast("wire.RestoreFacts", manifest.restore_facts.model_dump())
            if manifest.restore_facts is not None
            else None
        )
        with ExitStack() as stack:
            try:
                stack.enter_context(
                    store.catalog.pin(manifest.id, f"verified on {self.core.hostname}")
                )
            except NotFoundError:
                raise
            except StasisError as e:  # a store this node may read but not write
                log.warning("verifying checkpoint %s without a pin: %s", manifest.id, e)
            # Checked whole first; where nobody but root can change them, read by CRIU where
            # they are rather than copied (a restore's own fast path).
            checked, images = stack.enter_context(
                store.reader.checked_images(manifest.id, settings.layout.scratch)
            )
            found = sandbox.verify_images(
                find_criu(settings.criu),
                images,
                settings.layout.criu_logs,
                f"verify-{manifest.id}-{secrets.token_hex(3)}.log",
                uid=acct.uid,
                gid=acct.gid,
                groups=list(acct.groups),
                image_log=checked.log_path,
                expect=expect,
                checkpoint=checked.id,
                criu_version=self._criu_version(),
                timeout_s=settings.verify_timeout_s,
                own_mounts=privatetmp.recorded(checked.extra),
                external_files=privatetmp.external_files(checked.extra),
                travelling=nodelocal.travelling(checked.extra),
            )
        return found.ok, found.reason, found.processes

    # -- in the background -------------------------------------------------------------------

    def _published(self, activity: Activity) -> None:
        if activity.kind != "checkpoint":
            return
        try:
            self._queue.put_nowait(activity.checkpoint)
        except queue.Full:
            log.warning(
                "checkpoint %s is not verified in the background: %d are waiting",
                activity.checkpoint,
                _QUEUE_MAX,
            )
            return
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="stasis-verify", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            try:
                checkpoint_id = self._queue.get(timeout=5.0)
            except queue.Empty:
                return
            try:
                manifest = self.core.store.catalog.get(checkpoint_id)
                # A container's is not for a sandbox, nor a part of a job that spans nodes.
                if not _container_runtime(manifest) and manifest.job_net is None:
                    self.verify_manifest(manifest)
            except StasisError as e:  # gone since, or the store does not answer
                log.warning("background verification of checkpoint %s: %s", checkpoint_id, e)

    # -- what the store says ----------------------------------------------------------------

    def verdicts(self, manifests: list[Manifest]) -> list[dict[str, Any]]:
        """`manifests` as the checkpoint list answers them, each with its verdict (`verdict`,
        absent when none is recorded that this node trusts)."""

        def one(m: Manifest) -> dict[str, Any]:
            row: dict[str, Any] = m.model_dump(mode="json")
            found = self.core.store.trust.verdict(m)
            if found is not None:
                row["verdict"] = found
            return row

        if len(manifests) < 2:
            return [one(m) for m in manifests]
        with ThreadPoolExecutor(min(8, len(manifests))) as pool:
            return list(pool.map(one, manifests))


def _container_runtime(manifest: Manifest) -> str:
    """The container runtime a checkpoint's images are for ("" for a stasis job's tree)."""
    runtime = manifest.extra.get("runtime")
    return runtime if isinstance(runtime, str) else ""


def verified_only(store: Store, candidates: list[Manifest], label: str) -> list[Manifest]:
    """The candidates whose newest verdict is ok (signed by a key this node trusts, for that
    very manifest); NotFoundError (one line) if none is."""
    ok = [
        m for m in candidates if (v := store.trust.verdict(m)) is not None and v.get("ok") is True
    ]
    if not ok:
        raise NotFoundError(
            f"no verified checkpoint with label {label}: none of its {len(candidates)} "
            f"checkpoint(s) has an ok verdict; run `stasis verify CHECKPOINT` on one (see "
            f"`stasis checkpoints --label {label}`), or restore without --verified"
        )
    return ok
