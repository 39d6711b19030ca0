"""One consistent checkpoint of a job that spans nodes: the cut, driven through each node's daemon.

A job on several nodes (issue 31) has one part per node, each a job of that node's daemon run in
the job's network (`job_net`: its own freezer cgroup, stasis/daemon/partfreeze.py). `take` cuts
them in two phases: every part frozen (all at once, each with a deadline) before any is dumped;
then every part dumped as it stands (`frozen`), all at once; then every part thawed, to run on
(`leave_running`) or to end at the checkpoint (`stop`). A cut is all or nothing: a part that
cannot be frozen or dumped abandons it, the checkpoints the others took are deleted and every
part is thawed where it was (TCP resends what its held network dropped).

The parts of one cut are tied together in the store by their label, `<label>.cut-<cut id>`
(`cut_label`): the same for every part, so that listing that label gives the whole cut, each
checkpoint naming its part by its job address (its manifest's `job_net`). A restore takes every
checkpoint of one label or none: `restore_plan` gives the complete cuts, newest first, each
part's checkpoint paired with the node that gets its address (the job prolog gives the i-th node
of the job's NodeList the address .(i+1): a requeued job on as many other nodes, in any order,
finds every address again).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, Unpack

from stasis import wire
from stasis.daemon.jobnet import JobNet
from stasis.errors import CheckpointError, StasisError
from stasis.store.manifest import Manifest, validate_label

T = TypeVar("T")
FREEZE_TIMEOUT_S = 60.0  # a part thaws by itself this long after its freeze, its cut or not
_CUT = ".cut-"


class PartDaemon(Protocol):
    """What a cut asks of a part's daemon: stasis.client.Client on its own node's socket,
    stasis.slurm.partclient.RemoteParts on another node's remote listener."""

    def freeze(self, job_id: str, **request: Unpack[wire.FreezeRequest]) -> wire.FreezeAnswer: ...

    def dump(
        self,
        job_id: str,
        progress: Callable[[int, int], None] | None = None,
        **request: Unpack[wire.DumpRequest],
    ) -> wire.DumpAnswer: ...

    def thaw(self, job_id: str, **request: Unpack[wire.ThawRequest]) -> wire.ThawAnswer: ...

    def delete_checkpoint(self, checkpoint_id: str) -> wire.Deleted: ...


@dataclass(frozen=True)
class PartRef:
    """A job's part on one node: that node's daemon, and the part's job id there."""

    node: str
    client: PartDaemon
    job: str


@dataclass
class Cut:
    id: str
    label: str  # every part's checkpoint has it
    checkpoints: dict[str, str] = field(default_factory=dict)  # node -> checkpoint id
    stopped: bool = False
    frozen_s: float = 0.0  # from the first freeze asked to the last part thawed or stopped
    # Parts that could not be thawed or stopped once every part was dumped (one line; '' none):
    # the cut stands, they thaw at their freeze's deadline; a stopping coordinator kills them.
    unfinished: str = ""


def new_cut_id() -> str:
    """A cut's id: time-ordered (seconds since the epoch), then random."""
    return f"{int(time.time())}-{secrets.token_hex(3)}"


def cut_label(label: str, cut_id: str) -> str:
    """The label every part's checkpoint of cut `cut_id` of the job labelled `label` has."""
    return validate_label(f"{label}{_CUT}{cut_id}")


def cut_of(label: str) -> tuple[str, str] | None:
    """(job label, cut id) of a cut's label; None for any other label."""
    base, sep, cut_id = label.rpartition(_CUT)
    return (base, cut_id) if sep and base and cut_id else None


def _each(parts: Sequence[PartRef], act: Callable[[PartRef], T]) -> list[T | StasisError]:
    """`act` on every part at once; each part's answer or its error, in the parts' order."""

    def one(p: PartRef) -> T | StasisError:
        try:
            return act(p)
        except StasisError as e:
            return e
        except OSError as e:  # the daemon's socket gone
            return StasisError(f"its daemon cannot be reached ({e.strerror or e})")

    with ThreadPoolExecutor(max_workers=max(1, len(parts))) as pool:
        return list(pool.map(one, parts))


def _abandon(parts: Sequence[PartRef], frozen: Sequence[PartRef], taken: dict[str, str]) -> str:
    """Delete the checkpoints taken, thaw the frozen parts; what could not be undone ('' none)."""
    left: list[str] = []
    by_node = {p.node: p for p in parts}
    for node, checkpoint in taken.items():
        try:
            by_node[node].client.delete_checkpoint(checkpoint)
        except (StasisError, OSError) as e:
            left.append(f"checkpoint {checkpoint} of {node} not deleted ({e})")
    for p, answer in zip(frozen, _each(frozen, lambda p: p.client.thaw(p.job)), strict=True):
        if isinstance(answer, StasisError):
            left.append(f"part on {p.node} not thawed, it thaws at its deadline ({answer})")
    return "; ".join(left)


