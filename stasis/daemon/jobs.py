"""Jobs: start them, checkpoint them, restore them, kill them, follow them until they end.

Blocking code (CRIU runs, file copies); the API calls it from worker threads. Every method takes
the Caller and checks that the job or checkpoint is theirs before touching it.

JobManager is what the API, the server and integrations call; the work is done by

    supervisor    a job's supervisor process: the spare, its spec and answer, the restore gate
    progress      how far a dump or restore has come
    tracking      whose a job is, whether it still runs, how it ended
    dumping       checkpoints of a tree, and what dumps a killed daemon left undone
    restoring     a checkpoint restored as a new job
    housekeeping  finished jobs' rows, CRIU's logs, corrupt checkpoints: pruned
    core          what dumping, restoring and housekeeping share (settings, store, database)
    readiness     whether the store answers (`readiness_problems`: can this daemon protect
                  its jobs now)
    rebuild       a corrupt database moved aside and rebuilt at the start (server.py)
"""

from __future__ import annotations

import logging
import os
import secrets
import signal

from stasis import faults
from stasis.config import Settings
from stasis.daemon import jobnet, partcgroup
from stasis.daemon.activity import (
    Activity,
    JobSource,
    JobWork,
    Listeners,
    ReportedJob,
    work_of,
)
from stasis.daemon.core import Core
from stasis.daemon.db import JobDatabaseError, JobDB, JobRow
from stasis.daemon.dumping import Dumper
from stasis.daemon.housekeeping import Housekeeping
from stasis.daemon.inflight import DumpJournal
from stasis.daemon.models import DumpRequest, RunRequest
from stasis.daemon.netlocks import NetLocks
from stasis.daemon.progress import Progress
from stasis.daemon.readiness import StoreProbe
from stasis.daemon.reaper import Reaper
from stasis.daemon.restoring import Restorer
from stasis.daemon.supervisor import Supervisors, create_log, find_init
from stasis.daemon.supervisorwire import RunSpec
from stasis.daemon.tracking import JobTracker, died_of
from stasis.daemon.users import Caller, job_account, job_environment, owner_uid
from stasis.daemon.verifying import Verifier
from stasis.engine import CRIU, kdat, privatetmp
from stasis.errors import (
    NotFoundError,
    PermissionDeniedError,
    StasisError,
    StoreError,
    UnreadableManifestError,
    UntrustedCheckpointError,
    UsageError,
    error_from_wire,
)
from stasis.store import (
    Manifest,
    Store,
    validate_checkpoint_id,
    validate_label,
)
from stasis.wire import (
    CheckpointCheck,
    DumpAnswer,
    DumpCheckAnswer,
    GcAnswer,
    Job,
    KillAnswer,
    Problem,
    RekeyAnswer,
    RunAnswer,
    VerifyVerdict,
)

log = logging.getLogger("stasis.daemon")


