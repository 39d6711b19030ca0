"""Checkpointing a process tree (a job's, or a scheduler task's): one dump of a tree at a time,
its images published to the store or nothing at all (the tree goes on), and what dumps that a
killed daemon never finished left behind. Each checkpoint records what its restore depends on
(`restore_facts`: this node's architecture, CPU flags, kernel, CRIU and stasis versions, the
user, the files the tree had open; engine/nodefacts.py)."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from stasis import faults, wire
from stasis.daemon import jobnet, staging
from stasis.daemon.activity import Activity, work_of
from stasis.daemon.core import Core
from stasis.daemon.db import JobDatabaseError, JobRow
from stasis.daemon.inflight import InFlightDump
from stasis.daemon.models import DumpRequest, FreezeRequest, ThawRequest, validate_job_id
from stasis.daemon.partfreeze import DIRECTORY as PART_FREEZES
from stasis.daemon.partfreeze import EDGE_SETTLE_S, PartFreezes
from stasis.daemon.progress import DirWatcher, Progress
from stasis.daemon.tracking import JobTracker
from stasis.daemon.users import Caller, account
from stasis.engine import (
    CRIU,
    DumpOptions,
    DumpResult,
    boundtmp,
    credentials,
    find_criu,
    netlock,
    nodefacts,
    nodelocal,
    obstacles,
    privatepts,
    privatetmp,
    proctree,
    unixpeers,
)
from stasis.errors import CheckpointError, StasisError, UsageError
from stasis.store import (
    CheckpointInfo,
    CompressionRequest,
    DataKey,
    Manifest,
    RecordedFacts,
    RecordedJobNet,
    new_checkpoint_id,
    validate_label,
)
from stasis.wire import DumpAnswer, DumpCheckAnswer, FreezeAnswer, ThawAnswer

log = logging.getLogger("stasis.daemon")

# CRIU's words when it froze the tree mid-call to a process outside it: a connection open (to
# a server outside, or from a client outside), or one whose server has not accepted it yet.
_MID_CALL = (
    "Can't dump half of stream unix connection",
    "Non-empty write queue on an in-flight socket",
)
_MAX_TRIES = 4  # of one dump caught mid-call: each is a whole dump, the job frozen that long


class _CaughtMidCall(CheckpointError):
    """CRIU's dump failed on a unix connection to a process outside the tree: worth another
    try if it caught a short call (a munge credential, a name-service lookup). `held_s`: how
    long CRIU held the tree before it gave up (the job stood frozen that long for nothing)."""

    def __init__(self, message: str, held_s: float = 0.0) -> None:
        super().__init__(message)
        self.held_s = held_s


class Dumper:
    def __init__(self, core: Core, tracker: JobTracker) -> None:
        self.core = core
        self._tracker = tracker
        self._criu_version: str | None = None
        # What is being dumped (or recovered from a dump a killed daemon left): at most one dump
        # of a job at a time. A second CRIU on a tree the first one holds fails, and a second
        # stop-dump would find the tree the first one stopped (see `_dump_slot`).
        self._busy: dict[str, str] = {}
        self._busy_lock = threading.Lock()
        # Dumps whose tree was killed or resumed but whose record (the job's state, the network
        # lock) the database refused: their journal entries stay until `settle_pending` wrote it.
        # None: refused during a dump still under way (it settles itself, then hands it over).
        self._unrecorded: dict[str, InFlightDump | None] = {}
        self._unrecorded_lock = threading.Lock()
        # Parts of jobs that span nodes, frozen for a checkpoint cut across them (partfreeze.py).
        self.parts = PartFreezes(core.settings.layout.root / PART_FREEZES)

    @property
    def criu(self) -> CRIU:
        return CRIU(find_criu(self.core.settings.criu), self.core.settings.layout.criu_logs)

    def criu_version(self, criu: CRIU) -> str:
        # Asked once: each ask starts a criu process, and a dump should not wait for that.
        if self._criu_version is None:
            self._criu_version = ".".join(str(p) for p in criu.version())
        return self._criu_version

    def prepare(self) -> None:
        """Clear what dumps that never finished left (at start, before any dump)."""
        settings = self.core.settings
        if settings.stage_dir == staging.AUTO:
            unusable = staging.ensure_auto_root()
            if unusable:
                log.warning("%s", unusable)  # and each dump the disk makes wait says so
        for name in staging.remove_leftovers(
            staging.stage_root(settings.stage_dir, settings.state_dir)
        ):
            log.info("removed %s from the memory stage: a dump that never finished", name)
        self.core.journal.prepare()
        self.recover_dumps()
        self.parts.settle()
        try:
            for name in self.core.store.catalog.remove_stale_staging():
                log.info("removed staging/%s from the store: a dump that never finished", name)
        except StasisError as e:
            log.warning("%s", e)  # the daemon still works; the space stays taken

    def dump(
        self, job_id: str, req: DumpRequest, caller: Caller, progress: Progress | None = None
    ) -> DumpAnswer:
        started = time.monotonic()
        row = self._tracker.row(job_id, caller)
        # Held until the job is recorded checkpointed and killed: a second request in between
        # would otherwise dump the stopped tree, or report the first one's success as a failure.
        with self._dump_slot(f"job {row.id}", f"job {job_id}"):
            return self._dump(job_id, req, caller, progress, started)

    @contextmanager
    def _dump_slot(
        self, key: str, what: str, why: str = "being checkpointed already; wait for it"
    ) -> Iterator[None]:
        """Hold `key` (a job, or a process tree by its pid) for one dump. Whoever asks for it
        meanwhile gets a CheckpointError at once: "<what> is <why the holder gave>"."""
        with self._busy_lock:
            held = self._busy.get(key)
            if held is not None:
                raise CheckpointError(f"{what} is {held}")
            self._busy[key] = why
        try:
            yield
        finally:
            with self._busy_lock:
                del self._busy[key]

    def _dump(
        self,
        job_id: str,
        req: DumpRequest,
        caller: Caller,
        progress: Progress | None,
        started: float,
    ) -> DumpAnswer:
        self._tracker.poll()
        row = self._tracker.row(job_id, caller)
        if row.state not in ("running", "restored") or row.pid is None:
            raise UsageError(f"job {job_id} is not running (state {row.state}); nothing to dump")
        if not proctree.alive(row.pid, row.pid_start):
            raise UsageError(f"job {job_id} is no longer running; nothing to dump")
        label = validate_label(req.label) if req.label else row.label
        frozen = self.parts.get(row.id)
        if req.frozen and frozen is None:
            raise UsageError(
                f"job {job_id} is not frozen: freeze it first (a checkpoint across nodes), or "
                "dump it without frozen"
            )
        if frozen is not None and not req.frozen:
            raise UsageError(
                f"job {job_id} is frozen for a checkpoint across nodes: dump it with frozen, or "
                "thaw it first"
            )
        if (req.cut_parts is None) != (req.cut_key is None) or (
            req.cut_parts is not None and not req.frozen
        ):
            raise UsageError(
                f"job {job_id} not dumped: a cut's record (cut_parts and cut_key, both) goes "
                "only with a frozen part's dump; dump it without them, or freeze it first"
            )
        # A frozen part stays frozen after its dump, whatever its dump's outcome: its
        # coordinator stops it or thaws it (partfreeze.py).
        leave_running = req.leave_running or frozen is not None
        criu = self.criu
        notes: list[str] = []
        if req.incremental and not criu.features().mem_track:
            # Without soft-dirty tracking CRIU refuses pre-dumps: a full dump is the honest answer.
            notes.append(
                "incremental dump not possible: this kernel does not track dirty "
                "memory (no soft-dirty); took a full dump"
            )
        created = datetime.now(timezone.utc)
        checkpoint_id = new_checkpoint_id(created)
        info = CheckpointInfo(
            id=checkpoint_id,
            label=label,
            job=row.id,
            host=self.core.hostname,
            created=created,
            criu_version=self.criu_version(criu),
            command=row.command,
            cwd=row.cwd,
            user=row.user,
            uid=row.uid,
            gid=row.gid,
            log_path=row.log,
            parent=row.checkpoint,
            extra={
                "work_s": self.core.work.at(row.id, row.created, created),
                # How a restore tells a whole cut from one a failure left short
                # (stasis.slurm.cut.restore_plan).
                **(
                    {"cut": {"parts": req.cut_parts, "key": req.cut_key}}
                    if req.cut_parts is not None
                    else {}
                ),
            },
        )
        what = f"job {job_id}"
        with self.parts.dumping(row.id):
            manifest, result, staged = self.checkpoint_tree(
                row.pid,
                info,
                leave_running,
                req.compress,
                what,
                progress,
                notes,
                encrypt=req.encrypt,
                reason=req.reason,
                freeze_cgroup=frozen.cgroup if frozen else None,
            )
        if frozen is not None:
            self.parts.note_checkpoint(row.id, manifest.id)
            notes.append(
                "the job stays frozen: stop it (thaw with stop) once every part of its job "
                "is dumped, or thaw it"
            )
        if not leave_running:
            # The checkpoint is published and a stop was asked: the job ends whether or not the
            # database takes the record now (frozen until it does, it would be neither running
            # nor saved). A refused record is written later (`settle_pending`), its journal
            # entry kept meanwhile so that a daemon killed before then writes it at its start.
            try:
                self.core.db.set(row.id, state="checkpointed")
            except JobDatabaseError as e:
                log.warning(
                    "job %s: stopped after its checkpoint %s, but its state could not "
                    "be recorded yet: %s",
                    row.id,
                    manifest.id,
                    e,
                )
                notes.append(
                    "the job is stopped as asked, but the daemon's database could not "
                    "record it yet; it is recorded as soon as it can be"
                )
                self._defer(manifest.id)
            faults.point("dump.after-db")
            # The namespace init: the whole tree goes with it.
            _kill(row.pid)
            self.dump_settled(manifest.id)
        else:
            faults.point("dump.after-db")
        return DumpAnswer(
            checkpoint=manifest.id,
            label=manifest.label,
            job=row.id,
            size_bytes=manifest.size_bytes,
            duration_s=round(result.duration_s, 4),
            staged=staged,
            notes=notes,
            elapsed_s=round(time.monotonic() - started, 4),
        )

    def freeze(self, job_id: str, req: FreezeRequest, caller: Caller) -> FreezeAnswer:
        """Freeze a part of a job that spans nodes, before any part is dumped (partfreeze.py)."""
        self._tracker.poll()
        row = self._tracker.row(job_id, caller)
        if row.state not in ("running", "restored") or row.pid is None:
            raise UsageError(f"job {job_id} is not running (state {row.state}); nothing to freeze")
        if not proctree.alive(row.pid, row.pid_start):
            raise UsageError(f"job {job_id} is no longer running; nothing to freeze")
        # What refuses its dump refuses its freeze: no part of the job is held for nothing.
        refused = self.refusal(row.pid, row)
        if refused:
            raise CheckpointError(f"job {job_id} not frozen, it runs on: {refused}")
        with self._dump_slot(f"job {row.id}", f"job {job_id}", "being frozen; wait for it"):
            entry = self.parts.freeze(row.id, row.pid, req.timeout_s, row.uid)
        return FreezeAnswer(
            job=row.id, cgroup=entry.cgroup, job_net=entry.vni, timeout_s=req.timeout_s
        )

    def thaw(self, job_id: str, req: ThawRequest, caller: Caller) -> ThawAnswer:
        """Let a frozen part run on, or (`stop`) end it at the checkpoint taken while frozen."""
        row = self._tracker.row(job_id, caller)
        with self._dump_slot(f"job {row.id}", f"job {job_id}", "being thawed; wait for it"):
            held = self.parts.get(row.id)
            if req.stop and held is not None and held.checkpoints:
                try:
                    self.core.db.set(row.id, state="checkpointed")
                except JobDatabaseError as e:
                    raise CheckpointError(
                        f"job {job_id} not stopped, still frozen: its state cannot be "
                        f"recorded: {e}"
                    ) from e
            entry = self.parts.thaw(row.id, req.stop)
        self._tracker.poll()
        return ThawAnswer(
            job=row.id,
            state=self._tracker.row(job_id, caller).wire()["state"],
            stopped=entry.stop,
            checkpoints=entry.checkpoints,
        )

    def dump_check(self, job_id: str, caller: Caller) -> DumpCheckAnswer:
        """What would make a dump of the job fail, or its restore differ, found without
        dumping (`stasis dump --check`)."""
        row = self._tracker.row(job_id, caller)
        self._tracker.poll()
        row = self._tracker.row(job_id, caller)
        if (
            row.state not in ("running", "restored")
            or row.pid is None
            or not proctree.alive(row.pid, row.pid_start)
        ):
            raise UsageError(f"job {job_id} is not running (state {row.state}); nothing to check")
        try:
            found = obstacles.find(row.pid, viewer=row.uid)
            beyond = (
                []
                if row.uid == 0
                else credentials.tree_excess(row.pid, row.uid, owner_groups(row.uid, row.gid))
            )
        except OSError as e:
            raise StasisError(f"cannot look into job {job_id}: {e}") from e
        if beyond:
            found.obstacles.append(credentials.refusal(beyond, row.user, row.uid))
        too_large = self._node_local_refusal(row.pid, row.uid)
        if too_large:
            found.obstacles.append(too_large)
        return DumpCheckAnswer(job=row.id, obstacles=found.obstacles, notes=found.notes)

    def checkpoint_tree(
        self,
        pid: int,
        info: CheckpointInfo,
        leave_running: bool,
        compress: CompressionRequest,
        what: str,
        progress: Progress | None = None,
        notes: list[str] | None = None,
        *,
        encrypt: bool | None = None,
        reason: str = "asked",
        freeze_cgroup: str | None = None,
    ) -> tuple[Manifest, DumpResult, bool]:
        """Dump the tree under `pid` and publish it as checkpoint `info.id`; `encrypt` its
        images (None: the `encrypt` setting).

        Unless `leave_running`, the tree is left stopped (not killed) once this returns: the
        caller records that, kills it, then calls `dump_settled(info.id)`. Any failure resumes
        it and publishes nothing. One dump of a tree at a time: a second is refused at once.
        Returns the manifest, CRIU's result and whether the images were staged in memory; what
        was not done as asked (not staged, not compressed), and why, is added to `notes`.
        `freeze_cgroup`: the tree's freezer cgroup, frozen already (partfreeze.py): dumped as
        it is, and left frozen.
        """
        notes = [] if notes is None else notes
        vni = jobnet.vni_of(pid)
        if vni is not None:
            # A part of a job that spans nodes: its namespace is left out of the images and
            # made again where it is restored, with the same address (jobnet.py).
            address = jobnet.part_address(vni)
            if address is None:
                raise CheckpointError(
                    f"checkpoint of {what} refused, job still running: its job network {vni} "
                    "has no address on this node"
                )
            info = info.model_copy(update={"job_net": RecordedJobNet(vni=vni, address=address)})
        if privatepts.only_own_pts(pid):
            # Its restorer makes it a devpts of its own again (engine/privatepts.py).
            info = info.model_copy(update={"extra": {**info.extra, privatepts.EXTRA_KEY: True}})
        elif privatetmp.own_mount_ns(pid):
            # Its restore rebuilds the tree's own mounts (a private /tmp, a Slurm job
            # container's): engine/privatetmp.py.
            info = info.model_copy(update={"extra": {**info.extra, privatetmp.EXTRA_KEY: True}})
        if encrypt is None:
            encrypt = self.core.settings.encrypt
        # Refused before CRIU freezes anything (and checked again on the frozen tree, below).
        # An RDMA device or an io_uring (engine/obstacles.py) is not checked again: CRIU fails
        # on them itself (seen for io_uring: it cannot pass its fd), and explain() names them.
        refused = self.refusal(pid, info)
        if refused:
            raise CheckpointError(f"checkpoint of {what} refused, job still running: {refused}")
        # Before CRIU runs: a dump that cannot be encrypted is refused with the job untouched.
        data_key = self.core.store.publisher.new_data_key(info.id) if encrypt else None
        with self._dump_slot(f"pid {pid}", what):
            # Written down until settled: should the daemon die meanwhile, its next start
            # removes the staging and resumes the tree (`recover_dumps`).
            entry = InFlightDump(
                checkpoint=info.id,
                job=info.job,
                pid=pid,
                pid_start=proctree.start_time(pid),
                leave_running=leave_running,
            )
            self.core.journal.begin(entry)
            try:
                done, held_s = self._between_calls(
                    entry, info, compress, what, progress, notes, data_key, freeze_cgroup
                )
            except BaseException:
                # Whatever failed where: the entry ends only with its tree running again (or
                # killed, had the checkpoint been published with a stop asked).
                self._undo(entry)
                raise
            if leave_running:
                self.dump_settled(info.id)
        manifest, result, _ = done
        self.core.activity.notify(
            Activity(
                kind="checkpoint",
                checkpoint=manifest.id,
                label=manifest.label,
                job=info.job,
                user=info.user,
                size_bytes=manifest.size_bytes,
                stored_size_bytes=manifest.stored_size_bytes,
                work_s=work_of(info.extra),
                duration_s=round(result.duration_s, 4),
                # CRIU holds the tree frozen while it dumps (a caught try too, until it gives
                # up); a dump that stops the job ends it.
                frozen_s=round(result.duration_s + held_s, 4),
                leave_running=leave_running,
                store=self.core.store.url,
                reason=reason,
            )
        )
        return done

    def refusal(self, pid: int, owner: CheckpointInfo | JobRow) -> str | None:
        """Why no checkpoint of the tree under `pid` can be taken for `owner` (one line), known
        before anything is frozen: credentials beyond the owner's, what CRIU cannot carry,
        node-local files over the limit. None: nothing known."""
        return (
            beyond_owner(pid, owner)
            or obstacles.refusal(pid, owner.uid)
            or self._node_local_refusal(pid, owner.uid)
        )

    def _node_local_refusal(self, pid: int, uid: int) -> str | None:
        """Why the tree's node-local files cannot travel with it (over node_local_limit), or
        None: said at once, before CRIU freezes anything (and checked again as they are read)."""
        try:
            found = nodelocal.find(pid, uid)
        except OSError as e:
            return f"cannot read the job's node-local files ({e})"
        return nodelocal.too_large(found, self.core.settings.node_local_limit)

    def dump_settled(self, checkpoint_id: str) -> None:
        """The tree a dump stopped was killed (or resumed): nothing is left to undo. Its entry
        stays while a record of the dump waits for the database (`settle_pending`)."""
        with self._unrecorded_lock:
            deferred = checkpoint_id in self._unrecorded
        if deferred:
            entry = self.core.journal.entry(checkpoint_id)
            if entry is not None:
                self._settle_or_defer(entry)
            else:
                with self._unrecorded_lock:
                    self._unrecorded.pop(checkpoint_id, None)
            return
        self.core.journal.end(checkpoint_id)

    def settle_pending(self) -> None:
        """Write what the database refused of settled dumps (a periodic task of the daemon)."""
        with self._unrecorded_lock:
            waiting = list(self._unrecorded.items())
        for _, entry in waiting:
            if entry is not None:  # None: its dump is still under way and settles it itself
                self._settle_or_defer(entry)

    def unsettled(self) -> list[str]:
        """Dumps whose record still waits for the database (the daemon is not ready)."""
        with self._unrecorded_lock:
            return sorted(self._unrecorded)

    def _defer(self, checkpoint_id: str) -> None:
        with self._unrecorded_lock:
            self._unrecorded.setdefault(checkpoint_id, None)

    def _settle_or_defer(self, entry: InFlightDump) -> None:
        """`_settle` the entry; what the database refuses is retried by `settle_pending` (the
        tree is killed or resumed before anything is written, so it never waits frozen)."""
        try:
            self._settle(entry)
        except JobDatabaseError as e:
            with self._unrecorded_lock:
                new = self._unrecorded.get(entry.checkpoint) is None
                self._unrecorded[entry.checkpoint] = entry
            if new:
                log.warning(
                    "job %s: the dump of checkpoint %s is settled (its tree not left "
                    "stopped) but cannot be recorded yet; retried every second: %s",
                    entry.job,
                    entry.checkpoint,
                    e,
                )
            return
        with self._unrecorded_lock:
            was = entry.checkpoint in self._unrecorded
            self._unrecorded.pop(entry.checkpoint, None)
        if was:
            log.info(
                "job %s: the dump of checkpoint %s is recorded now", entry.job, entry.checkpoint
            )

    def _undo(self, entry: InFlightDump) -> None:
        """A dump raised: what it left (staging, a stopped tree) goes, unless it published."""
        current = self.core.journal.entry(entry.checkpoint) or entry
        if not current.published:
            try:
                self.core.store.publisher.discard(entry.checkpoint)
            except StasisError as e:
                log.warning("cannot remove the staging of checkpoint %s: %s", entry.checkpoint, e)
        self._settle_or_defer(current)

    def _between_calls(
        self,
        entry: InFlightDump,
        info: CheckpointInfo,
        compress: CompressionRequest,
        what: str,
        progress: Progress | None,
        notes: list[str],
        data_key: DataKey | None,
        freeze_cgroup: str | None,
    ) -> tuple[tuple[Manifest, DumpResult, bool], float]:
        """`_checkpoint_tree` at a moment no unix stream connection crosses the tree's edge, if
        one comes within EDGE_SETTLE_S: a job that calls a node's service now and then (a munge
        credential, a name-service lookup) is dumped between its calls, not failed for being
        caught in one ("Can't dump half of stream unix connection"), as a cut's freeze does
        (partfreeze.py). A connection that lasts fails the dump, explained. A frozen part is
        dumped as it is: partfreeze froze it between calls. Also returns how long the tries
        before the one that succeeded held the tree frozen."""
        deadline = time.monotonic() + EDGE_SETTLE_S
        frozen = freeze_cgroup is not None
        caught = 0
        held_s = 0.0
        while True:
            tried: list[str] = []  # each try says its own (not staged ...) once
            try:
                done = self._checkpoint_tree(
                    entry,
                    info,
                    compress,
                    what,
                    progress,
                    tried,
                    data_key,
                    freeze_cgroup,
                    gap_deadline=None if frozen else deadline,
                )
            except _CaughtMidCall as e:
                # One more try whatever the time (a dump longer than the wait gets one too),
                # more while the wait lasts.
                if frozen or caught + 1 >= _MAX_TRIES or (caught and time.monotonic() > deadline):
                    raise
                caught += 1
                held_s += e.held_s
                log.info("%s: dumped again once no connection crosses its edge: %s", what, e)
                deadline = max(deadline, time.monotonic() + 0.5)
                continue
            notes.extend(tried)
            if caught:
                notes.append(
                    f"dumped at try {caught + 1}: the dump before caught it mid-connection to a "
                    "process outside it (it ran on meanwhile)"
                )
            return done, held_s

    @staticmethod
    def _wait_for_a_gap(pid: int, deadline: float) -> None:
        """Until no unix stream connection crosses the edge of the tree under `pid`, or the
        `deadline` (time.monotonic()) passed: CRIU's dump is started right after."""
        while time.monotonic() < deadline:
            try:
                if not unixpeers.crosses_edge(pid):
                    return
            except Exception as e:  # a shortcut only: CRIU's dump says what it finds
                log.warning("pid %s: its unix connections cannot be looked at: %s", pid, e)
                return
            # No fixed period: a job calling out on one of its own is not met in step with it.
            time.sleep(random.uniform(0.005, 0.03))

    def _checkpoint_tree(
        self,
        entry: InFlightDump,
        info: CheckpointInfo,
        compress: CompressionRequest,
        what: str,
        progress: Progress | None,
        notes: list[str],
        data_key: DataKey | None,
        freeze_cgroup: str | None = None,
        gap_deadline: float | None = None,
    ) -> tuple[Manifest, DumpResult, bool]:
        """The dump that the journal's `entry` stands for: its tree, left running or not.
        `gap_deadline`: CRIU starts once no unix connection crosses the tree's edge, or then."""
        pid, leave_running = entry.pid, entry.leave_running
        asked = compress
        criu = self.criu
        expected = proctree.resident_bytes(pid)
        # Leave-running dumps may go to node memory first, so the job is frozen only that long
        # whatever the disk is doing; a dump that stops the job goes straight to the store (one
        # copy, not two: the job is down until the images are durable anyway).
        fast = None
        if leave_running:
            fast, behind, unstaged = staging.choose(
                self.core.settings.stage_dir, self.core.settings.state_dir, info.id, expected
            )
            if unstaged:
                notes.append(
                    f"not staged in memory ({unstaged}): the job stayed frozen while "
                    "its images went to the store"
                    + (f", which waited on the disk ({behind})" if behind else "")
                )
            elif behind:
                log.info("checkpoint %s staged in memory: %s", info.id, behind)
        target = fast or self.core.store.publisher.staging_dir(info.id)
        # Until the checkpoint is published the tree stays stopped, not killed: a failed publish
        # (full disk, store down) resumes the job as if nothing happened.
        # The tree's open files as its images record them: a dump that stops the job reads
        # them once CRIU is done (the tree is left stopped until published); a leave-running one
        # at CRIU's post-dump, while CRIU still holds it frozen. Not every dump through the
        # notification: it makes CRIU wait on this daemon (one stopped mid-dump would hold the
        # job frozen with it).
        opened = nodefacts.OpenFilesAtDump(pid)
        # Its node-local files go into the images at the same point (engine/nodelocal.py).
        # And a /tmp bound from a node's directory (a Slurm job container's), whole
        # (engine/boundtmp.py).
        carried = boundtmp.AtDumpWithTmp(
            pid,
            info.uid,
            target,
            self.core.settings.node_local_limit,
            info.gid,
            owner_groups(info.uid, info.gid),
        )
        # What the images record is the frozen tree's: its credentials are checked again there
        # (a setuid program exec'd since the check above), at CRIU's post-dump for a dump that
        # leaves the job running (a refusal aborts the dump), once CRIU left it stopped for one
        # that stops it.
        at_post_dump = _CredentialsAtPostDump(pid, info, opened, carried)
        options = DumpOptions(
            leave_running=leave_running,
            leave_stopped=not leave_running,
            criu_started=lambda criu_pid: self.core.journal.note_criu(
                info.id, criu_pid, proctree.start_time(criu_pid)
            ),
            notify=at_post_dump if leave_running else None,
            job_netns=info.job_net is not None,
            freeze_cgroup=freeze_cgroup,
        )
        watcher = DirWatcher(target, expected, progress) if progress else None
        # A dump that stops the job has it down until published: its images are hashed (and
        # written back to disk, or compressed) while CRIU writes them. A leave-running dump does
        # all that after the job resumed instead: on these 2 CPUs the hashing slowed CRIU's
        # frozen part by ~25%.
        tail = (
            self.core.store.publisher.follow(info.id, compress, data_key)
            if not leave_running
            else None
        )
        faults.point("dump.before-criu")
        if gap_deadline is not None:
            # As late as can be: what came before (staging, the store) takes longer than a call.
            self._wait_for_a_gap(pid, gap_deadline)
        criu_started = time.monotonic()
        try:
            result = criu.dump(pid, target, options, f"dump-{info.id}.log")
        except StasisError as e:
            held_s = time.monotonic() - criu_started  # before the looks below: it runs again
            if tail:
                tail.finish()  # before its files go: it may be creating one
            self._discard(info.id, fast)
            refused = at_post_dump.refused or carried.refused
            if refused:
                raise CheckpointError(
                    f"checkpoint of {what} refused, job still running: " f"{refused}"
                ) from e
            # CRIU names no process when one end of a connection is outside the job: we can.
            why = obstacles.explain(pid, viewer=info.uid)
            message = f"checkpoint of {what} failed, job still running: " + (
                f"{why} (CRIU: {e})" if why else str(e)
            )
            if any(words in str(e) for words in _MID_CALL):
                raise _CaughtMidCall(message, held_s) from e
            raise CheckpointError(message) from e
        finally:
            if watcher:
                watcher.stop()
            hashed = tail.finish() if tail else None
        faults.point("dump.after-criu")  # a stop-dump's tree stands stopped here
        if tail is not None and tail.compression is not None:
            compress = tail.compression  # what `auto` settled on while following
        # What CRIU's lock holds of the job's TCP connections until its checkpoint is restored.
        rules = [] if leave_running else netlock.rules_from_log(result.log_path)
        if not leave_running:
            # Stopped as CRIU left it: as its images say.
            refused = beyond_owner(pid, info) or (None if carried.collect() else carried.refused)
            if refused:
                self._discard(info.id, fast)
                self._resume(pid, rules, what)
                raise CheckpointError(
                    f"checkpoint of {what} refused, job still running: " f"{refused}"
                )
            opened("post-dump", pid)  # the tree stands stopped as CRIU left it
        info = self._with_facts(info, criu, opened.files)
        if result.external_files:
            # Its restore hands these files over under CRIU's keys (engine/privatetmp.py).
            info = info.model_copy(
                update={
                    "extra": {**info.extra, privatetmp.EXTERNAL_FILES_KEY: result.external_files}
                }
            )
        if carried.packed.paths:
            # Signed with the manifest: a restore knows what it recreates before it fetches.
            info = info.model_copy(
                update={
                    "extra": {**info.extra, nodelocal.MANIFEST_KEY: carried.packed.manifest_entry()}
                }
            )
        try:
            manifest = self.core.store.publisher.publish(
                info, compress, source=fast, hashed=hashed, data_key=data_key
            )
        except StasisError as e:
            self._discard(info.id, fast)
            if not leave_running:
                self._resume(pid, rules, what)
            raise CheckpointError(f"checkpoint of {what} failed, job still running: {e}") from e
        # Before anything else is recorded: from here on a stop asked is carried out, whatever
        # fails (recover_dumps, settle_pending).
        self.core.journal.mark_published(info.id)
        faults.point("dump.after-publish")
        try:
            self.core.netlocks.hold(info.id, info.job, rules)
        except JobDatabaseError as e:
            # The rules are in the firewall; the record that lifts them later is written once
            # the database takes it (from CRIU's log, kept with the journal entry).
            log.warning("checkpoint %s: its network lock cannot be recorded yet: %s", info.id, e)
            self._defer(info.id)
        if asked == "auto" and manifest.compression == "none":
            why = (
                "it is under 1 MiB"
                if manifest.size_bytes < (1 << 20)
                else "a sample of its memory did not shrink to half"
            )
            notes.append(f"--compress auto stored the checkpoint uncompressed: {why}")
        return manifest, result, fast is not None

    def _with_facts(
        self, info: CheckpointInfo, criu: CRIU, files: list[wire.OpenFile] | None
    ) -> CheckpointInfo:
        """`info` with what a restore of it depends on (compared before CRIU restores it)."""
        here = nodefacts.node(self.criu_version(criu))
        facts = nodefacts.record(here, info.user, info.uid, files)
        return info.model_copy(update={"restore_facts": RecordedFacts.model_validate(facts)})

    def _resume(self, pid: int, rules: list[netlock.LockRule], what: str) -> None:
        """Let a tree a dump left stopped run on, its TCP connections too (CRIU left them
        locked and in repair mode: the job would run with every connection dead)."""
        for problem in netlock.reopen_connections(pid, rules):
            log.warning("%s: %s", what, problem)
        proctree.signal_tree(pid, signal.SIGCONT)

    def recover_dumps(self) -> None:
        """Undo what dumps that a killed daemon never finished left (called at start, before
        any dump): their staging goes at once, and their trees, which CRIU may have left
        stopped, run again. A CRIU of theirs that still runs is waited for first, in the
        background, with the tree held against new dumps: resumed under it, the tree would
        be stopped again when it finished."""
        for entry in self.core.journal.leftovers():
            try:
                self.core.store.publisher.discard(entry.checkpoint)
            except StasisError as e:
                log.warning("cannot remove the staging of checkpoint %s: %s", entry.checkpoint, e)
            log.warning(
                "the dump of job %s (checkpoint %s) never finished: the daemon stopped "
                "during it; its staging is removed",
                entry.job,
                entry.checkpoint,
            )
            criu = entry.criu_pid
            if criu is None or not proctree.alive(criu, entry.criu_start):
                self._settle_or_defer(entry)
                continue
            key = f"pid {entry.pid}"
            with self._busy_lock:
                self._busy[key] = (
                    "being resumed: a daemon that stopped during its dump left "
                    "it to CRIU; wait for it"
                )
            threading.Thread(
                target=self._settle_after_criu, args=(entry, criu, key), daemon=True
            ).start()

    def _settle_after_criu(self, entry: InFlightDump, criu: int, key: str) -> None:
        try:
            log.warning(
                "job %s: waiting for CRIU (pid %d), still dumping it for a daemon that "
                "stopped, before resuming it",
                entry.job,
                criu,
            )
            while proctree.alive(criu, entry.criu_start):
                time.sleep(0.1)
            # It may have written more before it found its directory gone.
            if not entry.published:
                self.core.store.publisher.discard(entry.checkpoint)
            self._settle_or_defer(entry)
        except Exception:  # a thread of its own: say so rather than die silently
            log.exception("cannot resume job %s after its interrupted dump", entry.job)
        finally:
            with self._busy_lock:
                self._busy.pop(key, None)

    def _settle(self, entry: InFlightDump) -> None:
        """Finish or undo the dump `entry` records, now that no CRIU holds its tree: first the
        tree (killed if its checkpoint was published with a stop asked, else resumed), then the
        records; JobDatabaseError if the database refuses them (the entry stays)."""
        rules = (
            []
            if entry.leave_running
            else netlock.rules_from_log(
                self.core.settings.layout.criu_logs / f"dump-{entry.checkpoint}.log"
            )
        )
        published = not entry.leave_running and (
            entry.published or self._published(entry.checkpoint)
        )
        alive = proctree.alive(entry.pid, entry.pid_start)
        ours = _is_job_id(entry.job)
        if alive and published:
            # The checkpoint made it: do the rest of what was asked (the job stops here), so
            # the job and its checkpoint never run side by side unasked. A Slurm job's too:
            # its integration then requeues it (stasis/slurm/registrations.py `recover`).
            _kill(entry.pid)
            log.warning(
                "job %s: its checkpoint %s was published before its dump was settled; "
                "the job is stopped now, as asked",
                entry.job,
                entry.checkpoint,
            )
        elif alive and proctree.stopped(entry.pid):
            self._resume(entry.pid, rules, f"job {entry.job}")
            log.warning(
                "job %s: resumed; a daemon that stopped during its dump had left it " "stopped",
                entry.job,
            )
        if published:
            self.core.netlocks.hold(entry.checkpoint, entry.job, rules)
            row = self.core.db.get(entry.job) if ours else None
            if row is not None and row.pid == entry.pid and row.state != "checkpointed":
                self.core.db.set(row.id, state="checkpointed")
        elif not alive:
            netlock.remove(rules)  # nothing left to protect
        self.core.journal.end(entry.checkpoint)

    def _published(self, checkpoint_id: str) -> bool:
        try:
            self.core.store.catalog.get(checkpoint_id)
        except StasisError:
            return False
        return True

    def _discard(self, checkpoint_id: str, fast: Path | None) -> None:
        self.core.store.publisher.discard(checkpoint_id)
        if fast is not None:
            shutil.rmtree(fast, ignore_errors=True)


