"""A protected Slurm job on several nodes, checkpointed as one cut by its batch node's daemon.

A job with a network of its own (`slurm_multinode`: the job prolog recorded it here,
stasis.slurm.jobnetnode) has every process under a node daemon: its batch tree (the batch
script, `mpirun` and its ranks on this node, each launch agent) under this one, registered by
the launcher; what the launch agent started on any node (stasis.slurm.parts) under that node's.
Each is a part of the job: the batch tree's freezer cgroup is `stasis-part-slurm-<job>`, where
its registration puts it (`adopt`), the others' their own. The checkpoint the launcher asks for
(preemption, time limit, `stasis dump --slurm-job`, a drain) is then `cut.take` over every
part of the job: the batch tree (key "batch", in this daemon: `BatchPart`), this node's other
parts (through this daemon's own socket) and every other node's (their remote listeners,
root's munge credential: stasis.slurm.partclient). Its checkpoints are labelled
`<label>.cut-<id>`; the batch tree's has the id the registration recorded for the stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Unpack

from stasis import wire
from stasis.client import Client
from stasis.daemon import partcgroup
from stasis.daemon.users import Caller
from stasis.engine import proctree
from stasis.errors import CheckpointError, StasisError
from stasis.slurm import cut, jobnetnode, remote, scontrol
from stasis.slurm.partclient import RemoteParts
from stasis.slurm.partnames import part_of
from stasis.store import CheckpointInfo

if TYPE_CHECKING:
    from stasis.config import Settings
    from stasis.daemon.jobs import JobManager

BATCH = "batch"  # the batch tree's key in its cuts
_ROOT = Caller(pid=0, uid=0, gid=0)
_LIVE = ("running", "restored")
_ADOPT_PASSES = 20
log = logging.getLogger("stasis.slurm")


def spans_nodes(slurm_job: str) -> bool:
    """Whether the job has a network of its own on this node (its prolog made one: it was
    allocated several nodes with `slurm_multinode` on)."""
    return (jobnetnode.RECORDS / slurm_job).is_file()


def batch_name(slurm_job: str) -> str:
    """The batch tree's name as a part: its freezer cgroup's, and its freeze's in the journal."""
    return f"slurm-{slurm_job}"


def adopt(slurm_job: str, pid: int) -> Path:
    """Move the batch tree under `pid` (every process of it, forks racing the move included)
    into its part's freezer cgroup; the cgroup."""
    path = partcgroup.make(batch_name(slurm_job))
    for _ in range(_ADOPT_PASSES):
        moved = 0
        for p in [pid, *proctree.tree(pid)]:
            if partcgroup.current(p) != path:
                try:
                    (path / "cgroup.procs").write_text(str(p))
                    moved += 1
                except ProcessLookupError:
                    pass  # ended meanwhile
        if not moved:
            return path
    raise CheckpointError(
        f"Slurm job {slurm_job}: its batch tree kept forking while it was moved into {path}"
    )


def forget(slurm_job: str) -> None:
    """Remove the batch tree's cgroup once the tree is gone (left if it is not)."""
    partcgroup.remove(partcgroup.path_for(batch_name(slurm_job)), wait_s=0)


class BatchPart:
    """The batch tree as a part of a cut, dumped by this daemon (cut.PartDaemon)."""

    def __init__(self, manager: JobManager, pid: int, info: CheckpointInfo, what: str) -> None:
        self.manager = manager
        self.pid = pid
        self.info = info  # its checkpoint's, but for the cut's label and record
        self.what = what
        self.name = batch_name(info.job)

    def freeze(self, job_id: str, **request: Unpack[wire.FreezeRequest]) -> wire.FreezeAnswer:
        timeout_s = float(request.get("timeout_s", cut.FREEZE_TIMEOUT_S))
        refused = self.manager.dumper.refusal(self.pid, self.info)
        if refused:
            raise CheckpointError(f"{self.what} not frozen, it runs on: {refused}")
        entry = self.manager.dumper.parts.freeze(self.name, self.pid, timeout_s, self.info.uid)
        return wire.FreezeAnswer(
            job=self.name, cgroup=entry.cgroup, job_net=entry.vni, timeout_s=timeout_s
        )

    def dump(
        self,
        job_id: str,
        progress: Callable[[int, int], None] | None = None,
        **request: Unpack[wire.DumpRequest],
    ) -> wire.DumpAnswer:
        parts = self.manager.dumper.parts
        frozen = parts.get(self.name)
        if frozen is None:
            raise CheckpointError(f"{self.what}: its batch tree is not frozen")
        record = {"parts": request.get("cut_parts"), "key": request.get("cut_key")}
        info = self.info.model_copy(
            update={
                "label": request.get("label", self.info.label),
                "extra": {**self.info.extra, "cut": record},
            }
        )
        started = time.monotonic()
        with parts.dumping(self.name):
            manifest, result, staged = self.manager.dumper.checkpoint_tree(
                self.pid,
                info,
                True,  # a frozen part stays frozen: the cut stops or thaws it
                "none",
                self.what,
                reason=request.get("reason", "asked"),
                freeze_cgroup=frozen.cgroup,
            )
        parts.note_checkpoint(self.name, manifest.id)
        return wire.DumpAnswer(
            checkpoint=manifest.id,
            label=manifest.label,
            job=self.name,
            size_bytes=manifest.size_bytes,
            duration_s=round(result.duration_s, 4),
            elapsed_s=round(time.monotonic() - started, 4),
            staged=staged,
            notes=[],
        )

    def thaw(self, job_id: str, **request: Unpack[wire.ThawRequest]) -> wire.ThawAnswer:
        entry = self.manager.dumper.parts.thaw(self.name, bool(request.get("stop", False)))
        return wire.ThawAnswer(
            job=self.name,
            state="checkpointed" if entry.stop else "running",
            stopped=entry.stop,
            checkpoints=entry.checkpoints,
        )

    def delete_checkpoint(self, checkpoint_id: str) -> wire.Deleted:
        self.manager.delete_checkpoint(checkpoint_id, _ROOT)
        return wire.Deleted(deleted=checkpoint_id)


