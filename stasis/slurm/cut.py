"""One consistent checkpoint of a job that spans nodes: the cut, driven through each node's daemon.

A job on several nodes (issue 31) is a set of parts, each a job of a node's daemon run in the
job's network (`job_net`: its own freezer cgroup, stasis/daemon/partfreeze.py), one or several
on a node. `take` cuts them in two phases: every part frozen (all at once, each with a deadline)
before any is dumped; then every part dumped as it stands (`frozen`), all at once; then every
part thawed, to run on (`leave_running`) or to end at the checkpoint (`stop`). A cut is all or
nothing: a part that cannot be frozen or dumped abandons it, the checkpoints the others took are
deleted and every part is thawed where it was (TCP resends what its held network dropped).

The parts of one cut are tied together in the store by their label, `<label>.cut-<cut id>`
(`cut_label`): the same for every part, so that listing that label gives the whole cut. Each
checkpoint records the cut in its manifest (`extra["cut"] = {"parts": N, "key": K}`): how many
checkpoints the cut has, and its part's key among them ("batch", a Slurm part's key, or by
default the part's name: its node's, `node/job` where a node has several parts); and its part's
job address (`job_net`). A restore takes every checkpoint of one label or none: `restore_plan`
gives the complete cuts, newest first (exactly N checkpoints, with N distinct keys), each
checkpoint paired with the node that gets its address (the job prolog gives the i-th node of the
job's NodeList the address .(i+1): a requeued job on as many other nodes, in any order, finds
every address again). Cuts taken before checkpoints recorded it count as complete with one
checkpoint for each node's address. `prune` says which cuts a job's retention deletes: every cut
has a label of its own, so the store's retention per label never does.
"""

from __future__ import annotations

import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, Unpack

from stasis import faults, wire
from stasis.daemon.jobnet import JobNet
from stasis.daemon.models import CUT_KEY_PATTERN, CUT_PARTS_MAX
from stasis.errors import CheckpointError, StasisError, UsageError
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
    """A job's part on one node: that node's daemon, and the part's job id there (one of a
    cut's parts per (node, job)). `key`: its key in the cut's record ("batch", a Slurm part's
    key); '' for its name in the cut (`Cut.checkpoints`)."""

    node: str
    client: PartDaemon
    job: str
    key: str = ""


