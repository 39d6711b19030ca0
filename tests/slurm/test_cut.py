"""stasis.slurm.cut without daemons: what `take` asks of each part's daemon and undoes on a
failure (its daemons answered by a stand-in: the daemons' side is tests/e2e/test_jobnet_daemon.py
and tests/e2e/test_mpi_rsh.py), and which cuts `restore_plan` and `prune` find among real
manifests, published in a real store as the daemons publish them."""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Unpack

import pytest
from pydantic import ValidationError

from stasis import wire
from stasis.daemon.jobnet import JobNet
from stasis.daemon.models import DumpRequest
from stasis.errors import CheckpointError, StasisError, UsageError
from stasis.slurm import cut
from stasis.slurm.labels import cut_candidates, slurm_extra
from stasis.slurm.models import PartDumpRequest
from stasis.store import Manifest, Store
from tests.store.helpers import SMALL_FILES, make_info, stage

NET = JobNet(70, ipaddress.IPv4Network("100.64.70.0/24"))
OTHER_NET = JobNet(71, ipaddress.IPv4Network("100.64.71.0/24"))


class Daemon:
    """One node's daemon as a cut sees it: every call logged, in the order the calls came (the
    cut calls its parts from threads); a job named in `refuse` refuses that operation."""

    def __init__(self, node: str, log: list[tuple[str, str, str]], lock: threading.Lock) -> None:
        self.node = node
        self.log = log
        self.lock = lock
        self.refuse: dict[str, str] = {}  # job -> the operation it refuses
        self.dumps: dict[str, dict[str, object]] = {}  # job -> what its dump was asked
        self.deleted: list[str] = []

    def _call(self, op: str, job: str) -> None:
        with self.lock:
            self.log.append((op, self.node, job))
        if self.refuse.get(job) == op:
            raise StasisError(f"job {job} cannot be {op}d here")

    def freeze(self, job_id: str, **request: Unpack[wire.FreezeRequest]) -> wire.FreezeAnswer:
        self._call("freeze", job_id)
        return wire.FreezeAnswer(
            job=job_id, cgroup="x", job_net=70, timeout_s=request.get("timeout_s", 60.0)
        )

    def dump(
        self,
        job_id: str,
        progress: Callable[[int, int], None] | None = None,
        **request: Unpack[wire.DumpRequest],
    ) -> wire.DumpAnswer:
        self._call("dump", job_id)
        self.dumps[job_id] = dict(request)
        return wire.DumpAnswer(
            checkpoint=f"ck-{self.node}-{job_id}",
            label=str(request.get("label")),
            job=job_id,
            size_bytes=1,
            duration_s=0.0,
            elapsed_s=0.0,
            staged=False,
            notes=[],
        )

    def thaw(self, job_id: str, **request: Unpack[wire.ThawRequest]) -> wire.ThawAnswer:
        self._call("stop" if request.get("stop") else "thaw", job_id)
        stop = bool(request.get("stop"))
        return wire.ThawAnswer(
            job=job_id, state="checkpointed" if stop else "running", stopped=stop, checkpoints=[]
        )

    def delete_checkpoint(self, checkpoint_id: str) -> wire.Deleted:
        self.deleted.append(checkpoint_id)
        return wire.Deleted(deleted=checkpoint_id)


@pytest.fixture
def daemons() -> dict[str, Daemon]:
    log: list[tuple[str, str, str]] = []
    lock = threading.Lock()
    return {n: Daemon(n, log, lock) for n in ("n1", "n2", "n3")}


def _ops(d: Daemon) -> list[str]:
    return [op for op, _, _ in d.log]


def test_take_refuses_a_part_named_twice_or_no_part(
    daemons: dict[str, Daemon],
) -> None:
    n1, n2 = daemons["n1"], daemons["n2"]
    for parts, why in [
        ([], "one part at least"),
        ([cut.PartRef("n1", n1, "a"), cut.PartRef("n1", n1, "a")], "named twice"),
        (
            [cut.PartRef("n1", n1, "a", key="k"), cut.PartRef("n2", n2, "b", key="k")],
            "the same key",
        ),
        ([cut.PartRef("n1", n1, "a"), cut.PartRef("n2", n2, "b", key="a b")], "is not a key"),
    ]:
        with pytest.raises(CheckpointError, match=why) as refused:
            cut.take(parts, "job")
        said = str(refused.value)
        assert "\n" not in said and said.startswith("no checkpoint of job taken: ")
    assert n1.log == []  # nothing frozen