def _failed(what: str, parts: Sequence[PartRef], answers: Sequence[object]) -> str:
    return "; ".join(
        f"its part on {p.node} could not be {what} ({a})"
        for p, a in zip(parts, answers, strict=True)
        if isinstance(a, StasisError)
    )


def take(
    parts: Sequence[PartRef],
    label: str,
    leave_running: bool = True,
    timeout_s: float = FREEZE_TIMEOUT_S,
    reason: str = "asked",
    cut_id: str | None = None,
) -> Cut:
    """One consistent checkpoint of the job whose parts are `parts`, labelled `label`: every part
    frozen before any is dumped. CheckpointError (one line) when any part cannot be frozen or
    dumped: then no checkpoint of the cut is left and every part runs on. Parts that cannot be
    thawed or stopped after every dump are said in the cut's `unfinished`."""
    if len({p.node for p in parts}) != len(parts) or len(parts) < 2:
        raise CheckpointError(
            f"no checkpoint of {label} taken: a cut across nodes needs one part on each of at "
            f"least two nodes, not {[p.node for p in parts]}; dump a one-node job alone"
        )
    cut = Cut(id=cut_id or new_cut_id(), label="")
    cut.label = cut_label(label, cut.id)
    started = time.monotonic()

    froze = _each(parts, lambda p: p.client.freeze(p.job, timeout_s=timeout_s))
    frozen = [p for p, a in zip(parts, froze, strict=True) if not isinstance(a, StasisError)]
    if len(frozen) < len(parts):
        left = _abandon(parts, frozen, {})
        raise CheckpointError(
            f"no checkpoint of {label} taken: {_failed('frozen', parts, froze)}; every part runs "
            f"on{f' except: {left}' if left else ''}"
        )

    dumped = _each(
        parts,
        lambda p: p.client.dump(p.job, frozen=True, label=cut.label, reason=reason)["checkpoint"],
    )
    taken = {p.node: a for p, a in zip(parts, dumped, strict=True) if isinstance(a, str)}
    if len(taken) < len(parts):
        left = _abandon(parts, parts, taken)
        raise CheckpointError(
            f"no checkpoint of {label} taken: {_failed('dumped', parts, dumped)}; the other "
            f"parts' checkpoints were deleted and every part runs on"
            f"{f' except: {left}' if left else ''}"
        )

    cut.checkpoints = taken
    cut.stopped = not leave_running
    thawed = _each(parts, lambda p: p.client.thaw(p.job, stop=cut.stopped))
    cut.frozen_s = time.monotonic() - started
    # The checkpoints stand whatever this says: every part was dumped in the cut.
    cut.unfinished = _failed("stopped" if cut.stopped else "thawed", parts, thawed)
    return cut


@dataclass(frozen=True)
class RestorePlan:
    label: str  # the cut's
    parts: list[tuple[str, str]]  # (node, checkpoint id), in the order of the job's nodes


def restore_plan(
    manifests: Sequence[Manifest], label: str, net: JobNet, nodes: Sequence[str]
) -> list[RestorePlan]:
    """The cuts of the job labelled `label` (network `net`, now on `nodes`, the NodeList's order)
    that can be restored, newest first: those with exactly one checkpoint for each node's
    address (a cut a dead coordinator left half-written, or taken on another number of nodes,
    is never one)."""
    cuts: dict[str, list[Manifest]] = {}
    for m in manifests:
        of = cut_of(m.label)
        if of is not None and of[0] == label:
            cuts.setdefault(m.label, []).append(m)
    plans: list[tuple[float, RestorePlan]] = []
    for cut_name, taken in cuts.items():
        by_address = {
            str(m.job_net.address): m
            for m in taken
            if m.job_net is not None and m.job_net.vni == net.vni
        }
        wanted = [str(net.address(i)) for i in range(len(nodes))]
        if len(taken) != len(nodes) or sorted(by_address) != sorted(wanted):
            continue
        parts = [(node, by_address[a].id) for node, a in zip(nodes, wanted, strict=True)]
        newest = max(m.created.timestamp() for m in taken)
        plans.append((newest, RestorePlan(cut_name, parts)))
    return [plan for _, plan in sorted(plans, key=lambda p: p[0], reverse=True)]


__all__ = [
    "FREEZE_TIMEOUT_S",
    "Cut",
    "PartRef",
    "RestorePlan",
    "cut_label",
    "cut_of",
    "new_cut_id",
    "restore_plan",
    "take",
]
