"""Restoring a checkpoint as a new job: the checkpoint a request names (by label, the newest
complete one), its images verified before the restored tree runs, and the network lock its
restore lifts. How the images reach CRIU is one source the daemon asks for in one call
(stasis/daemon/imagesources.py: in place, streamed, served by range, or fetched, as the store's
reader chooses); CRIU never reads bytes that nobody checked where anyone but root could change
them. A checkpoint that recorded what its restore depends on is compared with this node first
(engine/nodefacts.py), before anything is fetched or CRIU runs.

In every mode the restored job is recorded (`restoring`) before its supervisor hears of it, and
its tree resumes only on the daemon's word at CRIU's post-restore (the supervisor's gate): a
daemon killed before that word leaves no tree (CRIU kills it), one killed after it leaves a tree
that its row and job directory name, which the next start adopts (`restored`): never an
untracked orphan that a retry would restore a second time.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import cast

from stasis import faults, wire
from stasis.daemon import jobnet, partcgroup
from stasis.daemon.activity import Activity, work_of
from stasis.daemon.core import Core
from stasis.daemon.db import JobDatabaseError, JobRow
from stasis.daemon.imagesources import ImageSources
from stasis.daemon.lazystore import LazyRestore
from stasis.daemon.models import RestoreRequest
from stasis.daemon.progress import Progress
from stasis.daemon.supervisor import Gate, Supervisors, create_log
from stasis.daemon.supervisorwire import (
    EXIT_FILE,
    MEMORY_FILE,
    PID_FILE,
    JobNetSpec,
    RestoreJob,
)
from stasis.daemon.users import Caller, account, owner_uid, user_name
from stasis.daemon.verifying import verified_only
from stasis.engine import (
    CRIU,
    Owner,
    find_criu,
    jobnetns,
    nodefacts,
    nodelocal,
    privatepts,
    privatetmp,
    proctree,
)
from stasis.errors import (
    CorruptCheckpointError,
    IncompatibleNodeError,
    NotFoundError,
    OwnerDeniedError,
    PermissionDeniedError,
    RestoreError,
    StasisError,
    UntrustedCheckpointError,
    UsageError,
)
from stasis.store import Manifest, validate_checkpoint_id, validate_label
from stasis.wire import RestoreAnswer

log = logging.getLogger("stasis.daemon")
_log = log  # where a restore's `log` (the job's log file) hides the name


class Restorer:
    def __init__(self, core: Core, supervisors: Supervisors, job_umask: int) -> None:
        self.core = core
        self.job_umask = job_umask
        self._supervisors = supervisors
        self._uffd: bool | None = None  # whether CRIU can restore lazily here (asked once)
        self._criu_version: str | None = None  # asked once, as for dumps
        # Lazy restores whose pages this process still serves: a graceful stop waits for them.
        self._serving: set[LazyRestore] = set()
        self._serving_lock = threading.Lock()
        self._sources = ImageSources(
            core.store,
            core.settings.layout.scratch,
            self._has_uffd,
            self._serve,
            page_delay_s=core.settings.test_page_delay_ms / 1000,
        )

    def restore(
        self,
        req: RestoreRequest,
        caller: Caller,
        progress: Progress | None = None,
        fence: Callable[[], None] | None = None,
    ) -> RestoreAnswer:
        """`fence`: called last at the gate, once the tree is restored and stopped, just before
        it resumes; should it raise (StasisError), the tree is killed, never resumed, and the
        restore fails with its error (a control plane's commit: stasis.controlplane.node)."""
        started = time.monotonic()
        if req.checkpoint:
            if req.verified:
                raise UsageError(
                    "--verified picks among a label's checkpoints; for a "
                    "checkpoint id, run `stasis verify CHECKPOINT` first"
                )
            if req.user is not None:
                raise UsageError("--user says whose label to restore; a checkpoint id needs none")
            candidates = [self.core.store.catalog.get(validate_checkpoint_id(req.checkpoint))]
        elif req.label:
            owner = owner_uid(caller, req.user)
            candidates = [
                m
                for m in self.core.store.catalog.list(validate_label(req.label), uid=owner)
                if caller.may_use_checkpoint(m.uid, m.user)
            ]
            if not candidates:
                self._only_untrusted(req.label, owner, caller)
                raise NotFoundError(self._no_label(req.label, owner, caller))
            if req.verified:
                candidates = verified_only(self.core.store, candidates, req.label)
        else:
            raise UsageError("name a checkpoint id or --label")
        for manifest in candidates:
            caller.require_checkpoint(manifest.uid, manifest.user, f"checkpoint {manifest.id}")
            if manifest.job_net is not None and not caller.is_root:
                raise PermissionDeniedError(
                    f"permission denied: checkpoint {manifest.id} is a part of a job that spans "
                    f"nodes (job network {manifest.job_net.vni}); only root, its coordinator, "
                    "restores it"
                )
        skipped: list[str] = []
        for manifest in candidates:
            try:
                answer = self._restore_one(manifest, progress, req.lazy, fence)
            except CorruptCheckpointError as e:
                # By label, an older complete checkpoint is better than none.
                skipped.append(f"{manifest.id}: {e}")
                if req.checkpoint:
                    raise
                continue
            answer["skipped"] = skipped
            answer["elapsed_s"] = round(time.monotonic() - started, 4)
            work_s = work_of(manifest.extra)
            self.core.work.started_from(answer["job"], manifest.id, work_s)
            self.core.activity.notify(
                Activity(
                    kind="restore",
                    checkpoint=manifest.id,
                    label=manifest.label,
                    job=answer["job"],
                    user=manifest.user,
                    size_bytes=manifest.size_bytes,
                    work_s=work_s,
                    duration_s=answer["duration_s"],
                    store=self.core.store.url,
                )
            )
            return answer
        raise RestoreError("no usable checkpoint with label " f"{req.label}: " + "; ".join(skipped))

    def _only_untrusted(self, label: str, owner: int, caller: Caller) -> None:
        """UntrustedCheckpointError when the label's only checkpoints are signed by keys this
        node does not trust (another node's, another site's): naming them and the settings
        that trust them beats "no checkpoint with label"."""
        keys = self.core.store.catalog.untrusted_signers(label, uid=owner)
        if not keys:
            return
        whose = "" if owner == caller.uid else f" of user {user_name(owner)}"
        which = f"key {keys[0]}" if len(keys) == 1 else f"keys {', '.join(keys)}"
        raise UntrustedCheckpointError(
            f"no checkpoint with label {label}{whose} that this node trusts: those in store "
            f"{self.core.store.url} are signed by {which}, which this node does not trust; if "
            "another node of your site made them, add its key to trusted_keys (or give both "
            "nodes one site_key) and restart the daemon"
        )

    def _no_label(self, label: str, owner: int, caller: Caller) -> str:
        whose = "" if owner == caller.uid else f" of user {user_name(owner)}"
        text = f"no checkpoint with label {label}{whose}"
        if caller.is_root and owner == caller.uid:
            # Root may restore anyone's: point at the owners that label has (nobody else may
            # learn which labels other users have).
            others = sorted({user_name(m.uid) for m in self.core.store.catalog.list(label)})
            if others:
                text += (
                    f"; {', '.join(others)} {'has' if len(others) == 1 else 'have'} "
                    f"checkpoints with that label: add --user {others[0]}"
                )
        return text

    def _restore_one(
        self,
        manifest: Manifest,
        progress: Progress | None,
        lazy: bool | None,
        fence: Callable[[], None] | None = None,
    ) -> RestoreAnswer:
        job_id = secrets.token_hex(6)
        with ExitStack() as pinned:
            self._pin(pinned, manifest, job_id)
            try:
                answer = self._restore_as(job_id, manifest, progress, lazy, fence)
            except BaseException:
                self._forget(job_id)
                raise
            if answer["lazy"]:
                # Its pages are read from the store until all its memory is back.
                held = pinned.pop_all()
                threading.Thread(
                    target=self._unpin_when_memory_back,
                    daemon=True,
                    name="stasis-pin",
                    args=(held, job_id, answer["pid"]),
                ).start()
        return answer

    def _pin(self, stack: ExitStack, manifest: Manifest, job_id: str) -> None:
        """Keep the checkpoint from retention and expiry (any node's) while it is restored."""
        why = f"restored as job {job_id} on {self.core.hostname}"
        try:
            stack.enter_context(self.core.store.catalog.pin(manifest.id, why))
        except NotFoundError as e:
            # Deleted since it was listed: by label, an older one is better than none.
            raise CorruptCheckpointError(
                f"checkpoint {manifest.id} is gone from the store " f"({e})"
            ) from e
        except StasisError as e:
            # A store this node may read but not write (read-only credentials): restoring
            # unpinned beats not restoring; retention elsewhere could then race it.
            _log.warning(
                "restoring checkpoint %s without a pin against retention: %s", manifest.id, e
            )

    def _unpin_when_memory_back(self, pinned: ExitStack, job_id: str, pid: int) -> None:
        job_dir = self.core.settings.layout.job_dir(job_id)
        with pinned:
            while (
                not (job_dir / MEMORY_FILE).exists()
                and not (job_dir / EXIT_FILE).exists()
                and proctree.alive(pid, None)
            ):
                time.sleep(1.0)

    def _restore_as(
        self,
        job_id: str,
        manifest: Manifest,
        progress: Progress | None,
        lazy: bool | None,
        fence: Callable[[], None] | None = None,
    ) -> RestoreAnswer:
        settings = self.core.settings
        lazy = settings.lazy_restore if lazy is None else lazy
        job_net = self._job_net(manifest, job_id)
        if job_net is not None:
            lazy = False  # its part is frozen whole, and lazy-pages would be in its cgroup
        # The one way its images reach CRIU (imagesources.py), chosen, nothing fetched yet;
        # images only xxh3 checks (an old stasis's, in the clear) are refused here.
        source = self._sources.source(manifest, lazy)
        # Before anything is fetched or CRIU runs: a node that cannot restore it says why.
        expect = self._check_node(manifest, files=not source.in_place)
        acct = account(manifest.uid)
        logs = settings.layout.logs
        log = manifest.log_path or str(logs / f"{job_id}.log")
        if Path(log).parent == logs and not Path(log).exists():
            # Restored on another node: our logs directory is not the user's to create files in.
            create_log(log, acct)
        spec = RestoreJob(
            mode="restore",
            uid=acct.uid,
            gid=acct.gid,
            groups=acct.groups,
            log=log,
            image_log=manifest.log_path or log,
            criu=find_criu(settings.criu),
            criu_log_dir=str(settings.layout.criu_logs),
            criu_log_name=f"restore-{job_id}.log",
            umask=self.job_umask,  # for a log the supervisor creates as the user
            # Compared again there, files too.
            expect=expect,
            checkpoint=manifest.id,
            criu_version=self.criu_version(),
        )
        private_tmp = privatetmp.recorded(manifest.extra)
        if private_tmp:
            spec["private_tmp"] = True  # the images hold its own mounts (engine/privatetmp.py)
            spec["external_files"] = privatetmp.external_files(manifest.extra)
        if privatepts.recorded(manifest.extra):
            spec["own_pts"] = True
        if job_net is not None:
            spec["job_net"] = job_net
        job = JobRow.before_start(
            job_id,
            "restoring",
            label=manifest.label,
            command=manifest.command,
            cwd=manifest.cwd,
            log=log,
            owner=(manifest.user, manifest.uid, manifest.gid),
            checkpoint=manifest.id,
            private_tmp=private_tmp,
        )

        def record(row: JobRow) -> None:
            # Before the supervisor has the spec: nothing restored yet, nothing to undo.
            self.core.db.add(row)
            faults.point(f"restore.{source.mode}.recorded")

        # CRIU reads the store itself only where nobody but root can change it; every other
        # way hands CRIU only bytes this process read and checked (BLAKE3 or AES-GCM against
        # the signed manifest), or a private copy of them. Whatever the way, the tree resumes
        # only on the gate's word: its check passed, then the fence.
        with source:
            manifest = source.manifest
            gate = Gate(
                _then(source.check, fence),
                cancel=source.cancel,
                point=f"restore.{source.mode}.before-resume",
            )
            started = self._supervisors.restore(
                job_id, spec, source.images, job, record, gate, progress, manifest.size_bytes
            )
            source.started(started, refused=gate.error is not None)
        notes = list(source.notes)
        mode = source.mode
        if gate.error is not None:
            raise gate.error  # refused at the gate (its check, or the fence): killed unresumed
        answer = started.answer
        if "error" in answer:
            if answer["error"]["type"] == IncompatibleNodeError.__name__:
                raise IncompatibleNodeError(answer["error"]["message"])
            kind = (
                OwnerDeniedError
                if answer["error"]["type"] == OwnerDeniedError.__name__
                else RestoreError
            )
            raise kind(
                f"restore of checkpoint {manifest.id} failed: " f"{answer['error']['message']}"
            )
        pid = started.pid
        faults.point(f"restore.{mode}.after-resume")
        try:
            self.core.db.set(job_id, state="restored", pid=pid, pid_start=proctree.start_time(pid))
        except JobDatabaseError as e:
            # Recorded `restoring` with its supervisor and directory: the daemon's poll makes it
            # `restored` (from pid.json) once the database takes it.
            _log.warning("job %s: restored, but not yet recorded as running: %s", job_id, e)
            notes.append(
                "the restored job is recorded as restoring until the daemon's "
                "database can be written"
            )
        try:
            self._restored(manifest)
        except JobDatabaseError as e:
            _log.warning("checkpoint %s: its network lock stays recorded: %s", manifest.id, e)
        notes.extend(answer["notes"])  # what differs from the dumping node, safely
        if answer["fallback"]:
            # The supervisor's CRIU could not restore lazily and restored in full.
            notes.append(f"lazy restore failed, restored in full: {answer['fallback']}")
        return RestoreAnswer(
            job=job_id,
            pid=pid,
            checkpoint=manifest.id,
            skipped=[],
            lazy=answer["lazy"],
            notes=notes,
            duration_s=round(answer["duration_s"], 4),
            elapsed_s=0.0,
        )

    def _job_net(self, manifest: Manifest, job_id: str) -> JobNetSpec | None:
        """For a part of a job that spans nodes: its job network's namespace on this node, which
        must have been made with the part's address, and a cgroup of its own (jobnet.py);
        IncompatibleNodeError, one line, when it was not. Its network, held still should a
        part stopped here have left it so, is released: CRIU locks it itself while it
        restores."""
        recorded = manifest.job_net
        if recorded is None:
            return None
        what = f"cannot restore checkpoint {manifest.id} on this node"
        here = jobnet.part_address(recorded.vni)
        if here is None:
            raise IncompatibleNodeError(
                f"{what}: job network {recorded.vni} is not set up on this node: make its part "
                f"here with address {recorded.address} first (jobnet.make_part), then restore"
            )
        if here != recorded.address:
            raise IncompatibleNodeError(
                f"{what}: its part of job network {recorded.vni} has address {here} here, the "
                f"checkpoint's is {recorded.address}; make the part again with that address"
            )
        _no_orphans(manifest.id, recorded.vni)
        try:
            spec = jobnet.part_spec(recorded.vni, job_id, what)
        except UsageError as e:
            raise IncompatibleNodeError(str(e)) from e
        jobnet.release(recorded.vni)
        return spec

    def _forget(self, job_id: str) -> None:
        """A restore that failed was never a job: its `restoring` row goes (or, the database
        refusing, the daemon's poll removes it: its supervisor is gone and it has no tree)."""
        # A part's cgroup, if one was made (an empty one only: a tree keeps it).
        partcgroup.remove(partcgroup.path_for(job_id), wait_s=0)
        if (self.core.settings.layout.job_dir(job_id) / PID_FILE).exists():
            return  # it has a tree after all: the poll follows it
        try:
            self.core.db.remove_unstarted(job_id)
        except JobDatabaseError as e:
            log.warning("job %s: its failed restore's row stays for now: %s", job_id, e)

    def _serve(self, served: LazyRestore) -> None:
        with self._serving_lock:
            self._serving = {s for s in self._serving if not s.done.is_set()} | {served}

    def drain(self, timeout_s: float) -> int:
        """Wait, at most `timeout_s`, for the lazy restores this daemon serves pages to to have
        all their memory back: a daemon that stops takes its page server with it, and the
        job's supervisor then kills the job rather than let it read zeros. How many are still
        being served when the time is up (they are killed with the daemon)."""
        deadline = time.monotonic() + timeout_s
        with self._serving_lock:
            serving = list(self._serving)
        for served in serving:
            served.done.wait(max(0.0, deadline - time.monotonic()))
        return sum(not s.done.is_set() for s in serving)

    def _check_node(self, manifest: Manifest, files: bool) -> wire.RestoreFacts | None:
        """Refuse (IncompatibleNodeError) what differs from the node that dumped `manifest` in
        a way the restore cannot cope with. Its open files are compared here when `files`
        (the images are to be fetched: not for nothing), else by the supervisor, with the
        owner's rights, just before CRIU. The recorded facts, for the supervisor; None when
        there are none (checkpoints dumped before they were recorded restore unchecked)."""
        if manifest.restore_facts is None:
            return None
        expect = cast("wire.RestoreFacts", manifest.restore_facts.model_dump())
        facts = nodefacts.compare(expect, nodefacts.node(self.criu_version()), None)
        if files or nodefacts.refusal(manifest.id, facts) is not None:
            # With the files (a refusal names every difference), as the owner sees them.
            facts = self._report(manifest)["facts"]
        refused = nodefacts.refusal(manifest.id, facts)
        if refused is not None:
            raise IncompatibleNodeError(refused)
        return expect

    def criu_version(self) -> str:
        # Asked once, as for dumps: each ask starts a criu process.
        if self._criu_version is None:
            settings = self.core.settings
            self._criu_version = nodefacts.criu_version(
                CRIU(find_criu(settings.criu), settings.layout.criu_logs)
            )
        return self._criu_version

    def compare(self, checkpoint_id: str, caller: Caller) -> wire.CheckpointCheck:
        """`stasis check --checkpoint`: every fact the checkpoint recorded against this node,
        its files looked at with its owner's rights (as a restore reopens them)."""
        manifest = self.core.store.catalog.get(validate_checkpoint_id(checkpoint_id))
        caller.require_checkpoint(manifest.uid, manifest.user, f"checkpoint {manifest.id}")
        return self._report(manifest)

    def _report(self, manifest: Manifest) -> wire.CheckpointCheck:
        node = self.core.hostname
        if manifest.restore_facts is None:
            return wire.CheckpointCheck(
                checkpoint=manifest.id, node=node, recorded=False, restorable=True, facts=[]
            )
        expect = cast("wire.RestoreFacts", manifest.restore_facts.model_dump())
        try:
            acct = account(manifest.uid)
            owner = Owner(acct.uid, acct.gid, acct.groups)
        except UsageError:
            owner = Owner(manifest.uid, manifest.gid)  # nobody's here: the user fact says so
        files = nodefacts.stat_files_as(owner, [f["path"] for f in expect["files"] or ()])
        facts = nodefacts.compare(
            expect,
            nodefacts.node(self.criu_version()),
            files,
            skip=[manifest.log_path] if manifest.log_path else [],
            travels=nodelocal.travelling(manifest.extra),
        )
        return wire.CheckpointCheck(
            checkpoint=manifest.id,
            node=node,
            recorded=True,
            facts=facts,
            restorable=all(f["verdict"] != "refuses" for f in facts),
        )

    def _has_uffd(self) -> bool:
        if self._uffd is None:
            criu = CRIU(find_criu(self.core.settings.criu), self.core.settings.layout.criu_logs)
            try:
                self._uffd = criu.features().lazy_pages
            except StasisError:
                self._uffd = False
        return self._uffd

    def _restored(self, manifest: Manifest) -> None:
        """CRIU lifted the checkpoint's network lock if this node holds it; a node that dumped
        it elsewhere learns from the store that it may lift its own."""
        self.core.netlocks.lifted_by_restore(manifest.id)
        if manifest.host != self.core.hostname:
            try:
                self.core.store.catalog.mark_restored(manifest.id, self.core.hostname)
            except StasisError as e:
                log.warning(
                    "cannot note in the store that checkpoint %s was restored: %s", manifest.id, e
                )


def _then(check: Callable[[], None], fence: Callable[[], None] | None) -> Callable[[], None]:
    """A gate's check, then the fence, last: once the fence said yes nothing else refuses."""
    if fence is None:
        return check

    def both() -> None:
        check()
        fence()

    return both


def _no_orphans(checkpoint: str, vni: int) -> None:
    """Refuse, in one line, to restore a part into job network `vni`'s namespace on this node
    while it holds TCP sockets no process owns (jobnetns.netns_orphans: what a part killed here
    left, on which CRIU's bind of a restored listener fails halfway). Sockets of live parts (a
    node's parts of one job share its namespace) are no reason. Made again (jobnet.make_part, as
    a requeue's prolog does), the namespace holds none."""
    path = jobnet.netns_path(vni)
    try:
        left = jobnetns.netns_orphans(path)
    except OSError as e:
        raise IncompatibleNodeError(f"checkpoint {checkpoint} not restored: {e}") from e
    if not left:
        return
    _log.warning(
        "job network %s here holds %d orphan TCP sockets: %s",
        vni,
        len(left),
        ", ".join(f"{s} to {s.remote}" for s in left),
    )
    raise IncompatibleNodeError(
        f"checkpoint {checkpoint} not restored: job network {vni} on this node still holds "
        f"connections of a part that ran here ({len(left)} sockets, e.g. {left[0]}); make its "
        "part of the network again (jobnet.make_part; its job's prolog does on a requeue) and "
        "restore then"
    )