def test_several_parts_on_one_node_each_named_and_keyed(daemons: dict[str, Daemon]) -> None:
    n1, n2 = daemons["n1"], daemons["n2"]
    parts = [
        cut.PartRef("n1", n1, "batchjob", key="batch"),
        cut.PartRef("n1", n1, "a"),
        cut.PartRef("n2", n2, "b"),
    ]
    taken = cut.take(parts, "job", leave_running=False, reason="preempted", cut_id="1-abc")
    assert taken.label == "job.cut-1-abc" and taken.stopped and taken.unfinished == ""
    # Named by node, `node/job` where a node has several; keyed by their key, else their name.
    assert taken.checkpoints == {
        "n1/batchjob": "ck-n1-batchjob",
        "n1/a": "ck-n1-a",
        "n2": "ck-n2-b",
    }
    assert taken.keys == {"n1/batchjob": "batch", "n1/a": "n1/a", "n2": "n2"}
    # Every dump records the cut: its number of parts and the part's key.
    assert {j: (d["cut_parts"], d["cut_key"]) for j, d in (n1.dumps | n2.dumps).items()} == {
        "batchjob": (3, "batch"),
        "a": (3, "n1/a"),
        "b": (3, "n2"),
    }
    assert all(
        d["frozen"] and d["label"] == taken.label and d["reason"] == "preempted"
        for d in (n1.dumps | n2.dumps).values()
    )
    # Every part frozen before any is dumped, every part dumped before any is stopped.
    ops = _ops(n1)
    assert ops[:3].count("freeze") == 3 and ops[3:6].count("dump") == 3
    assert ops[6:] == ["stop"] * 3
    # Today's callers: one part per node, named and keyed by their node.
    again = cut.take([cut.PartRef("n1", n1, "a"), cut.PartRef("n2", n2, "b")], "job")
    assert set(again.checkpoints) == {"n1", "n2"} and not again.stopped
    assert (n2.dumps["b"]["cut_parts"], n2.dumps["b"]["cut_key"]) == (2, "n2")


def test_a_failed_dump_abandons_the_cut_and_deletes_what_was_taken(
    daemons: dict[str, Daemon],
) -> None:
    n1, n2 = daemons["n1"], daemons["n2"]
    parts = [cut.PartRef("n1", n1, "a"), cut.PartRef("n1", n1, "c"), cut.PartRef("n2", n2, "b")]
    n1.refuse["c"] = "dump"
    with pytest.raises(CheckpointError) as failed:
        cut.take(parts, "job")
    said = str(failed.value)
    assert "\n" not in said
    assert said.startswith("no checkpoint of job taken: its part c on n1 could not be dumped")
    assert said.endswith("the other parts' checkpoints were deleted and every part runs on")
    assert n1.deleted == ["ck-n1-a"] and n2.deleted == ["ck-n2-b"]
    assert sorted(j for op, _, j in n1.log if op == "thaw") == ["a", "b", "c"]
    # A part that cannot be frozen: the frozen ones thawed, nothing dumped.
    n1.log.clear()
    n1.refuse["c"] = "freeze"
    with pytest.raises(CheckpointError, match="its part c on n1 could not be frozen"):
        cut.take(parts, "job")
    assert "dump" not in _ops(n1)
    assert sorted(j for op, _, j in n1.log if op == "thaw") == ["a", "b"]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(str(tmp_path / "store"), staging_root=tmp_path / "staging", keep=0)


def _publish(
    store: Store,
    label: str,
    minutes: int,
    address: int | None,
    record: tuple[int, str] | None,
    net: JobNet = NET,
    job: str = "7",
    token: str = "1-1",
) -> Manifest:
    """A part's checkpoint of a cut as a daemon publishes it: its job address .`address`, its
    cut's record (parts, key)."""
    # job "": a part the launch agent started (a daemon's job: no Slurm record).
    extra: dict[str, Any] = slurm_extra(job, token, False, "/o", "/o") if job else {}
    if record is not None:
        extra["cut"] = {"parts": record[0], "key": record[1]}
    job_net = None if address is None else {"vni": net.vni, "address": str(net.address(address))}
    info = make_info(label, minutes=minutes, uid=1000, extra=extra, job_net=job_net)
    stage(store, info, SMALL_FILES)
    return store.publish(info)


