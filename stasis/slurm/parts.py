"""This node's parts of Slurm jobs that span nodes, started by its daemon for the job's launch agent.

A protected job on several nodes (issue 31) must have every process on every node under a node
daemon, in the job's network, so that one cut can freeze and dump them all (stasis.slurm.cut):
not slurmstepd's children. Its MPI launcher (Open MPI's `mpirun`, MPICH's Hydra) starts its
daemons on the other nodes through a launch agent, `stasis-rsh HOST COMMAND...`
(stasis.slurm.rsh), which asks HOST's daemon over the remote listener to start COMMAND there.
This module is that daemon's side:

- `start`: the caller (munge's uid) must be the Slurm job's user or root; the job RUNNING with
  this node among its nodes and its network made here by the job prolog (`/run/stasis-jobnet/
  <job>`). The command runs as the job's user as Slurm knows it (never as root for a user's
  job, never as the caller's claims), with a login-like environment as ssh would give it, in
  the job's network namespace and a freezer cgroup of its own (`job_net`), labelled
  `slurm-<job>-part-<key>`: the part's key (8 hex digits, new at each start) names it in every
  other operation, and stays its name when a cut moves it to another node (its restore there
  is labelled the same), so that the agent finds it again.
- `output`: its output (stdout and stderr together, as the daemon logs it) from an offset, its
  state and exit status: what the agent relays, polling.
- `signal`: TERM, HUP, INT or KILL to it (the agent was signalled, as ssh's remote end would be).
- A cut's, root's alone (its coordinator, stasis.slurm.cut through stasis.slurm.partclient):
  `listing` (the job's parts here), `freeze`, `dump` (frozen, under the cut's label), `thaw`
  (or stop), `delete` (a checkpoint of an abandoned cut); and a restore's on requeue:
  `net` (the job's network here held still, or let go: no restored part hears a peer that is
  not back yet), `restore` (a part's checkpoint of a cut, labelled with its key again).

Each acts only on a part of that Slurm job, for its owner or root. A part whose Slurm job no
longer runs on this node (its agent killed without passing a signal on, the job cancelled or
ended) is killed by `sweep` (the integration's task, every SWEEP_S): none outlives its job.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import secrets
import signal
from pathlib import Path

from stasis import wire
from stasis.daemon import jobnet, partcgroup
from stasis.daemon.jobs import JobManager
from stasis.daemon.models import (
    DumpRequest,
    FreezeRequest,
    RestoreRequest,
    RunRequest,
    ThawRequest,
)
from stasis.daemon.users import Caller
from stasis.engine import jobnetns
from stasis.errors import NotFoundError, PermissionDeniedError, SlurmError, UsageError
from stasis.slurm import jobnetnode, scontrol
from stasis.slurm.models import (
    PartDumpRequest,
    PartFreezeRequest,
    PartNetRequest,
    PartOutputRequest,
    PartRestoreRequest,
    PartSignalRequest,
    PartStartRequest,
    PartThawRequest,
)
from stasis.slurm.partnames import PART_KEY_PATTERN, part_label, part_of
from stasis.store import validate_checkpoint_id

_ROOT = Caller(pid=0, uid=0, gid=0)
SWEEP_S = 10.0
_LIVE = ("running", "restored", "restoring")
MAX_CHUNK_BYTES = 256 * 1024  # of output per answer
log = logging.getLogger("stasis.daemon")
_SIGNALS = {
    "TERM": signal.SIGTERM,
    "HUP": signal.SIGHUP,
    "INT": signal.SIGINT,
    "KILL": signal.SIGKILL,
}


def job_vni(slurm_job: str, node: str) -> int:
    """The VXLAN id of the job's network on this node, as its prolog recorded it."""
    try:
        text = (jobnetnode.RECORDS / slurm_job).read_text()
    except OSError:
        text = ""
    if not text.strip().isdigit():
        raise UsageError(
            f"cannot start a part of Slurm job {slurm_job} on node {node}: the job has no "
            "network here (slurm_multinode off, or its job prolog failed on this node: see "
            "slurmd's log)"
        )
    return int(text)


def job_nodes(slurm_job: str) -> list[str]:
    return scontrol.job_node_list(slurm_job)


