"""The daemon's side of containers: checkpoint one (on its stop, every interval, by hand),
prepare its restore from its label's newest good checkpoint, remember the opted-in ones.

Only root may call these (the runtime wrapper runs as root in containerd's shim). A container's
checkpoints are stored under its namespace (owner `k8s:<namespace>`, an owner uid of its own:
runc.namespace_uid, above every kernel uid, so no local user is ever their owner), so a label
never reaches across namespaces; a restore also checks the namespace recorded in the manifest.
Within a namespace, any container that opts in with the label may resume it: the namespace is
the unit of trust, as it is for the namespace's Secrets. Registrations are rows of the daemon's
database (table `k8s_containers`): intervals and `stasis dump --container` survive a restart of
the daemon, and a rebuild of a corrupt database (each row kept as a file too: daemon/records.py).

A restore resumes the processes with the credentials CRIU recorded, so it is refused unless the
new container runs with the identity the checkpoint's did: the same uid, gids, capabilities and
user-namespace mappings in its OCI spec as the checkpoint's own copy of the spec (spec.dump, in
its verified images). A pod spec that adds runAsUser: 0 or capabilities does not resume a label
that an unprivileged container dumped, nor the reverse.

Intervals have a floor, the node admin's (`k8s_min_interval_s`): a pod's owner who asks for
checkpoints every second (STASIS_INTERVAL, stasis.dev/interval) gets one every floor seconds,
and a line in the container's log saying so; one who asks by annotation (stasis.dev/checkpoint,
reason "annotation") is refused until the floor has passed since the container's last
checkpoint. A container that asks for no interval gets the node's `interval` setting (none by
default; stasis.k8s.intervals.container_interval). Checkpoints and restores are told to the
manager's listeners (the control plane hears of them), with the seconds of work they hold.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Column,
    Integer,
    MetaData,
    RowMapping,
    String,
    Table,
    Text,
    delete,
    insert,
    select,
    update,
)

from stasis import faults, wire
from stasis.daemon import records
from stasis.daemon.activity import Activity, work_of
from stasis.daemon.jobs import JobManager
from stasis.daemon.users import Caller
from stasis.engine import proctree
from stasis.errors import (
    ContainerError,
    CorruptCheckpointError,
    NotFoundError,
    PermissionDeniedError,
    StasisError,
    StoreError,
    UntrustedCheckpointError,
    UsageError,
)
from stasis.k8s import freezes, oci, restorefails, rootfs
from stasis.k8s.intervals import AUTO, AutoIntervals, container_interval
from stasis.k8s.models import (
    CheckpointAnswer,
    CheckpointRequest,
    ContainerInfo,
    ExportAnswer,
    ExportRequest,
    Forgotten,
    ImportRequest,
    IntervalRequest,
    RegisterRequest,
    RestoreDone,
    RestoreDoneRequest,
    RestorePlan,
    RestoreRequest,
)
from stasis.k8s.runc import (
    STOP_MARKER,
    Bundle,
    Runc,
    legacy_namespace_uid,
    mark_stop_asked,
    namespace_uid,
    read_bundle,
    real_runc,
    validate_abs_path,
    validate_container_id,
)
from stasis.store import (
    CheckpointInfo,
    Manifest,
    is_checkpoint_id,
    new_checkpoint_id,
    order_key,
    validate_label,
)

log = logging.getLogger("stasis.daemon")

_metadata = MetaData()
k8s_containers_table = Table(
    "k8s_containers",
    _metadata,
    Column("container_id", String(1024), primary_key=True),
    Column("runc_root", Text, nullable=False),
    Column("bundle", Text, nullable=False),
    Column("label", String(128), nullable=False),
    Column("namespace", String(253), nullable=False),
    Column("pod", Text, nullable=True),
    Column("interval_s", Integer, nullable=False),
    Column("restored_from", String(32), nullable=True),
    Column("last_checkpoint", String(32), nullable=True),
    Column("last_checkpoint_at", Integer, nullable=True),
    Column("registered", String(32), nullable=False),
    info={records.KEY: records.ALL},
)

# A restore plan whose wrapper never said how it went is dropped after this long.
_PLAN_TTL_S = 600.0

# The floor on a container's checkpoint interval (seconds; 0 = none): a dump freezes the
# container and writes its memory, which the node's other pods pay for too.
DEFAULT_MIN_INTERVAL_S = 60  # Settings.k8s_min_interval_s (STASIS_K8S_MIN_INTERVAL_S)
# A checkpoint's copy of its container's OCI spec is read whole; a real one is a few KiB.
_SPEC_MAX_BYTES = 4 << 20


@dataclass
class _Plan:
    """A restore under way: its images stay open (fetched, verified) until the wrapper's
    `runc restore` is done with them."""

    stack: contextlib.ExitStack
    since: float
    checkpoint: str
    work: Path
    label: str
    namespace: str
    pod: str | None


# (namespace, pod, reason, message): a Warning event on the pod (set by the integration when
# the node has a Kubernetes API).
PodEvent = Callable[[str, str, str, str], None]
RESTORE_FAILED_REASON = "StasisRestoreFailed"


def _parent(row: dict[str, Any] | None) -> str | None:
    """The checkpoint a registered container was restored from, as its next checkpoint's
    parent (None: started fresh, or not a checkpoint id the runtime could have been given)."""
    restored = row.get("restored_from") if row else None
    return restored if isinstance(restored, str) and is_checkpoint_id(restored) else None


def _root_only(caller: Caller) -> None:
    if not caller.is_root:
        raise PermissionDeniedError(
            "permission denied: only root (the container runtime) acts " "on containers"
        )


class Containers:
    def __init__(self, manager: JobManager, min_interval: int = DEFAULT_MIN_INTERVAL_S) -> None:
        self.manager = manager
        self.db = manager.db
        self.min_interval_s = min_interval
        self.records = records.Records(manager.db, manager.settings.layout.records)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._plans: dict[str, _Plan] = {}
        # A restore that fails on a good checkpoint is counted here, per checkpoint, so that
        # the create fails (and is retried) a bounded number of times before it is given up.
        self.failures = restorefails.RestoreFailures(
            manager.settings.state_dir / restorefails.DIRECTORY
        )
        self.pod_event: PodEvent | None = None
        # Every `runc pause` is written down first (freezes.py); what a killed daemon left
        # frozen is settled at the start (`settle_freezes`), and retried while runc fails.
        self.freezes = freezes.FreezeJournal(manager.settings.state_dir / freezes.DIRECTORY)
        self._unsettled: list[freezes.Freeze] = []
        # `auto` intervals: each checkpoint's frozen time is its container's cost.
        self.auto = AutoIntervals(manager.settings)
        manager.activity.add(self.auto.heard)

    # -- the registry ---------------------------------------------------------------------

    def register(self, req: RegisterRequest, caller: Caller) -> ContainerInfo:
        _root_only(caller)
        cid = validate_container_id(req.container_id)
        root = validate_abs_path(req.runc_root, "runc root")
        bundle = read_bundle(validate_abs_path(req.bundle, "bundle"), cid)
        if bundle.label is None:
            raise UsageError(f"container {cid} has no STASIS_CHECKPOINT: nothing to protect")
        validate_label(bundle.label)
        restored = self._restored(cid, bundle, req.restored_from)
        interval = container_interval(bundle, self.manager.settings.interval)
        row = {
            "container_id": cid,
            "runc_root": str(root),
            "bundle": str(bundle.path),
            "label": bundle.label,
            "namespace": bundle.namespace,
            "pod": bundle.pod,
            "interval_s": interval if interval == AUTO else self._floored(interval, root, cid),
            "restored_from": restored.id if restored else req.restored_from,
            "last_checkpoint": None,
            "last_checkpoint_at": int(time.time()),
            "registered": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        with self.db.transaction() as conn:
            conn.execute(
                delete(k8s_containers_table).where(k8s_containers_table.c.container_id == cid)
            )
            conn.execute(insert(k8s_containers_table).values(**row))
        self.records.refresh(k8s_containers_table, cid)
        self.auto.forget(cid)  # a new run: its cost is measured again
        return self._info(row)

    def _restored(
        self, container_id: str, bundle: Bundle, checkpoint: str | None
    ) -> Manifest | None:
        """The container's work counts from the checkpoint it was restored from (or from
        nothing); a restore is told to the listeners."""
        m = self.manager
        if checkpoint is None:
            m.work.forget(container_id)
            return None
        try:
            manifest = m.store.get(checkpoint)
        except StasisError as e:
            log.warning(
                "container %s: cannot read checkpoint %s it was restored from: %s",
                container_id,
                checkpoint,
                e,
            )
            m.work.forget(container_id)
            return None
        m.restarted(container_id, manifest, f"k8s:{bundle.namespace}", "container created again")
        return manifest

    def _floored(self, interval_s: int, runc_root: Path, container_id: str) -> int:
        """`interval_s` raised to the node's floor (0, none, stays 0); the container's log
        says so."""
        floor = self.min_interval_s
        if not 0 < interval_s < floor:
            return interval_s
        log.info(
            "container %s: checkpoint interval %d s raised to the node's minimum, %d s",
            container_id,
            interval_s,
            floor,
        )
        self._tell(
            runc_root,
            container_id,
            f"checkpoint interval {interval_s} s (STASIS_INTERVAL or the pod's "
            f"stasis.dev/interval) is below this node's minimum of {floor} s: "
            f"checkpoints every {floor} s",
        )
        return floor

    def _tell(self, runc_root: Path, container_id: str, message: str) -> bool:
        """One line into the container's log: written to its init's stderr when that is the
        pipe the runtime's shim reads (never to a file the workload put there)."""
        try:
            pid = int(str(self._runc(runc_root).state(container_id).get("pid")))
            path = f"/proc/{pid}/fd/2"
            if not stat.S_ISFIFO(os.stat(path).st_mode):
                return False
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
            try:
                os.write(fd, f"stasis: {message}\n".encode())
            finally:
                os.close(fd)
        except (StasisError, OSError, ValueError) as e:
            log.debug("container %s: cannot write to its log: %s", container_id, e)
            return False
        return True

    def _runc(self, runc_root: Path) -> Runc:
        return Runc(real_runc(self.manager.settings.runc), runc_root, self.manager.criu.path)

    def running(self, info: ContainerInfo) -> tuple[str, int] | None:
        """(runc's status, init pid) of a registered container that is running or paused."""
        try:
            state = self._runc(Path(info["runc_root"])).state(info["container_id"])
        except StasisError:
            return None
        status = str(state.get("status"))
        if status not in ("running", "paused"):
            return None
        try:
            return status, int(str(state.get("pid")))
        except ValueError:
            return None

    def _row(self, container_id: str) -> dict[str, Any] | None:
        with self.db.transaction() as conn:
            r = (
                conn.execute(
                    select(k8s_containers_table).where(
                        k8s_containers_table.c.container_id == container_id
                    )
                )
                .mappings()
                .first()
            )
        return dict(r) if r is not None else None

    def _set(self, container_id: str, **values: Any) -> None:
        with self.db.transaction() as conn:
            conn.execute(
                update(k8s_containers_table)
                .where(k8s_containers_table.c.container_id == container_id)
                .values(**values)
            )
        self.records.refresh(k8s_containers_table, container_id)

    def all(self, caller: Caller) -> list[ContainerInfo]:
        _root_only(caller)
        with self.db.transaction() as conn:
            rows = conn.execute(select(k8s_containers_table)).mappings().all()
        return [self._info(dict(r)) for r in rows]

    def set_interval(
        self, container_id: str, req: IntervalRequest, caller: Caller
    ) -> ContainerInfo:
        _root_only(caller)
        validate_container_id(container_id)
        row = self._row(container_id)
        if row is None:
            raise NotFoundError(f"no container {container_id} under stasis on this node")
        if req.auto:
            interval = AUTO
        elif req.interval_s is None:
            bundle = read_bundle(Path(row["bundle"]), container_id)
            interval = container_interval(bundle, self.manager.settings.interval)
        else:
            interval = req.interval_s
        if interval != AUTO:
            interval = self._floored(interval, Path(row["runc_root"]), container_id)
        # Counted from now: a shorter interval does not fire at once for an old checkpoint.
        self._set(container_id, interval_s=interval, last_checkpoint_at=int(time.time()))
        row.update(interval_s=interval)
        return self._info(row)

    def interval_of(self, row: dict[str, Any]) -> wire.JobInterval:
        """A registered container's interval in force and why (auto: stasis.k8s.intervals)."""
        return self.auto.job_interval(row, lambda: self._resident(row))

    def _resident(self, row: dict[str, Any]) -> int:
        """The resident memory of a container's processes (0: not running, or unreadable)."""
        try:
            state = self._runc(Path(row["runc_root"])).state(row["container_id"])
            return proctree.resident_bytes(int(str(state.get("pid"))))
        except (StasisError, OSError, ValueError):
            return 0

    def job_intervals(self, caller: Caller) -> list[wire.JobInterval]:
        """Every registered container's interval, where it has one (root only: containers
        belong to no local user)."""
        if not caller.is_root:
            return []
        return [self.interval_of(dict(r)) for r in self._periodic()]

    def _info(self, row: dict[str, Any]) -> ContainerInfo:
        auto = row["interval_s"] == AUTO
        if auto:
            row = {**row, "interval_s": round(self.interval_of(row)["interval_s"])}
        return _info(row, auto)

    def forget(self, container_id: str, caller: Caller) -> Forgotten:
        _root_only(caller)
        validate_container_id(container_id)
        self._drop_plan(container_id)
        with self.db.transaction() as conn:
            n = conn.execute(
                delete(k8s_containers_table).where(
                    k8s_containers_table.c.container_id == container_id
                )
            ).rowcount
        self.records.refresh(k8s_containers_table, container_id)
        self.manager.work.forget(container_id)
        with self._locks_guard:
            # One lock per container ever seen would grow with every pod of the node's life.
            lock = self._locks.get(container_id)
            if lock is not None and not lock.locked():
                del self._locks[container_id]
        return Forgotten(container_id=container_id, forgotten=bool(n))

    # -- checkpoints ----------------------------------------------------------------------

    def _lock(self, container_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(container_id, threading.Lock())

    def checkpoint(
        self, container_id: str, req: CheckpointRequest, caller: Caller, why: str = ""
    ) -> CheckpointAnswer:
        """`why`: what the checkpoint is for, in words (the control plane's reason); else
        the request's reason."""
        _root_only(caller)
        validate_container_id(container_id)
        row = self._row(container_id)
        if req.runc_root:
            root = validate_abs_path(req.runc_root, "runc root")
        elif row is not None:
            root = Path(row["runc_root"])
        else:
            raise NotFoundError(f"no container {container_id} under stasis on this node")
        timeout = req.timeout_s or float(self.manager.settings.k8s_stop_timeout_s)
        lock = self._lock(container_id)
        # A stop waits for an interval checkpoint under way (it is nearly done); a second
        # interval or manual one is refused.
        if not lock.acquire(timeout=timeout if req.reason == "stop" else 0):
            raise UsageError(f"a checkpoint of container {container_id} is already being taken")
        try:
            if req.reason == "annotation":
                self._held_to_floor(container_id)
            return self._checkpoint(
                container_id,
                root,
                req.reason,
                timeout,
                row["registered"] if row else None,
                why or req.reason,
                _parent(row),
            )
        except StasisError as e:
            if req.reason == "stop":
                # The runtime stops it as usual: its label keeps the checkpoints it had.
                log.warning("container %s: no checkpoint at its stop: %s", container_id, e)
            raise
        finally:
            lock.release()

    def _held_to_floor(self, container_id: str) -> None:
        """A pod owner's request (by annotation) comes no sooner than the node's floor after
        the container's last checkpoint, whatever took it: annotating a pod again and again
        does not make the node freeze and dump it more often than its intervals may."""
        floor = self.min_interval_s
        row = self._row(container_id)  # read again under the container's lock
        if floor <= 0 or row is None or row["last_checkpoint"] is None:
            return
        since = time.time() - (row["last_checkpoint_at"] or 0)
        if since >= floor:
            return
        raise TooSoonError(
            f"checkpoint of container {container_id} refused: its last one was {since:.0f} s "
            f"ago and this node takes one at most every {floor} s (its admin's minimum, "
            f"k8s_min_interval_s): ask again in {max(1, round(floor - since))} s"
        )

    def _checkpoint(
        self,
        container_id: str,
        root: Path,
        reason: str,
        timeout_s: float,
        registered: str | None,
        why: str,
        restored_from: str | None,
    ) -> CheckpointAnswer:
        m = self.manager
        runc = self._runc(root)
        state = runc.state(container_id)
        if state.get("status") not in ("running", "paused"):
            raise UsageError(
                f"container {container_id} is {state.get('status')}: only a "
                "running container can be checkpointed"
            )
        bundle = read_bundle(Path(str(state.get("bundle"))), container_id)
        if bundle.label is None:
            raise UsageError(f"container {container_id} has no STASIS_CHECKPOINT")
        label = validate_label(bundle.label)
        if reason == "stop":
            # Whatever comes of this checkpoint, the container's end is no success to retire
            # its label for (`ended`); the runtime said so too, unless the stop came here.
            mark_stop_asked(bundle.path)
        step = "stop" if reason == "stop" else "interval"  # the fault points' names
        started = time.monotonic()
        created = datetime.now(UTC)
        cid = new_checkpoint_id(created)
        store = m.store
        data_key = store.new_data_key(cid) if m.settings.encrypt else None
        staging = store.staging_dir(cid)
        work = Path(tempfile.mkdtemp(prefix=f"runc-{cid}-", dir=m.criu_logs))
        freeze = freezes.Freeze(
            container_id=container_id, runc_root=str(root), checkpoint=cid, stop=reason == "stop"
        )
        try:
            self.freezes.write(freeze)  # before the pause: a daemon killed after it thaws it
            runc.run("pause", container_id, timeout_s=10)
        except BaseException:
            self._thawed(freeze, runc)
            shutil.rmtree(work, ignore_errors=True)
            raise
        faults.point(f"k8s.{step}.after-pause")
        frozen = time.monotonic()
        paused = True
        try:
            try:
                runc.checkpoint(container_id, staging, work, timeout_s)
                rootfs.capture(bundle.rootfs, staging / rootfs.DIFF_NAME)
                # The spec it ran with: what an export hands to CRI-O or Podman.
                shutil.copyfile(bundle.path / "config.json", staging / oci.SPEC_DUMP)
            except BaseException:
                store.discard(cid)
                raise
            faults.point(f"k8s.{step}.after-dump")
            if reason != "stop":
                paused = not _resume(runc, container_id)
            frozen_s = time.monotonic() - frozen
            info = CheckpointInfo(
                id=cid,
                label=label,
                job=f"container {container_id}",
                host=m.settings.node,
                created=created,
                criu_version=m.criu_version(m.criu),
                command=bundle.args,
                cwd=bundle.cwd,
                user=f"k8s:{bundle.namespace}",
                uid=bundle.uid,
                gid=bundle.uid,
                # What this run was restored from: its checkpoints descend from that one.
                parent=restored_from,
                extra={
                    "k8s": {
                        "namespace": bundle.namespace,
                        "pod": bundle.pod,
                        "container": bundle.name,
                        "container_id": container_id,
                        "reason": reason,
                        "runtime": "runc",
                    },
                    "work_s": m.work.at(container_id, registered or created, created),
                },
            )
            manifest = store.publish(info, "none", data_key=data_key)
            freeze.published = True
            if paused:
                self.freezes.write(freeze)
        except BaseException:
            if paused:
                _resume(runc, container_id)
            self._thawed(freeze, runc)
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        faults.point(f"k8s.{step}.after-publish")
        stopped = False
        if reason == "stop":
            # Killed while still frozen: it never runs past its checkpoint.
            try:
                runc.run("kill", container_id, str(int(signal.SIGKILL)), timeout_s=10)
                stopped = True
            finally:
                _resume(runc, container_id)
                self._thawed(freeze, runc)
        else:
            self._thawed(freeze, runc)
        try:
            self._set(
                container_id, last_checkpoint=manifest.id, last_checkpoint_at=int(time.time())
            )
        except Exception as e:  # the database: the checkpoint is published all the same
            log.warning(
                "container %s: checkpoint %s published, but the database did not "
                "record it (%s: %s); its next interval may come early",
                container_id,
                manifest.id,
                type(e).__name__,
                str(e)[:200],
            )
        log.info(
            "container %s (%s): checkpoint %s of label %s (%s, %.2f s)",
            container_id,
            bundle.namespace,
            manifest.id,
            label,
            why,
            time.monotonic() - started,
        )
        m.activity.notify(
            Activity(
                kind="checkpoint",
                checkpoint=manifest.id,
                label=label,
                job=container_id,
                user=info.user,
                size_bytes=manifest.size_bytes,
                stored_size_bytes=manifest.stored_size_bytes,
                work_s=work_of(info.extra),
                duration_s=round(time.monotonic() - started, 4),
                frozen_s=round(frozen_s, 4),
                leave_running=not stopped,
                store=m.store.url,
                reason=why[:60],
            )
        )
        return CheckpointAnswer(
            checkpoint=manifest.id,
            label=label,
            container_id=container_id,
            namespace=bundle.namespace,
            size_bytes=manifest.size_bytes,
            duration_s=round(time.monotonic() - started, 4),
            stopped=stopped,
        )

    def _periodic(self) -> Sequence[RowMapping]:
        """The rows of the containers that have an interval."""
        with self.db.transaction() as conn:
            return (
                conn.execute(
                    select(k8s_containers_table).where(k8s_containers_table.c.interval_s != 0)
                )
                .mappings()
                .all()
            )

    def checkpoint_due(self) -> None:
        """Every container with STASIS_INTERVAL whose last checkpoint is that old: another."""
        now = time.time()
        for row in self._periodic():
            interval = (
                self.interval_of(dict(row))["interval_s"]
                if row["interval_s"] == AUTO
                else row["interval_s"]
            )
            # A row kept from before the floor was raised is held to it too.
            if now - (row["last_checkpoint_at"] or 0) < max(interval, self.min_interval_s):
                continue
            try:
                self.checkpoint(
                    row["container_id"],
                    CheckpointRequest(reason="interval"),
                    Caller(pid=0, uid=0, gid=0),
                )
            except StasisError as e:
                self._set(row["container_id"], last_checkpoint_at=int(now))
                log.warning(
                    "interval checkpoint of container %s failed: %s", row["container_id"], e
                )

    def ended(self, container_id: str, exit_status: int | None) -> list[str]:
        """The container's init exited: a genuine success (0, and no stop was asked of it)
        retires the label's checkpoints of its namespace (the ids deleted); anything else
        keeps them for the next start. "Cannot tell" keeps them: an exit status unknown, or a
        bundle gone that would say whether a stop was asked."""
        row = self._row(container_id)
        if row is None:
            return []
        bundle = Path(row["bundle"])
        kept = None
        if exit_status is None:
            kept = "its exit status is unknown"
        elif exit_status != 0:
            kept = "it failed"
        elif os.path.lexists(bundle / STOP_MARKER):
            # The app may end with 0 on SIGTERM: its work is not done, and the stop's
            # checkpoint may have failed (the store unreachable) or never been asked.
            kept = "a stop was asked of it: its work was cut short"
        elif not bundle.is_dir():
            kept = f"its bundle {bundle} is gone, which would say whether a stop was asked"
        shown = "(status unknown)" if exit_status is None else str(exit_status)
        if kept is not None:
            log.info(
                "container %s exited %s: label %s kept (%s)",
                container_id,
                shown,
                row["label"],
                kept,
            )
            return []
        store = self.manager.store
        uid = namespace_uid(row["namespace"])
        retired = store.catalog.retire(
            m.id
            for m in store.list(row["label"], uid=uid)
            if (m.extra.get("k8s") or {}).get("namespace") == row["namespace"]
        )
        log.info(
            "container %s exited 0: label %s retired (%d checkpoint(s))",
            container_id,
            row["label"],
            len(retired),
        )
        return retired

    # -- OCI images ------------------------------------------------------------------------

    def export(self, checkpoint_id: str, req: ExportRequest, caller: Caller) -> ExportAnswer:
        _root_only(caller)
        out = validate_abs_path(req.path, "output file")
        if not out.parent.is_dir():
            raise UsageError(f"cannot write {out}: {out.parent} is not a directory")
        store = self.manager.store
        with store.open_images(checkpoint_id, self.manager.scratch) as (manifest, images):
            k8s = manifest.extra.get("k8s") or {}
            meta = {
                "label": manifest.label,
                "checkpoint": manifest.id,
                "namespace": k8s.get("namespace", ""),
                "name": k8s.get("container"),
                "container_id": k8s.get("container_id", ""),
                "user": manifest.user,
                "created": manifest.created.isoformat(),
                "command": manifest.command,
                "cwd": manifest.cwd,
                "criu_version": manifest.criu_version,
            }
            done = oci.export_checkpoint(images, [f.name for f in manifest.files], meta, out)
        return ExportAnswer(
            checkpoint=checkpoint_id, path=str(out), digest=done.digest, size_bytes=done.size_bytes
        )

    def import_(self, req: ImportRequest, caller: Caller) -> CheckpointAnswer:
        _root_only(caller)
        archive = validate_abs_path(req.path, "archive")
        m = self.manager
        created = datetime.now(UTC)
        cid = new_checkpoint_id(created)
        staging = m.store.staging_dir(cid)
        try:
            meta = oci.import_archive(archive, staging)
        except BaseException:
            m.store.discard(cid)
            raise
        label = validate_label(req.label or str(meta.get("label") or ""))
        namespace = req.namespace or str(meta.get("namespace") or "")
        if not namespace:
            m.store.discard(cid)
            raise UsageError(f"{archive} names no namespace: give --namespace")
        uid = namespace_uid(namespace)
        info = CheckpointInfo(
            id=cid,
            label=label,
            job=f"imported {archive.name}",
            host=m.settings.node,
            created=created,
            criu_version=str(meta.get("criu_version") or "unknown"),
            command=list(meta.get("command") or []),
            cwd=str(meta.get("cwd") or "/"),
            user=f"k8s:{namespace}",
            uid=uid,
            gid=uid,
            extra={
                "k8s": {
                    "namespace": namespace,
                    "container": meta.get("name"),
                    "reason": "import",
                    "runtime": "runc",
                    "imported_from": meta.get("checkpoint"),
                }
            },
        )
        manifest = m.store.publish(info, "none")
        return CheckpointAnswer(
            checkpoint=manifest.id,
            label=label,
            container_id="",
            namespace=namespace,
            size_bytes=manifest.size_bytes,
            duration_s=round((datetime.now(UTC) - created).total_seconds(), 4),
            stopped=False,
        )

    # -- restores -------------------------------------------------------------------------

    def plan_restore(self, req: RestoreRequest, caller: Caller) -> RestorePlan:
        """Fetch and verify the newest good checkpoint of the container's label, put its
        writable layer into the new root, and say where its images are (kept until
        `restore_done`). A checkpoint that fails verification is skipped for the one before."""
        _root_only(caller)
        cid = validate_container_id(req.container_id)
        bundle = read_bundle(validate_abs_path(req.bundle, "bundle"), cid)
        if bundle.label is None:
            raise UsageError(f"container {cid} has no STASIS_CHECKPOINT")
        label = validate_label(bundle.label)
        notes: list[str] = []
        given_up: list[str] = []
        limit = self.manager.settings.k8s_restore_attempts
        self._drop_plan(cid)
        for manifest in self._candidates(label, bundle, notes):
            failed = self.failures.get(manifest.id)
            if 0 < limit <= failed.attempts:
                given_up.append(manifest.id)
                notes.append(
                    f"checkpoint {manifest.id} skipped: its restore failed {failed.attempts} "
                    f"times on this node (last: {failed.error}); the label's previous "
                    f"checkpoint is tried instead (to try this one again, fix the cause and "
                    f"remove {self.failures.path(manifest.id)} on node "
                    f"{self.manager.settings.node})"
                )
                log.warning(
                    "container %s: checkpoint %s skipped after %d failed restores",
                    cid,
                    manifest.id,
                    failed.attempts,
                )
                continue
            stack = contextlib.ExitStack()
            try:
                _, images = stack.enter_context(
                    self.manager.store.open_images(manifest.id, self.manager.scratch)
                )
                # Before anything of it touches the new container's root.
                same_identity(manifest.id, images / oci.SPEC_DUMP, bundle.path / "config.json")
                work = Path(
                    tempfile.mkdtemp(
                        prefix=f"runc-restore-{manifest.id}-", dir=self.manager.criu_logs
                    )
                )
                stack.callback(shutil.rmtree, work, True)
                diff = images / rootfs.DIFF_NAME
                if diff.exists():
                    rootfs.apply(diff, bundle.rootfs)
            except rootfs.PartlyWritten:
                # The root holds part of this layer now: an older checkpoint's layer on top
                # of it would make a root no checkpoint had. The create fails instead.
                stack.close()
                raise
            except StasisError as e:
                stack.close()
                if not _skippable(e):
                    # The store cannot be read: an older checkpoint, or none, would be a
                    # guess. The create fails and is tried again (stasis-runc).
                    raise
                said = str(e)
                notes.append(
                    said
                    if said.startswith(f"checkpoint {manifest.id} refused: ")
                    else f"checkpoint {manifest.id} skipped: {said}"
                )
                log.warning("container %s: checkpoint %s skipped: %s", cid, manifest.id, e)
                continue
            except BaseException:
                stack.close()
                raise
            self._plans[cid] = _Plan(
                stack, time.monotonic(), manifest.id, work, label, bundle.namespace, bundle.pod
            )
            faults.point("k8s.restore.planned")
            return RestorePlan(
                checkpoint=manifest.id,
                label=label,
                images_dir=str(images),
                work_dir=str(work),
                notes=notes,
                given_up=given_up,
            )
        if given_up and bundle.pod:
            records = " ".join(str(self.failures.path(c)) for c in given_up)
            self._tell_pod(
                bundle.namespace,
                bundle.pod,
                (
                    f"label {label}: none of its checkpoints can be restored on node "
                    f"{self.manager.settings.node}: checkpoint {', '.join(given_up)} failed every "
                    "attempt. They are kept, and the container does not start unless its "
                    "STASIS_FRESH=1 asks to start it fresh; to try them again, fix the cause and "
                    f"remove {records} on the node"
                ),
            )
        return RestorePlan(
            checkpoint=None,
            label=label,
            images_dir=None,
            work_dir=None,
            notes=notes
            or [f"no checkpoint of label {label} in namespace " f"{bundle.namespace} yet"],
            given_up=given_up,
        )

    def _candidates(self, label: str, bundle: Bundle, notes: list[str]) -> Iterator[Manifest]:
        """The label's checkpoints of the container's namespace, newest first. The newest comes
        from the index (a bounded lookup); the rest are listed only when it fails."""
        store = self.manager.store
        newest: Manifest | None = None
        try:
            newest = store.latest(label, uid=bundle.uid)
        except NotFoundError:
            return
        except StasisError as e:
            notes.append(f"the newest checkpoint of label {label} cannot be read: {e}")
        if newest is not None and self._ours(newest, bundle, notes):
            yield newest
        try:
            rest = [
                m for m in store.list(label, uid=bundle.uid) if newest is None or m.id != newest.id
            ]
            # Taken before namespaces had uids above every kernel uid; their namespace is
            # checked by name (_ours), as every candidate's is.
            rest += store.list(label, uid=legacy_namespace_uid(bundle.namespace))
        except StasisError as e:
            # "Cannot tell" is not "none": the create waits, then fails (stasis-runc).
            raise StoreError(f"the checkpoints of label {label} cannot be listed: {e}") from e
        rest.sort(key=order_key, reverse=True)  # lineage, not the nodes' clocks
        for m in rest:
            if self._ours(m, bundle, notes):
                yield m

    @staticmethod
    def _ours(m: Manifest, bundle: Bundle, notes: list[str]) -> bool:
        ns = (m.extra.get("k8s") or {}).get("namespace")
        if ns != bundle.namespace:
            notes.append(
                f"checkpoint {m.id} belongs to namespace {ns}, not " f"{bundle.namespace}: refused"
            )
            return False
        return True

    def restore_done(
        self, container_id: str, req: RestoreDoneRequest, caller: Caller
    ) -> RestoreDone:
        """The wrapper's `runc restore` ended. A failure is counted against the checkpoint
        (given up on this node at `k8s_restore_attempts`), its restore log kept, and told
        to the pod as a Warning event; a success clears the count."""
        _root_only(caller)
        validate_container_id(container_id)
        plan = self._plans.get(container_id)
        # The daemon's own plan, else (a daemon restarted meanwhile) the wrapper's word.
        checkpoint = plan.checkpoint if plan is not None else req.checkpoint
        kept = ""
        if not req.ok and plan is not None:
            kept = self._keep_log(container_id, plan)
        self._drop_plan(container_id)
        limit = self.manager.settings.k8s_restore_attempts
        answer = RestoreDone(
            container_id=container_id, checkpoint=None, attempts=0, limit=limit, log=kept, record=""
        )
        if not is_checkpoint_id(checkpoint):
            if not req.ok:
                log.warning("container %s: runc restore failed: %s", container_id, req.error)
            return answer
        answer["checkpoint"] = checkpoint
        answer["record"] = str(self.failures.path(checkpoint))
        if req.ok:
            self.failures.forget(checkpoint)
            return answer
        failed = self.failures.failed(checkpoint, req.error, kept)
        answer["attempts"] = failed.attempts
        log.warning(
            "container %s: runc restore of checkpoint %s failed (attempt %d of %s): "
            "%s; its log: %s",
            container_id,
            checkpoint,
            failed.attempts,
            limit or "unbounded",
            req.error,
            kept or "none",
        )
        if plan is not None and plan.pod:
            self._tell_pod(
                plan.namespace,
                plan.pod,
                restorefails.message(
                    plan.label,
                    checkpoint,
                    req.error,
                    failed.attempts,
                    limit,
                    kept,
                    str(self.failures.path(checkpoint)),
                    self.manager.settings.node,
                ),
            )
        return answer

    def _keep_log(self, container_id: str, plan: _Plan) -> str:
        """The failed restore's log, kept beside CRIU's other logs (its work directory goes
        with the plan): what the node's admin reads to find the cause."""
        kept = self.manager.criu_logs / f"k8s-restore-{plan.checkpoint}-{container_id}.log"
        try:
            shutil.copyfile(plan.work / "restore.log", kept)
        except OSError as e:
            log.debug("container %s: no restore log kept: %s", container_id, e)
            return ""
        return str(kept)

    def _tell_pod(self, namespace: str, pod: str, message: str) -> None:
        """A Warning event on the pod, where the node has a Kubernetes API. The API may be
        slow or away: the wrapper's answer (the create's failure) does not wait for it."""
        tell = self.pod_event
        if tell is None:
            return

        def post() -> None:
            try:
                tell(namespace, pod, RESTORE_FAILED_REASON, message)
            except Exception as e:
                log.warning("pod %s/%s: no event for its failed restore: %s", namespace, pod, e)

        threading.Thread(target=post, name="restore failure event", daemon=True).start()

    def _drop_plan(self, container_id: str) -> bool:
        plan = self._plans.pop(container_id, None)
        if plan is not None:
            plan.stack.close()
        return plan is not None

    # -- freezes a killed daemon left --------------------------------------------------------

    def _thawed(self, freeze: freezes.Freeze, runc: Runc) -> None:
        """The end of a freeze this daemon took: its record goes, unless the container is
        still paused (a resume failed), which the next settle retries."""
        try:
            status = runc.state(freeze.container_id).get("status")
        except StasisError:
            status = None
        if status == "paused":
            log.warning(
                "container %s: still paused after its checkpoint; thawed later", freeze.container_id
            )
            with self._locks_guard:
                self._unsettled.append(freeze)
            return
        self.freezes.end(freeze.checkpoint)

    def settle_freezes(self) -> None:
        """At the daemon's start: every container a killed daemon left frozen is thawed (or
        killed at its published stop checkpoint); staging of what was not published goes."""
        self.freezes.prepare()
        self._unsettled = self.freezes.open_entries()
        self.retry_freezes()

    def retry_freezes(self) -> None:
        with self._locks_guard:
            todo, self._unsettled = self._unsettled, []
        left = []
        for entry in todo:
            lock = self._lock(entry.container_id)
            # A checkpoint of it under way now has paused it for itself: not ours to thaw.
            if not lock.acquire(blocking=False):
                left.append(entry)
                continue
            try:
                settled = freezes.settle(entry, self._runc(Path(entry.runc_root)))
            finally:
                lock.release()
            if not settled:
                left.append(entry)
                continue
            if not entry.published:
                with contextlib.suppress(StasisError, OSError):
                    self.manager.store.discard(entry.checkpoint)
            self.freezes.end(entry.checkpoint)
        with self._locks_guard:
            self._unsettled += left

    def sweep(self) -> None:
        """Plans whose wrapper died before saying how the restore went."""
        now = time.monotonic()
        for cid, plan in list(self._plans.items()):
            if now - plan.since > _PLAN_TTL_S:
                self._drop_plan(cid)
        self.failures.prune(self._exists)

    def _exists(self, checkpoint: str) -> bool:
        try:
            self.manager.store.get(checkpoint)
        except NotFoundError:
            return False
        except StasisError:
            return True  # cannot tell: kept
        return True

    def close(self) -> None:
        for cid in list(self._plans):
            self._drop_plan(cid)


def _skippable(e: StasisError) -> bool:
    """A reason to try the label's checkpoint before this one: this one is bad or not this
    container's (corrupt, untrusted, deleted meanwhile, other credentials), not a store that
    cannot be read."""
    return isinstance(
        e, CorruptCheckpointError | UntrustedCheckpointError | NotFoundError | ContainerError
    ) or not isinstance(e, StoreError)


class TooSoonError(UsageError):
    """A pod owner asked for a checkpoint sooner than the node's floor allows."""


# What of a container's OCI spec says with which credentials its processes run.
_CAP_SETS = ("bounding", "effective", "permitted", "inheritable", "ambient")


def identity(spec: dict[str, Any]) -> dict[str, object]:
    """The credentials an OCI spec gives its container's processes: user, groups,
    capabilities, and the user namespace's mappings (a uid inside means another outside)."""
    process = spec.get("process") if isinstance(spec.get("process"), dict) else {}
    assert isinstance(process, dict)
    user = process.get("user") if isinstance(process.get("user"), dict) else {}
    caps = process.get("capabilities") if isinstance(process.get("capabilities"), dict) else {}
    linux = spec.get("linux") if isinstance(spec.get("linux"), dict) else {}
    assert isinstance(user, dict) and isinstance(caps, dict) and isinstance(linux, dict)

    def names(value: object) -> list[str]:
        return sorted({str(v) for v in value}) if isinstance(value, list) else []

    def mappings(value: object) -> list[str]:
        if not isinstance(value, list):
            return []
        return sorted(
            f"{m.get('containerID')}:{m.get('hostID')}:{m.get('size')}"
            for m in value
            if isinstance(m, dict)
        )

    found: dict[str, object] = {
        "uid": user.get("uid", 0),
        "gid": user.get("gid", 0),
        "additional gids": sorted(
            {int(g) for g in user.get("additionalGids") or [] if isinstance(g, int)}
        ),
    }
    for name in _CAP_SETS:
        found[f"{name} capabilities"] = names(caps.get(name))
    found["uid mappings"] = mappings(linux.get("uidMappings"))
    found["gid mappings"] = mappings(linux.get("gidMappings"))
    return found


def _read_spec(path: Path, what: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = f.read(_SPEC_MAX_BYTES + 1)
        if len(data) > _SPEC_MAX_BYTES:
            raise ValueError(f"larger than {_SPEC_MAX_BYTES} bytes")
        spec = json.loads(data)
        if not isinstance(spec, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ContainerError(f"{what} cannot be read ({path}: {e})") from None
    return spec


def same_identity(checkpoint_id: str, recorded: Path, config: Path) -> None:
    """Refuse (one line) to resume checkpoint `checkpoint_id` into a container whose spec
    (`config`) gives its processes other credentials than the checkpoint's own copy of its
    spec (`recorded`): CRIU would give the restored processes the credentials they had."""
    if not recorded.exists():
        raise ContainerError(
            f"checkpoint {checkpoint_id} refused: it has no copy of its container's spec "
            f"({oci.SPEC_DUMP}), so nothing says with which user and capabilities it ran; "
            "delete it (stasis checkpoints rm) or import it from an archive that has one"
        )
    was = identity(_read_spec(recorded, f"the spec of checkpoint {checkpoint_id}"))
    now = identity(_read_spec(config, "the new container's spec"))
    differ = [f"{k} {_show(was[k])} there, {_show(now[k])} here" for k in was if was[k] != now[k]]
    if differ:
        raise ContainerError(
            f"checkpoint {checkpoint_id} refused: it was taken of a container with other "
            f"credentials ({'; '.join(differ)}), which its processes would resume with; "
            "resume it from a pod whose securityContext (runAsUser, runAsGroup, "
            "supplementalGroups, capabilities, hostUsers) is the checkpointed one's"
        )


def _show(value: object) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]" if value else "none"
    return str(value)


def _resume(runc: Runc, container_id: str) -> bool:
    try:
        runc.run("resume", container_id, timeout_s=10)
        return True
    except ContainerError as e:
        log.debug("resume of container %s: %s", container_id, e)
        return False


def _info(row: dict[str, Any], auto: bool = False) -> ContainerInfo:
    return ContainerInfo(
        container_id=row["container_id"],
        runc_root=row["runc_root"],
        bundle=row["bundle"],
        label=row["label"],
        namespace=row["namespace"],
        pod=row["pod"],
        interval_s=row["interval_s"],
        interval_auto=auto,
        restored_from=row["restored_from"],
        last_checkpoint=row["last_checkpoint"],
        registered=row["registered"],
    )