def _cut(
    store: Store, cut_id: str, minutes: int, parts: list[tuple[int, str]], count: int = 0
) -> list[Manifest]:
    """A cut of job label 'job': one checkpoint per (address index, key), each recording
    `count` parts (default: as many as given)."""
    label = cut.cut_label("job", cut_id)
    n = count or len(parts)
    return [_publish(store, label, minutes, a, (n, k)) for a, k in parts]


def test_restore_plan_by_counts_and_keys(store: Store) -> None:
    # The batch part and a second part on the batch node (.1), one on the second node (.2).
    whole = _cut(store, "1-a", 0, [(0, "batch"), (0, "k1"), (1, "k2")])
    newer = _cut(store, "2-b", 5, [(0, "batch"), (1, "k2")])
    _cut(store, "3-c", 10, [(0, "batch"), (1, "k2")], count=3)  # a part missing
    _cut(store, "4-d", 11, [(1, "k1"), (1, "k2")])  # the batch node's parts missing
    _cut(store, "5-e", 12, [(0, "batch"), (1, "batch")])  # a key twice
    _cut(store, "6-f", 13, [(0, "batch"), (1, "k1"), (2, "k2")])  # taken on three nodes
    other = cut.cut_label("job", "7-g")
    _publish(store, other, 14, 0, (2, "batch"))
    _publish(store, other, 14, 1, (2, "k2"), net=OTHER_NET)  # another job network's
    mixed = cut.cut_label("job", "8-h")
    _publish(store, mixed, 15, 0, (2, "batch"))
    _publish(store, mixed, 15, 1, None)  # one without its record
    _cut(store, "9-i", 16, [(0, "batch"), (1, "k2")], count=1)  # a count no cut has
    manifests = store.list()
    # The job now on n3 (.1) and n1 (.2): each checkpoint goes to the node with its address.
    plans = cut.restore_plan(manifests, "job", NET, ["n3", "n1"])
    assert [p.label for p in plans] == [newer[0].label, whole[0].label]
    assert plans[0].parts == [("n3", newer[0].id), ("n1", newer[1].id)]
    assert plans[0].keys == ["batch", "k2"]
    assert plans[1].parts == [("n3", whole[0].id), ("n3", whole[1].id), ("n1", whole[2].id)]
    assert plans[1].keys == ["batch", "k1", "k2"]
    # In the other order of nodes, the same checkpoints on the other nodes.
    flipped = cut.restore_plan(manifests, "job", NET, ["n1", "n3"])[1]
    assert flipped.parts == [("n1", whole[0].id), ("n1", whole[1].id), ("n3", whole[2].id)]
    # On three nodes, the one taken on three too, and those on two (the third node gets
    # nothing); on one node, none; in another network, none.
    assert [p.label for p in cut.restore_plan(manifests, "job", NET, ["a", "b", "c"])] == [
        cut.cut_label("job", "6-f"),
        newer[0].label,
        whole[0].label,
    ]
    assert cut.restore_plan(manifests, "job", NET, ["a"]) == []
    assert cut.restore_plan(manifests, "job", OTHER_NET, ["a", "b"]) == []
    # Another job label's cuts are not this job's.
    assert cut.restore_plan(manifests, "jo", NET, ["n3", "n1"]) == []


def test_restore_plan_of_cuts_taken_before_they_were_recorded(store: Store) -> None:
    old = cut.cut_label("job", "1-a")
    taken = [_publish(store, old, 0, 1, None), _publish(store, old, 0, 0, None)]
    short = cut.cut_label("job", "2-b")
    _publish(store, short, 1, 0, None)  # one part of two
    twice = cut.cut_label("job", "3-c")
    _publish(store, twice, 2, 0, None)
    _publish(store, twice, 2, 0, None)  # two at one address
    plans = cut.restore_plan(store.list(), "job", NET, ["n2", "n1"])
    assert [(p.label, p.parts, p.keys) for p in plans] == [
        (old, [("n2", taken[1].id), ("n1", taken[0].id)], ["", ""])
    ]
    assert cut.restore_plan(store.list(), "job", NET, ["n1", "n2", "n3"]) == []