class SlurmParts:
    """The part operations of the remote listener (stasis.slurm.integration serves them)."""

    def __init__(self, manager: JobManager, node: str) -> None:
        self.manager = manager
        self.node = node

    def start(self, slurm_job: str, req: PartStartRequest, caller: Caller) -> wire.RunAnswer:
        what = f"cannot start a part of Slurm job {slurm_job} on node {self.node}"
        info = scontrol.job_info(slurm_job)
        if not caller.may_act_on(info.uid):
            raise PermissionDeniedError(
                f"permission denied: {what}: the job is {info.user}'s (uid {caller.uid} asked); "
                "only its user or root starts its parts"
            )
        if info.state != "RUNNING":
            raise UsageError(f"{what}: the job is {info.state or 'not known'}, not RUNNING")
        if self.node not in job_nodes(slurm_job):
            raise UsageError(f"{what}: this node is not one of the job's; start it on one of them")
        vni = job_vni(slurm_job, self.node)
        run = RunRequest(
            command=req.command,
            cwd=req.cwd,
            user=info.user,  # Slurm's word on whose job it is, never the request's
            label=part_label(slurm_job, secrets.token_hex(4)),
            env={"SLURM_JOB_ID": slurm_job},
            private_tmp=False,  # the node's /tmp, as the job's tasks have it under Slurm
            job_net=vni,
        )
        # Root's request (a part in a job network is root's to start), run as the job's user.
        return self.manager.run(run, _ROOT)

    def _part(self, slurm_job: str, part: str, caller: Caller) -> wire.Job:
        """The daemon's job of part `part` (its key): the live one, else the newest (a part a
        cut stopped here and restored here again has both)."""
        label = part_label(slurm_job, part)
        found = (
            []
            if not re.fullmatch(PART_KEY_PATTERN, part)
            else [j for j in self.manager.jobs(_ROOT) if j["label"] == label]
        )
        found.sort(key=lambda j: (j["state"] in _LIVE, j["created"]))
        if not found:
            raise NotFoundError(f"no part {part} of Slurm job {slurm_job} on node {self.node}")
        return self.manager.get(found[-1]["job"], caller)  # the caller's to see, or refused

    def listing(self, slurm_job: str, caller: Caller) -> wire.SlurmPartList:
        """Slurm job `slurm_job`'s live parts here (a cut's coordinator asks)."""
        return wire.SlurmPartList(
            node=self.node,
            parts=[
                wire.SlurmPartRef(part=of[1], job=j["job"], state=j["state"])
                for j in self.manager.jobs(caller)
                if (of := part_of(j["label"])) and of[0] == slurm_job and j["state"] in _LIVE
            ],
        )

    def output(
        self, slurm_job: str, part: str, req: PartOutputRequest, caller: Caller
    ) -> wire.SlurmPartOutput:
        job = self._part(slurm_job, part, caller)
        # The state first: output written before the part ended is then all in the file.
        state, exit_code = job["state"], job["exit_code"]
        data = _read(Path(job["log"]), req.offset)
        return wire.SlurmPartOutput(
            part=part,
            data=base64.b64encode(data).decode(),
            offset=req.offset + len(data),
            state=state,
            exit_code=exit_code,
        )

    def signal(
        self, slurm_job: str, part: str, req: PartSignalRequest, caller: Caller
    ) -> wire.SlurmPartSignalled:
        job = self._part(slurm_job, part, caller)
        if req.signal == "KILL" and caller.is_root and job["pid"] and job["state"] in _LIVE:
            # Root's kill of a restored part (its cut could not be restored whole): its
            # connections closed without a word, as a stopped part's, so that no orphan socket
            # is left in the job's network to refuse the next cut's restore there.
            try:
                jobnetns.silence_connections(job["pid"])
            except OSError as e:
                log.warning("part %s: cannot close its connections quietly: %s", part, e)
        row = self.manager.signal_job(job["job"], caller, _SIGNALS[req.signal])
        return wire.SlurmPartSignalled(part=part, signalled=row is not None)

    def sweep(self) -> None:
        """Kill the parts whose Slurm job no longer runs on this node, and the batch trees of
        such jobs (moved out of Slurm's freezer cgroup into their own, stasis.slurm.jobcut:
        proctrack/cgroup would no longer find them)."""
        running = [
            (j, of[0])
            for j in self.manager.jobs(_ROOT)
            if j["state"] in ("running", "restored") and (of := part_of(j["label"]))
        ]
        batch = _batch_trees()
        if not running and not batch:
            return  # no Slurm to ask
        try:
            live = set(scontrol.jobs_on_node(self.node))
        except SlurmError as e:
            log.warning("cannot tell which Slurm jobs run here, parts left as they are: %s", e)
            return
        for job, slurm_job in running:
            if slurm_job in live and job["pid"] and jobnet.vni_of(job["pid"]) is None:
                # A part of an earlier run of the job (thawed at its freeze's deadline after its
                # coordinator died, the job requeued meanwhile): its network is gone with that
                # run; the job's run here now has a namespace of its own.
                log.warning(
                    "part %s of Slurm job %s killed: it runs in a network of an earlier run of "
                    "the job",
                    job["job"],
                    slurm_job,
                )
                self.manager.signal_job(job["job"], _ROOT, signal.SIGKILL)
                continue
            if slurm_job not in live:
                log.warning(
                    "part %s of Slurm job %s killed: the job no longer runs on node %s",
                    job["job"],
                    slurm_job,
                    self.node,
                )
                self.manager.signal_job(job["job"], _ROOT, signal.SIGKILL)
        for slurm_job, path in batch.items():
            if slurm_job in live:
                continue
            if self.manager.dumper.parts.get(path.name.removeprefix(partcgroup.PREFIX)):
                continue  # frozen for a cut: its coordinator stops or thaws it
            tasks = partcgroup.tasks(path)
            if tasks and slurm_job in set(scontrol.jobs_on_node(self.node)):
                continue  # started here again meanwhile (its tree registered since)
            if tasks:
                log.warning(
                    "batch tree of Slurm job %s killed (%d processes): the job no longer runs on "
                    "node %s",
                    slurm_job,
                    len(tasks),
                    self.node,
                )
            for pid in tasks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if partcgroup.is_frozen(path):
                partcgroup.set_frozen(path, False)  # a frozen task dies of SIGKILL once thawed
            partcgroup.remove(path, wait_s=0)

    # -- a cut's, root's alone (the routes refuse anyone else) --------------------------------

    def freeze(
        self, slurm_job: str, part: str, req: PartFreezeRequest, caller: Caller
    ) -> wire.FreezeAnswer:
        job = self._part(slurm_job, part, caller)
        freeze = FreezeRequest(timeout_s=req.timeout_s)
        return self.manager.dumper.freeze(job["job"], freeze, caller)

    def dump(
        self, slurm_job: str, part: str, req: PartDumpRequest, caller: Caller
    ) -> wire.DumpAnswer:
        job = self._part(slurm_job, part, caller)
        dump = DumpRequest(
            frozen=True,
            label=req.label,
            reason=req.reason,
            cut_parts=req.cut_parts,
            cut_key=req.cut_key,
        )
        return self.manager.dump(job["job"], dump, caller)

    def thaw(
        self, slurm_job: str, part: str, req: PartThawRequest, caller: Caller
    ) -> wire.ThawAnswer:
        job = self._part(slurm_job, part, caller)
        return self.manager.dumper.thaw(job["job"], ThawRequest(stop=req.stop), caller)

    def delete(self, checkpoint: str, caller: Caller) -> wire.Deleted:
        self.manager.delete_checkpoint(checkpoint, caller)
        return wire.Deleted(deleted=checkpoint)

    # -- a restore's on requeue, root's alone --------------------------------------------------

    def net(self, slurm_job: str, req: PartNetRequest, caller: Caller) -> wire.SlurmPartNet:
        """Hold the job's network here still (`held`), or let it go: while the parts of a cut
        are restored one after another, a part back already must not reach one whose node
        has no socket yet (that node's kernel would answer with a reset)."""
        vni = job_vni(slurm_job, self.node)
        if req.held:
            jobnet.hold(vni, why=jobnet.RESTORING)
        else:
            jobnet.release(vni, why=jobnet.RESTORING)
        return wire.SlurmPartNet(node=self.node, vni=vni, held=req.held)

    def restore(
        self, slurm_job: str, req: PartRestoreRequest, caller: Caller
    ) -> wire.RestoreAnswer:
        """Restore part `req.part`'s checkpoint of a cut here, for the Slurm job running here
        now; labelled with its key again (the agent that started it finds it so)."""
        what = f"cannot restore part {req.part} of Slurm job {slurm_job} on node {self.node}"
        if self.node not in job_nodes(slurm_job):
            raise UsageError(f"{what}: this node is not one of the job's")
        job_vni(slurm_job, self.node)  # its network made here: said in one line, else
        manifest = self.manager.store.get(validate_checkpoint_id(req.checkpoint))
        record = manifest.extra.get("cut")
        if not isinstance(record, dict) or record.get("key") != req.part:
            raise UsageError(f"{what}: checkpoint {req.checkpoint} is not that part's")
        restore = RestoreRequest(checkpoint=manifest.id, lazy=False)
        answer = self.manager.restorer.restore(restore, caller)
        self.manager.relabel(answer["job"], part_label(slurm_job, req.part))
        return answer


def _batch_trees() -> dict[str, Path]:
    """The freezer cgroups of this node's batch trees of Slurm jobs on several nodes, by job."""
    root = partcgroup.root()
    prefix = f"{partcgroup.PREFIX}slurm-"
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    return {
        n.removeprefix(prefix): root / n
        for n in names
        if n.startswith(prefix) and n.removeprefix(prefix).isdigit()
    }


def _read(path: Path, offset: int) -> bytes:
    """Up to MAX_CHUNK_BYTES of the daemon's log of a part from `offset` (the daemon's own file:
    no link followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return b""
    try:
        return os.pread(fd, MAX_CHUNK_BYTES, offset)
    finally:
        os.close(fd)


__all__ = ["SlurmParts", "job_nodes", "job_vni", "part_label", "part_of"]