def job_parts(
    manager: JobManager, settings: Settings, slurm_job: str, batch: BatchPart
) -> list[cut.PartRef]:
    """Every part of the job on every node of its allocation: the batch tree first, this
    node's other parts, then each other node's (asked there)."""
    here = remote.this_node(settings)
    refs = [cut.PartRef(here, batch, batch.name, BATCH)]
    mine = Client(settings.socket, timeout_s=None)
    for j in manager.jobs(_ROOT):
        of = part_of(j["label"])
        if of is not None and of[0] == slurm_job and j["state"] in _LIVE:
            refs.append(cut.PartRef(here, mine, j["job"], of[1]))
    for node in scontrol.job_node_list(slurm_job):
        if node == here:
            continue
        target = remote.remote_node(settings, node, scontrol.node_address(node))
        there = RemoteParts(settings, target, slurm_job)
        try:
            listed = there.listing()
        except (StasisError, OSError) as e:
            raise CheckpointError(
                f"Slurm job {slurm_job} not checkpointed: cannot list its parts on node {node} "
                f"({e}); the job runs on"
            ) from e
        refs += [cut.PartRef(node, there, p["part"], p["part"]) for p in listed["parts"]]
    return refs


def take(
    manager: JobManager,
    settings: Settings,
    pid: int,
    info: CheckpointInfo,
    leave_running: bool,
    reason: str,
) -> tuple[cut.Cut, BatchPart]:
    """One cut of the Slurm job `info.job` whose batch tree is `pid`; CheckpointError (one
    line) when it cannot be taken: every part runs on, no checkpoint of it left."""
    what = f"Slurm job {info.job}"
    batch = BatchPart(manager, pid, info, what)
    if partcgroup.of(pid) is None:
        raise CheckpointError(
            f"{what} not checkpointed: its batch tree is not in a cgroup of its own (registered "
            "by a stasis without jobs across nodes); the job runs on"
        )
    parts = job_parts(manager, settings, info.job, batch)
    taken = cut.take(
        parts,
        info.label,
        leave_running=leave_running,
        reason=reason,
        cut_id=None,
    )
    prune(manager, settings, info)
    return taken, batch


def prune(manager: JobManager, settings: Settings, info: CheckpointInfo) -> list[str]:
    """Delete the job's cuts beyond the `keep` newest complete ones (each cut has a label of its
    own: the store's retention per label never does), and incomplete ones older than the
    newest complete one; the checkpoints deleted. What cannot be deleted now is left for the
    next cut's prune."""
    if settings.keep < 1:
        return []
    try:
        doomed = cut.prune(manager.store.list(uid=info.uid), info.label, settings.keep)
    except StasisError as e:
        log.warning("Slurm job %s: its older cuts not pruned: %s", info.job, e)
        return []
    deleted = []
    for checkpoint in doomed:
        try:
            manager.delete_checkpoint(checkpoint, _ROOT)
            deleted.append(checkpoint)
        except StasisError as e:
            log.warning(
                "Slurm job %s: checkpoint %s of an old cut not deleted: %s", info.job, checkpoint, e
            )
    return deleted


__all__ = [
    "BATCH",
    "BatchPart",
    "adopt",
    "batch_name",
    "forget",
    "job_parts",
    "spans_nodes",
    "take",
]