def test_prune_keeps_the_newest_complete_cuts_and_any_newer_incomplete_one(
    store: Store,
) -> None:
    two = [(0, "batch"), (1, "k")]
    oldest = _cut(store, "1-a", 0, two)
    early = _cut(store, "2-b", 1, two, count=3)  # incomplete, older than complete ones
    middle = _cut(store, "3-c", 2, two)
    newest = _cut(store, "4-d", 3, two)
    taking = _cut(store, "5-e", 4, [(0, "batch")], count=2)  # incomplete: maybe being taken
    old = cut.cut_label("job", "0-z")  # before records: complete with a part per address
    before = [_publish(store, old, -1, 0, None), _publish(store, old, -1, 1, None)]
    _publish(store, "job", 5, 0, None)  # the job's own label: no cut of it
    manifests = store.list()

    def _ids(*cuts: list[Manifest]) -> set[str]:
        return {m.id for c in cuts for m in c}

    deleted = cut.prune(manifests, "job", keep=2)
    assert set(deleted) == _ids(before, oldest, early) and len(deleted) == 6
    assert set(cut.prune(manifests, "job", keep=1)) == _ids(before, oldest, early, middle)
    assert cut.prune(manifests, "job", keep=5) == sorted(m.id for m in early)
    assert not _ids(newest, taking) & set(cut.prune(manifests, "job", keep=1))
    # No complete cut: nothing deleted (every one may still be the job's only chance).
    assert cut.prune([*early, *taking], "job", keep=1) == []
    with pytest.raises(UsageError, match="keep 1 at least"):
        cut.prune(manifests, "job", keep=0)


def test_cut_candidates_are_this_jobs_cuts_by_the_rule_of_candidates(store: Store) -> None:
    label = cut.cut_label("7", "1-a")
    mine = [_publish(store, label, m, 0, (3, f"k{m}")) for m in (0, 1)]
    # A part the launch agent started records no Slurm job: its cut's batch tree does.
    mine.append(_publish(store, label, 2, 1, (3, "k2"), job=""))
    _publish(store, cut.cut_label("7", "1-b"), 2, 0, (1, "x"), token="2-2")  # id reused
    _publish(store, cut.cut_label("7", "1-c"), 3, 0, (1, "y"), job="8")  # another job's
    mixed = cut.cut_label("7", "1-d")  # one of its checkpoints another job's: none of it
    _publish(store, mixed, 3, 0, (2, "a"))
    _publish(store, mixed, 3, 1, (2, "b"), job="8")
    _publish(store, cut.cut_label("7", "1-e"), 3, 1, (1, "z"), job="")  # no Slurm job at all
    _publish(store, "7", 4, 0, None)  # the job's own label, not a cut's
    found = cut_candidates(store.list(uid=1000), "7", False, 1000, "7", "1-1")
    assert [m.id for m in found] == [mine[2].id, mine[1].id, mine[0].id]
    assert cut_candidates(store.list(uid=1000), "7", False, 1001, "7", "1-1") == []
    # An explicit label: any of the user's Slurm jobs' cuts of that label.
    # (a cut without a Slurm job's checkpoint is none's)
    assert len(cut_candidates(store.list(uid=1000), "7", True, 1000, "9", "9-9")) == 7


def test_a_dumps_cut_record_is_bounded_where_the_daemons_validate_it() -> None:
    ok = DumpRequest(frozen=True, cut_parts=3, cut_key="n1/0123456789ab")
    assert (ok.cut_parts, ok.cut_key) == (3, "n1/0123456789ab")
    assert DumpRequest().cut_parts is None and DumpRequest().cut_key is None
    for bad in [{"cut_parts": 1}, {"cut_parts": 5000}, {"cut_key": "a b"}, {"cut_key": "/x"}]:
        with pytest.raises(ValidationError):
            DumpRequest(frozen=True, **bad)  # type: ignore[arg-type]
        with pytest.raises(ValidationError):
            PartDumpRequest(credential="c", label="l", **bad)  # type: ignore[arg-type]