class JobManager:
    def __init__(self, settings: Settings, store: Store, db: JobDB, job_umask: int = 0o022) -> None:
        self.settings = settings
        self.job_umask = job_umask  # new jobs get it; the daemon's own files are private
        self.store = store
        self.db = db
        layout = settings.layout
        self.state_dir = layout.root
        self.logs_dir = layout.logs
        self.jobs_dir = layout.jobs
        self.criu_logs = layout.criu_logs
        self.scratch = layout.scratch
        self.reaper = Reaper()
        self.journal = DumpJournal(layout.dumps)
        self.netlocks = NetLocks(db, store, settings.netlock_timeout_s)
        self.activity = Listeners()  # integrations hear of checkpoints and restores here
        self._job_sources: dict[str, JobSource] = {}
        self.work = JobWork(db)
        core = Core(
            settings,
            store,
            db,
            self.netlocks,
            self.journal,
            settings.node,
            self.activity,
            self.work,
        )
        self._supervisors = Supervisors(layout, self.reaper)
        self._tracker = JobTracker(db, self._supervisors)
        # Checkpoints of a tree (`checkpoint_tree`, `dump_settled`): integrations call it.
        self.dumper = Dumper(core, self._tracker)
        # Restores (`restore`): the API and the control plane's node side call it.
        self.restorer = Restorer(core, self._supervisors, job_umask)
        self.verifier = Verifier(core, self.restorer.criu_version)
        self._housekeeping = Housekeeping(core)
        self._unadopted: str | None = None  # why jobs without a row could not be adopted
        self._store_probe = StoreProbe(store)
        # What the start found wrong and could not mend (a corrupt database moved aside...).
        self.startup_problems: list[Problem] = []

    def drain_lazy(self, timeout_s: float) -> int:
        """At a graceful stop: wait for lazily restored jobs to have their memory back
        (Restorer.drain); how many still are not."""
        return self.restorer.drain(timeout_s)

    def close(self) -> None:
        """Let the spare supervisor go (running jobs and their supervisors are not touched)."""
        self._supervisors.close()

    def prepare(self) -> None:
        """Create the state layout: users traverse to their logs, nothing else is theirs."""
        layout = self.settings.layout
        layout.root.mkdir(parents=True, exist_ok=True)
        os.chmod(layout.root, 0o711)
        layout.logs.mkdir(exist_ok=True)
        os.chmod(layout.logs, 0o711)
        for d in (layout.jobs, layout.criu_logs, layout.scratch):
            d.mkdir(exist_ok=True)
            os.chmod(d, 0o700)
        # Jobs that run without a row first: a dump the previous daemon left then settles
        # against their rows (recorded checkpointed, not exited).
        self.adopt_orphans()
        self.dumper.prepare()
        cache_problem = kdat.ensure_cache_dir()
        if cache_problem:
            log.warning("%s", cache_problem)
        if kdat.clear_stale_tmp():
            log.info(
                "removed a stale %s.tmp left by a killed CRIU: CRIU caches its kernel "
                "probes again",
                kdat.CACHE,
            )
        self._supervisors.warm()

    def adopt_orphans(self) -> None:
        """Record the jobs that run without a row (see tracking.adopt_orphans); while the
        database refuses, the daemon says it is not ready and tries again."""
        try:
            self._tracker.adopt_orphans(self.jobs_dir)
        except JobDatabaseError as e:
            self._unadopted = str(e)
            log.warning("cannot look for jobs that run without a record yet: %s", e)
        else:
            self._unadopted = None

    @property
    def criu(self) -> CRIU:
        return self.dumper.criu

    def criu_version(self, criu: CRIU) -> str:
        return self.dumper.criu_version(criu)

    # -- queries -------------------------------------------------------------------------------

    def get(self, job_id: str, caller: Caller) -> Job:
        self.poll()
        return self._frozen(self._tracker.row(job_id, caller).wire())

    def jobs(self, caller: Caller) -> list[Job]:
        self.poll()
        return [self._frozen(r.wire()) for r in self.db.all() if caller.may_act_on(r.uid)]

    def _frozen(self, job: Job) -> Job:
        job["frozen"] = self.dumper.parts.get(job["job"]) is not None
        return job

    def add_job_source(self, source: JobSource) -> None:
        """Jobs an integration runs beside the daemon's own: listed where the node reports,
        checkpointed through `source` when asked (the control plane's commands)."""
        self._job_sources[source.kind] = source

    def reported_jobs(self) -> list[ReportedJob]:
        return [j for source in self._job_sources.values() for j in source.jobs()]

    def job_source(self, kind: str) -> JobSource:
        if kind not in self._job_sources:
            raise NotFoundError(f"this node runs no {kind} jobs under stasis")
        return self._job_sources[kind]

    def job_sources(self) -> list[JobSource]:
        return list(self._job_sources.values())

    def checkpoints(
        self, label: str | None, caller: Caller, user: str | None = None
    ) -> list[Manifest]:
        """The caller's checkpoints (of `label`). A label is looked up among one owner's: the
        caller's, or whose `user` names (root only). Without either, root sees every owner's."""
        if label is not None:
            validate_label(label)
        if label is None and user is None and caller.is_root:
            return self.store.catalog.list()
        return [
            m
            for m in self.store.catalog.list(label, uid=owner_uid(caller, user))
            if caller.may_use_checkpoint(m.uid, m.user)
        ]

    def rekey(self, caller: Caller) -> RekeyAnswer:
        """Re-wrap every checkpoint's data key that an old key file wraps with the current one
        (root only: it rewrites every user's manifests)."""
        if not caller.is_root:
            raise PermissionDeniedError("permission denied: only root may rekey checkpoints")
        done = self.store.rekey()
        log.info(
            "rekeyed %d checkpoints (%d already on the current key, %d on a key this node "
            "has not got)",
            len(done.rekeyed),
            done.current,
            done.unknown_key,
        )
        return RekeyAnswer(rekeyed=done.rekeyed, current=done.current, unknown_key=done.unknown_key)

    def delete_checkpoint(self, checkpoint_id: str, caller: Caller) -> None:
        try:
            manifest = self.store.catalog.get(validate_checkpoint_id(checkpoint_id))
        except (UnreadableManifestError, UntrustedCheckpointError) as e:
            # Its owner cannot be told (garbage) or believed (unsigned, forged, another site's):
            # root alone may remove it.
            if not caller.is_root:
                raise PermissionDeniedError(
                    f"permission denied: the manifest of checkpoint {checkpoint_id} is "
                    "unreadable or untrusted, so nobody can tell whose it is; only root can "
                    "delete it"
                ) from e
            log.warning("root deletes checkpoint %s: %s", checkpoint_id, e)
        else:
            caller.require_checkpoint(manifest.uid, manifest.user, f"checkpoint {checkpoint_id}")
        self.store.catalog.delete(checkpoint_id)
        self.netlocks.release(checkpoint_id, "the checkpoint was deleted")

    def check_checkpoint(self, checkpoint_id: str, caller: Caller) -> CheckpointCheck:
        """`stasis check --checkpoint`: what its restore depends on, beside this node (the
        caller's own checkpoints; root's: anyone's)."""
        return self.restorer.compare(checkpoint_id, caller)

    def collect_garbage(self, caller: Caller, idle_s: float) -> GcAnswer:
        """`stasis checkpoints gc`: what dead dumps and nodes left in the store, and retention
        over every label. Root only: it judges every user's leftovers."""
        if not caller.is_root:
            raise PermissionDeniedError(
                "permission denied: only root may collect the garbage " "of the store"
            )
        report = self.store.catalog.gc(idle_s)
        expired = self.store.catalog.expire()
        log.info(
            "gc of %s: removed %d staging dir(s), %d partial checkpoint(s), %d upload(s), "
            "%d index entr(ies); expired %d checkpoint(s)",
            self.store.url,
            len(report.staging),
            len(report.partial),
            len(report.uploads),
            report.entries_removed,
            len(expired),
        )
        return GcAnswer(
            staging=report.staging,
            partial=report.partial,
            uploads=report.uploads,
            expired=expired,
            index_entries_removed=report.entries_removed,
            index_entries_added=report.entries_added,
        )

    # -- housekeeping --------------------------------------------------------------------------

    def sweep_store(self) -> None:
        self._housekeeping.sweep_store()

    def prune_history(self) -> None:
        self._housekeeping.prune_history()

    # -- run -----------------------------------------------------------------------------------

    def run(self, req: RunRequest, caller: Caller) -> RunAnswer:
        acct = job_account(caller, req.user)
        job_id = secrets.token_hex(6)
        label = validate_label(req.label) if req.label else job_id
        env = job_environment(acct, req.env)
        private_tmp = self.settings.private_tmp if req.private_tmp is None else req.private_tmp
        log = req.log or str(self.settings.layout.logs / f"{job_id}.log")
        if private_tmp:
            privatetmp.require_outside(req.cwd, log)
        if not req.log:
            create_log(log, acct)
        spec = RunSpec(
            mode="run",
            command=req.command,
            cwd=req.cwd,
            env=env,
            uid=acct.uid,
            gid=acct.gid,
            groups=acct.groups,
            log=log,
            init=find_init(self.settings.init),
            umask=self.job_umask,
        )
        if private_tmp:
            spec["private_tmp"] = self.settings.node_local_limit  # each tmpfs's size
        if req.job_net is not None:
            if not caller.is_root:
                raise PermissionDeniedError(
                    "permission denied: only root may run a job in a job network (it reaches "
                    "that job's other parts); its coordinator starts the parts"
                )
            spec["job_net"] = jobnet.part_spec(req.job_net, job_id, "cannot run the job")
        # Its record without a pid, in its directory before it starts: a daemon killed before
        # the row below is written adopts it at its next start (tracking.adopt_orphans).
        job = JobRow.before_start(
            job_id,
            "running",
            label=label,
            command=req.command,
            cwd=req.cwd,
            log=log,
            env=sorted(req.env),
            owner=(acct.name, acct.uid, acct.gid),
            private_tmp=private_tmp,
        )
        started = self._supervisors.run(job_id, spec, job)
        answer = started.answer
        if "error" in answer:
            if "job_net" in spec:
                partcgroup.remove(partcgroup.path_for(job_id))
            raise error_from_wire(answer["error"]["type"], answer["error"]["message"])
        pid = answer["pid"]
        faults.point("run.after-start")  # running, not yet recorded: adopted at the next start
        row = started.row(job)
        self.db.add(row)
        return RunAnswer(job=job_id, pid=pid, label=label)

    def relabel(self, job_id: str, label: str) -> None:
        """Give job `job_id` the label `label` (an integration's: a part of a Slurm job restored
        from a cut is that part again, stasis.slurm.parts)."""
        self.db.set(job_id, label=validate_label(label))

    def restarted(self, job: str, manifest: Manifest | None, user: str, reason: str) -> None:
        """An integration's workload `job` started again from `manifest` (None: from nothing):
        its work counts from the checkpoint's, and who listens hears of that restore."""
        if manifest is None:
            self.work.forget(job)
            return
        work_s = work_of(manifest.extra)
        self.work.started_from(job, manifest.id, work_s)
        self.activity.notify(
            Activity(
                kind="restore",
                checkpoint=manifest.id,
                label=manifest.label,
                job=job,
                user=user,
                size_bytes=manifest.size_bytes,
                work_s=work_s,
                duration_s=0.0,
                store=self.store.url,
                reason=reason,
            )
        )

    # -- dump and restore ----------------------------------------------------------------------

    def dump(
        self, job_id: str, req: DumpRequest, caller: Caller, progress: Progress | None = None
    ) -> DumpAnswer:
        return self.dumper.dump(job_id, req, caller, progress)

    def dump_check(self, job_id: str, caller: Caller) -> DumpCheckAnswer:
        return self.dumper.dump_check(job_id, caller)

    def settle_pending(self) -> None:
        """Record the dumps whose record the database refused, adopt the jobs the start could
        not (a periodic task)."""
        self.dumper.settle_pending()
        if self._unadopted is not None:
            self.adopt_orphans()

    def readiness_problems(self) -> list[Problem]:
        """Why this daemon cannot protect its jobs now (empty: it can): its database refuses
        reads or writes, a dump's record or an orphan's adoption waits for it, the store does
        not answer, its start rebuilt what it could not read. `stasis check` (the daemon's
        /check), the control plane's node report and the Kubernetes agent's taint show it."""
        problems = list(self.startup_problems)
        try:
            self.db.probe()
        except JobDatabaseError as e:
            problems.append(
                Problem(
                    what=f"not ready: {e}",
                    fix="free or repair the job database; the daemon retries",
                )
            )
        waiting = self.dumper.unsettled()
        if waiting:
            problems.append(
                Problem(
                    what=f"not ready: {len(waiting)} dump(s) settled but not recorded yet "
                    f"(checkpoint {waiting[0]}): the job database refuses writes",
                    fix="free the job database (see the daemon's log); the daemon retries",
                )
            )
        unadoptable = self._tracker.unadoptable
        if unadoptable:
            problems.append(
                Problem(
                    what=f"not ready: {len(unadoptable)} job(s) run without a record that can be "
                    f"rebuilt (job {unadoptable[0]}): they are not protected",
                    fix="see the daemon's log; stop them, or let them finish",
                )
            )
        if self._unadopted is not None:
            problems.append(
                Problem(
                    what="not ready: jobs that run without a record cannot be adopted yet: "
                    + self._unadopted,
                    fix="free the job database; the daemon retries",
                )
            )
        store_problem = self._store_probe.problem()
        if store_problem is not None:
            problems.append(
                Problem(
                    what=f"not ready: the checkpoint store {self.store.url} "
                    f"does not answer: {store_problem}",
                    fix="make the store reachable; checkpoints and restores " "fail until it is",
                )
            )
        return problems

    def verify(self, checkpoint_id: str, caller: Caller) -> VerifyVerdict:
        """`stasis verify`: the checkpoint restored in a sandbox, checked, removed; the verdict
        (also a failed one) recorded in the store (daemon/verifying.py)."""
        return self.verifier.verify(checkpoint_id, caller)

    # -- kill / follow -------------------------------------------------------------------------

    def signal_job(self, job_id: str, caller: Caller, sig: signal.Signals) -> JobRow | None:
        """Send `sig` to the caller's job `job_id`; its row, or None when it was not running.

        The signal goes to the job's init, stasis-init, which forwards it to every process of
        the job (a daemonized server too); SIGKILL ends the init and with it the whole PID
        namespace."""
        row = self._tracker.row(job_id, caller)
        if self.dumper.parts.get(row.id) is not None:
            # A part frozen for a cut across nodes would not act on it (nor die of SIGKILL):
            # the cut is abandoned.
            log.warning("job %s: thawed to be signalled; its freeze is abandoned", row.id)
            try:
                self.dumper.parts.thaw(row.id, stop=False)
            except UsageError:
                pass  # thawed meanwhile
        return row if self.send(row, sig) else None

    def send(self, row: JobRow, sig: signal.Signals) -> bool:
        return self._tracker.send(row, sig)

    def has_ended(self, row: JobRow) -> bool:
        return self._tracker.has_ended(row)

    def kill_answer(
        self,
        job_id: str,
        caller: Caller,
        asked: signal.Signals,
        sent: bool,
        killed: bool,
        timeout_s: float,
    ) -> KillAnswer:
        """How `stasis kill` went: `asked` was `sent` (not: the job was not running), then
        SIGKILL if `killed`. SIGKILL ended the job only if its init died of it: a job that ended
        on `asked` just as SIGKILL went out ended by `asked`."""
        self.poll()
        row = self._tracker.row(job_id, caller)
        ended_by = None
        if sent:
            if row.state in ("running", "restored"):
                raise StasisError(
                    f"job {job_id} is still running after SIGKILL: a process of it is stuck in "
                    f"the kernel (state D in /proc/{row.pid}/stat); try again later"
                )
            ended_by = "SIGKILL" if killed and died_of(row, signal.SIGKILL) else asked.name
        return KillAnswer(
            job=row.id,
            state=row.wire()["state"],
            ended_by=ended_by,
            exit_code=row.exit_code,
            signal=asked.name,
            timeout_s=timeout_s,
        )

    def poll(self) -> None:
        self._tracker.poll()


__all__ = ["JobManager", "Progress", "StoreError", "find_init"]