@dataclass
class Cut:
    id: str
    label: str  # every part's checkpoint has it
    # Each part's checkpoint id, by the part's name: its node's, or `node/job` where its node
    # has several parts in the cut.
    checkpoints: dict[str, str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # each part's key in the record, by name
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


def part_names(parts: Sequence[PartRef]) -> list[str]:
    """Each part's name in a cut of `parts`: its node's, or `node/job` where its node has
    several parts."""
    on = Counter(p.node for p in parts)
    return [p.node if on[p.node] == 1 else f"{p.node}/{p.job}" for p in parts]


def _part(name: str) -> str:
    """A part, by its name in a cut, as said in a line: "part on n2", "part 1a2b on n2"."""
    node, _, job = name.partition("/")
    return f"part {job} on {node}" if job else f"part on {node}"


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


def _abandon(
    parts: Sequence[PartRef], names: Sequence[str], frozen: Sequence[int], taken: dict[str, str]
) -> str:
    """Delete the checkpoints taken (by name), thaw the frozen parts (their indexes in `parts`);
    what could not be undone ('' none)."""
    left: list[str] = []
    by_name = dict(zip(names, parts, strict=True))
    for name, checkpoint in taken.items():
        try:
            by_name[name].client.delete_checkpoint(checkpoint)
        except (StasisError, OSError) as e:
            left.append(f"checkpoint of its {_part(name)} ({checkpoint}) not deleted ({e})")
    thawing = [parts[i] for i in frozen]
    for i, answer in zip(frozen, _each(thawing, lambda p: p.client.thaw(p.job)), strict=True):
        if isinstance(answer, StasisError):
            left.append(f"{_part(names[i])} not thawed, it thaws at its deadline ({answer})")
    return "; ".join(left)


def _failed(what: str, names: Sequence[str], answers: Sequence[object]) -> str:
    return "; ".join(
        f"its {_part(n)} could not be {what} ({a})"
        for n, a in zip(names, answers, strict=True)
        if isinstance(a, StasisError)
    )


def _refusal(parts: Sequence[PartRef], keys: Sequence[str]) -> str:
    """Why `parts` cannot be one cut ('' they can)."""
    if not parts:
        return "a cut needs one part at least"
    if len({(p.node, p.job) for p in parts}) != len(parts):
        return "a part is named twice (the same job on the same node)"
    if len(parts) > CUT_PARTS_MAX:
        return f"a cut has at most {CUT_PARTS_MAX} parts"
    if len(set(keys)) != len(keys):
        return "two parts have the same key"
    bad = [k for k in keys if not re.fullmatch(CUT_KEY_PATTERN, k)]
    if bad:
        return f"part key {bad[0]!r} is not a key (letters, digits, '._/-', 128 at most)"
    return ""


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
    names = part_names(parts)
    keys = [p.key or n for p, n in zip(parts, names, strict=True)]
    refused = _refusal(parts, keys)
    if refused:
        raise CheckpointError(
            f"no checkpoint of {label} taken: {refused}, not "
            f"{[f'{p.node}/{p.job}' for p in parts]}; give each part once, or dump a one-node "
            "job alone"
        )
    cut = Cut(id=cut_id or new_cut_id(), label="", keys=dict(zip(names, keys, strict=True)))
    cut.label = cut_label(label, cut.id)
    started = time.monotonic()

    froze = _each(parts, lambda p: p.client.freeze(p.job, timeout_s=timeout_s))
    frozen = [i for i, a in enumerate(froze) if not isinstance(a, StasisError)]
    if len(frozen) < len(parts):
        left = _abandon(parts, names, frozen, {})
        raise CheckpointError(
            f"no checkpoint of {label} taken: {_failed('frozen', names, froze)}; every part runs "
            f"on{f' except: {left}' if left else ''}"
        )
    faults.point("cut.after-freeze")  # a coordinator dead here: each part thaws at its deadline

    key_of = {(p.node, p.job): k for p, k in zip(parts, keys, strict=True)}
    dumped = _each(
        parts,
        lambda p: p.client.dump(
            p.job,
            frozen=True,
            label=cut.label,
            reason=reason,
            cut_parts=len(parts),
            cut_key=key_of[(p.node, p.job)],
        )["checkpoint"],
    )
    taken = {n: a for n, a in zip(names, dumped, strict=True) if isinstance(a, str)}
    if len(taken) < len(parts):
        left = _abandon(parts, names, range(len(parts)), taken)
        raise CheckpointError(
            f"no checkpoint of {label} taken: {_failed('dumped', names, dumped)}; the other "
            f"parts' checkpoints were deleted and every part runs on"
            f"{f' except: {left}' if left else ''}"
        )

    # Dead here: the cut stands (every part was dumped frozen), each part thaws at its deadline.
    faults.point("cut.after-dump")
    cut.checkpoints = taken
    cut.stopped = not leave_running
    thawed = _each(parts, lambda p: p.client.thaw(p.job, stop=cut.stopped))
    cut.frozen_s = time.monotonic() - started
    # The checkpoints stand whatever this says: every part was dumped in the cut.
    cut.unfinished = _failed("stopped" if cut.stopped else "thawed", names, thawed)
    return cut


@dataclass(frozen=True)
class RestorePlan:
    label: str  # the cut's
    # (node, checkpoint id), in the order of the job's nodes (by key among one node's parts).
    parts: list[tuple[str, str]]
    # Each part's key, as `parts` ('' in a cut taken before checkpoints recorded their cut).
    keys: list[str] = field(default_factory=list)


def _record(m: Manifest) -> tuple[int, str] | None:
    """(parts, key) of the cut a checkpoint records; None if it records none (taken before
    checkpoints did); (0, '') for a record that cannot be read, which no cut completes."""
    value = m.extra.get("cut")
    if value is None:
        return None
    parts = value.get("parts") if isinstance(value, dict) else None
    key = value.get("key") if isinstance(value, dict) else None
    if isinstance(parts, int) and not isinstance(parts, bool) and isinstance(key, str) and key:
        return parts, key
    return 0, ""


def _whole(taken: Sequence[Manifest]) -> bool:
    """Whether a cut's checkpoints `taken` are all of it (by what they record, whatever the
    nodes it is to be restored on): every one records N checkpoints, and there are N, with
    distinct keys; a cut without records, one checkpoint per job address, two at least."""
    records = [_record(m) for m in taken]
    if all(r is None for r in records):
        nets = {(m.job_net.vni, m.job_net.address) for m in taken if m.job_net is not None}
        return len(taken) >= 2 and len(nets) == len(taken) and len({v for v, _ in nets}) == 1
    if any(r is None for r in records):
        return False
    counts = {r[0] for r in records if r is not None}
    keys = {r[1] for r in records if r is not None}
    return counts == {len(taken)} and len(keys) == len(taken)


def _cuts(manifests: Iterable[Manifest], label: str) -> dict[str, list[Manifest]]:
    """The checkpoints of each cut of the job labelled `label`, by cut label."""
    cuts: dict[str, list[Manifest]] = {}
    for m in manifests:
        of = cut_of(m.label)
        if of is not None and of[0] == label:
            cuts.setdefault(m.label, []).append(m)
    return cuts


def _newest(taken: Sequence[Manifest]) -> float:
    return max(m.created.timestamp() for m in taken)


def restore_plan(
    manifests: Sequence[Manifest], label: str, net: JobNet, nodes: Sequence[str]
) -> list[RestorePlan]:
    """The cuts of the job labelled `label` (network `net`, now on `nodes`, the NodeList's order)
    that can be restored, newest first: those with every checkpoint they record, with distinct
    keys, each with an address of the job's network that one of `nodes` has now, one part at
    least on the first (one node may have several, a node where the job ran nothing none); a
    cut taken before checkpoints recorded it, exactly one checkpoint for each node's address.
    A cut a dead coordinator left half-written, or taken on more nodes, is never one."""
    node_of = {str(net.address(i)): node for i, node in enumerate(nodes)}
    index_of = {a: i for i, a in enumerate(node_of)}
    plans: list[tuple[float, str, RestorePlan]] = []
    for cut_name, taken in _cuts(manifests, label).items():
        if not _whole(taken):
            continue
        addresses = [
            str(m.job_net.address) if m.job_net is not None and m.job_net.vni == net.vni else ""
            for m in taken
        ]
        # Recorded cuts: every part at an address of these nodes, one at least on the first
        # (the batch node's tree is always a part; a node where the job ran nothing has none).
        # Cuts before records: exactly one per node.
        recorded = all(_record(m) is not None for m in taken)
        first = str(net.address(0))
        if "" in addresses or not (
            set(addresses) <= set(node_of) and first in addresses
            if recorded
            else set(addresses) == set(node_of)
        ):
            continue  # another network's, taken on more nodes, or without its batch node
        keys = [r[1] if (r := _record(m)) else "" for m in taken]
        order = sorted(
            range(len(taken)), key=lambda i: (index_of[addresses[i]], keys[i], taken[i].id)
        )
        plan = RestorePlan(
            cut_name,
            [(node_of[addresses[i]], taken[i].id) for i in order],
            [keys[i] for i in order],
        )
        plans.append((_newest(taken), cut_name, plan))
    return [plan for *_, plan in sorted(plans, key=lambda p: (p[0], p[1]), reverse=True)]


def prune(manifests: Iterable[Manifest], label: str, keep: int) -> list[str]:
    """The checkpoints the retention of the job labelled `label` deletes: its complete cuts
    beyond the `keep` newest (complete by their records, `_whole`), and every incomplete cut
    older than the newest complete one (a newer one may be being taken: kept). Ids, by cut,
    oldest cut first."""
    if keep < 1:
        raise UsageError(f"a job's cuts are kept {keep} at a time: keep 1 at least")
    cuts = sorted(
        _cuts(manifests, label).items(), key=lambda c: (_newest(c[1]), c[0]), reverse=True
    )
    complete = [c for c in cuts if _whole(c[1])]
    if not complete:
        return []
    newest = (_newest(complete[0][1]), complete[0][0])
    kept = {name for name, _ in complete[:keep]}
    doomed = [
        (name, taken)
        for name, taken in cuts
        if name not in kept and (_whole(taken) or (_newest(taken), name) < newest)
    ]
    return [m.id for _, taken in reversed(doomed) for m in sorted(taken, key=lambda m: m.id)]


__all__ = [
    "FREEZE_TIMEOUT_S",
    "Cut",
    "PartRef",
    "RestorePlan",
    "cut_label",
    "cut_of",
    "new_cut_id",
    "part_names",
    "prune",
    "restore_plan",
    "take",
]