def owner_groups(uid: int, gid: int) -> list[int]:
    """The groups a job's owner has: their primary `gid` and what the system lists for them."""
    try:
        return [gid, *account(uid).groups]
    except UsageError:  # no such user here: only the job's own gid
        return [gid]


def beyond_owner(pid: int, info: CheckpointInfo | JobRow) -> str | None:
    """Why the tree under `pid` must not be checkpointed for `info`'s owner (one line), or None:
    a thread holds credentials beyond theirs (engine/credentials.py). Root's trees are exempt;
    a tree whose credentials cannot be read is refused."""
    if info.uid == 0:
        return None
    try:
        found = credentials.tree_excess(pid, info.uid, owner_groups(info.uid, info.gid))
    except (OSError, ValueError) as e:
        return f"cannot read the credentials of the job's processes ({e})"
    return credentials.refusal(found, info.user, info.uid) if found else None


class _CredentialsAtPostDump:
    """A leave-running dump's notify handler: at CRIU's post-dump (the tree still frozen, as
    its images record it) refuses a tree with credentials beyond its owner's (False aborts the
    dump; `refused` says why), else lists its open files (nodefacts.OpenFilesAtDump) and
    carries its node-local files into the images (False, and `carried.refused`, when they
    cannot go)."""

    def __init__(
        self,
        pid: int,
        info: CheckpointInfo,
        opened: nodefacts.OpenFilesAtDump,
        carried: nodelocal.AtDump | None = None,
    ) -> None:
        self.pid = pid
        self.info = info
        self.opened = opened
        self.carried = carried
        self.refused: str | None = None

    def __call__(self, script: str, pid: int) -> bool:
        if script == "post-dump":
            try:
                self.refused = beyond_owner(self.pid, self.info)
            except Exception as e:  # noqa: BLE001 - an exception here would be CRIU's error
                self.refused = f"cannot read the credentials of the job's processes ({e})"
            if self.refused:
                return False
            if self.carried is not None:
                try:
                    if not self.carried.collect():
                        return False
                except Exception as e:  # noqa: BLE001 - an exception would be CRIU's error
                    self.carried.refused = f"its node-local files cannot be carried ({e})"
                    return False
        return self.opened(script, pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone already: what was wanted


def _is_job_id(text: str) -> bool:
    try:
        validate_job_id(text)
    except UsageError:
        return False
    return True
