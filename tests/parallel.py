"""`make test` on two workers (pytest-xdist, `-n 2 --dist loadgroup`): what may run beside what.

The tests mostly wait (on Slurm's clocks, on grace periods, on CRIU), so two workers halve the
suite's time on two cores. What decides where a test runs:

- **A module is one unit** (its module fixtures, a daemon or a Slurm cluster, are made once, on
  one worker), not each test by itself as `loadgroup` would have it.
- **The early modules are one group, on the first worker** (`gw0`), taken late: their work
  starts at collection (tests/e2e/conftest.py, `Early`) in the worker that will take its
  results, and goes on while that worker runs other modules (each worker collects every test:
  started on both, the clusters would run twice).
- **Exclusive modules run alone**: a read-write lock on the machine that every test holds shared
  and an exclusive module's test holds exclusively. These are the tests whose job's mount
  namespace is a slave copy of the machine's (a mount anywhere in the machine propagates into it
  mid-dump: "mnt-v2: Failed to open_tree"), the test that compares the machine's firewall rules
  and mounts before and after `verify`, the one that loads the node's disk on purpose, and the
  benchmarks' timed runs. A gate in front of the lock keeps a stream of shared holders from
  starving an exclusive one.

Run without `-n` (`make test-serial`), none of this applies."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

EARLY_GROUP = "early"
# Modules whose work starts at collection (tests/e2e/conftest.py EARLY, debian13.start_build).
EARLY_MODULES = frozenset(
    {
        "tests/e2e/test_hostile_step_book.py",
        "tests/e2e/test_job_id_reuse.py",
        "tests/e2e/test_mpi_cut.py",
        "tests/e2e/test_mpi_cut_faults.py",
        "tests/e2e/test_slurm_cgroup.py",
        "tests/e2e/test_slurm_debian13.py",
        "tests/e2e/test_slurm_jobs.py",
        "tests/e2e/test_slurm_poc.py",
        "tests/e2e/test_slurm_remote.py",
        "tests/e2e/test_slurm_report.py",
        "tests/e2e/test_time_limit.py",
    }
)
# Both use the fixed bridge of the local Kubernetes nodes (k8snode.LOCAL_NET), and one asserts
# that it is gone after its last node.
SAME_WORKER = {
    "tests/e2e/test_k8s_local_nodes.py": "k8s-localnet",
    "tests/e2e/test_k8s_faults.py": "k8s-localnet",
}
EXCLUSIVE = frozenset(
    {
        "tests/engine/test_privatetmp.py",
        "tests/daemon/test_private_tmp.py",
        "tests/daemon/test_verify.py",
        "tests/daemon/test_freeze_staging.py",
        "tests/e2e/test_slurm_job_container.py",
    }
)
EXCLUSIVE_DIRS = ("tests/bench/",)
FIRST_WORKER = "gw0"
# Units handed out first: the slow ones, so that no long module is left for the end alone.
SLOW_FIRST = ("tests/e2e/", "tests/faults/", "tests/controlplane/", "tests/k8s/")
_WORKER_INPUT = "stasis_locks"


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def is_exclusive(module: str) -> bool:
    return module in EXCLUSIVE or module.startswith(EXCLUSIVE_DIRS)


def group_of(module: str) -> str | None:
    if module in EARLY_MODULES:
        return EARLY_GROUP
    return SAME_WORKER.get(module)


def mark_groups(items: list[pytest.Item]) -> None:
    """Before xdist suffixes the grouped node ids (`@group`): must be the same on every worker,
    or xdist stops with "Different tests collected"."""
    for item in items:
        group = group_of(module_of(item.nodeid))
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def worker_id(config: pytest.Config) -> str | None:
    """This worker's id (`gw0`, ...), or None in the controller and in a run without xdist."""
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    return None if workerinput is None else str(workerinput["workerid"])


def is_controller(config: pytest.Config) -> bool:
    """Whether this process hands the tests out to workers (as xdist's own check says)."""
    return (
        worker_id(config) is None
        and not config.option.collectonly
        and getattr(config.option, "dist", "no") != "no"
        and bool(getattr(config.option, "tx", None))
    )


def starts_early_work(config: pytest.Config) -> bool:
    """Whether this process runs the early modules: the only one without xdist, the first
    worker with it."""
    found = worker_id(config)
    return found is None or found == FIRST_WORKER


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadGroupScheduling  # type: ignore[import-untyped]

    class ModuleScheduling(LoadGroupScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return nodeid.split("@")[-1]
            return module_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            sizes = {unit: len(tests) for unit, tests in self.workqueue.items()}
            scope = next_unit(sizes, len(self.collection or ()), node.gateway.id)
            if scope is None:
                return  # this worker waits: it is shut down with the others at the end
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


# The first worker takes the early group once no more than this share of the tests is left for
# the other: the early work (started at collection) is done by then, as it was when the early
# modules' tests came last in file order, and the other worker still has work meanwhile.
EARLY_WHEN_LEFT = 0.25


def next_unit(queued: dict[str, int], total: int, worker: str) -> str | None:
    """The unit `worker` takes next from `queued` (unit: its number of tests; `total` tests in
    all), None for none: the early group on the first worker only, late; the slow directories
    first."""
    others = [u for u in queued if u != EARLY_GROUP]
    if EARLY_GROUP in queued and worker == FIRST_WORKER:
        if not others or sum(queued[u] for u in others) <= EARLY_WHEN_LEFT * total:
            return EARLY_GROUP
    if not others:
        return None
    for prefix in SLOW_FIRST:
        for unit in others:
            if unit.startswith(prefix):
                return unit
    return others[0]


class MachineLock:
    """The read-write lock of section "exclusive" above, on two files every worker opens."""

    def __init__(self, directory: Path) -> None:
        self._gate = os.open(directory / "gate", os.O_RDWR | os.O_CREAT, 0o600)
        self._lock = os.open(directory / "machine", os.O_RDWR | os.O_CREAT, 0o600)

    def hold(self, exclusive: bool) -> None:
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)

    def release(self) -> None:
        fcntl.flock(self._lock, fcntl.LOCK_UN)


_lock: MachineLock | None = None


def configure_node(node: Any, directory: Path) -> None:
    node.workerinput[_WORKER_INPUT] = str(directory)


def lock_directory() -> Path:
    return Path(tempfile.mkdtemp(prefix="stasis-xdist-"))


def around_test(item: pytest.Item) -> Generator[None, None, None]:
    """Holds the machine's lock around one test's whole protocol (its module fixtures' setup
    and teardown included), in a worker."""
    global _lock
    workerinput: dict[str, Any] | None = getattr(item.config, "workerinput", None)
    if workerinput is None or _WORKER_INPUT not in workerinput:
        yield
        return
    if _lock is None:
        _lock = MachineLock(Path(workerinput[_WORKER_INPUT]))
    _lock.hold(is_exclusive(module_of(item.nodeid.split("@")[0])))
    try:
        yield
    finally:
        _lock.release()
