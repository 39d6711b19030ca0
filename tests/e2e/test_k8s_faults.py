"""Containers under faults (issue 28), through containerd's real runc shim with the stasis
runtime (`stasis-dev local-node`): the daemon SIGKILLed at named points of the stop and
interval checkpoints and of a create's restore, the store full or unreadable, the daemon down
at a create. What each checks: the container runs once with its state, or a checkpoint it can
resume from is listed; nothing stays paused; nothing runs twice; a label is retired only when
the container succeeded and nobody asked it to stop.

One node for the module (containerd, the daemon), its store on a small tmpfs of its own so a
test can fill it."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.config import Settings
from stasis.daemon import detached
from stasis.k8s.runc import namespace_uid
from tests.conftest import STASIS as STASIS_CLI
from tests.conftest import wait_for
from tests.e2e.containerd_node import Node, numbers
from tests.faults.kit import tree_pids_of

# Counts in memory (never re-read from disk); $0 is a token that names its processes.
COUNTER = "i=0; while :; do i=$((i+1)); echo n=$i; sleep 0.1; done"
# The same, but SIGTERM ends it with 0 once /data/go exists (a clean exit the app chose).
TRAPS_TERM = "trap 'while [ ! -e /data/go ]; do sleep 0.1; done; exit 0' TERM; " + COUNTER
STORE_WAIT_S = 8  # how long a create waits for a store or daemon it cannot ask (short here)


class FaultNode(Node):
    """The node, with its config rewritten (not appended to) to arm fault points."""

    def __init__(self, root: Path) -> None:
        # A host of its own: runc's state and CRIU's cache in its /run, as on a real node.
        super().__init__(root, min_interval_s=2, separate=True)
        self.base = ""
        self.store = root / "stasis" / "store"

    def up(self) -> None:
        # A store of its own size (and mode: root's alone, as the store demands).
        self.store.mkdir(parents=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=48m,mode=0755", "tmpfs", str(self.store)],
            check=True,
        )
        super().up()
        self.base = self.lay.stasis_config.read_text()
        self.arm()

    @property
    def pid(self) -> int | None:
        return detached.read_pid(self.lay.stasis / "daemon.pid")

    def arm(self, *points: str) -> None:
        """The daemon started again with `points` armed (none: disarmed)."""
        extra = ""
        if "store_wait_s" in Settings._fields:
            extra += f"store_wait_s = {STORE_WAIT_S}\n"
        if points:
            extra += f"test_fault_points = {json.dumps(list(points))}\n"
        self.lay.stasis_config.write_text(self.base + extra)
        detached.stop(self.pid)
        self.restart_daemon()

    def died(self, timeout_s: float = 30) -> None:
        pid = self.pid
        wait_for(lambda: not detached.alive(pid), timeout_s, "the daemon to die at its point")

    def frozen(self, cid: str) -> str | None:
        """runc's status of `cid` (containerd's shim does not know of a pause it did not do)."""
        r = self.inside(
            "runc", "--root", f"/run/containerd/runc/{self.info['namespace']}", "state", cid
        )
        return str(json.loads(r.stdout)["status"]) if r.returncode == 0 else None

    def log(self) -> str:
        return (self.lay.stasis / "daemon.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def node() -> Iterator[FaultNode]:
    n = FaultNode(Path(tempfile.mkdtemp(prefix="stasis-faults-")))
    try:
        n.up()
        yield n
    finally:
        n.down()  # unmounts the store's tmpfs too


def dump(node: Node, cid: str) -> str:
    r = node.stasis("dump", "--container", cid, "--leave-running", "--json")
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["checkpoint"])


def ended(node: FaultNode, cid: str) -> None:
    wait_for(lambda: node.status(cid) == "STOPPED", 20, f"container {cid} to end")


def started(node: Node, cid: str, script: str, env: dict[str, str]) -> Path:
    log = node.run(cid, script, env=env)
    wait_for(lambda: len(numbers(log)) >= 3, 20, f"container {cid} to count")
    return log


def heard(node: FaultNode, cid: str, label: str) -> None:
    """Give the daemon time to hear of the container's end (it may have missed the event when
    the container ended while it started: then there is nothing to wait for)."""
    deadline = time.monotonic() + 10
    while (
        time.monotonic() < deadline
        and f"container {cid} exited" not in node.log()
        and node.checkpoint_ids(label)
    ):
        time.sleep(0.3)


def fill(path: Path) -> Path:
    """Fill the filesystem of `path` to the last byte; the file that does it."""
    filler = path / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True)
    return filler


def test_a_container_that_exits_0_after_its_stop_checkpoint_failed_keeps_its_label(
    node: FaultNode,
) -> None:
    """The store is full when the pod is deleted: no stop checkpoint. The app traps SIGTERM and
    exits 0: that is no success to retire the label for (the next start resumes)."""
    label, cid = f"full-{secrets.token_hex(3)}", "c-full"
    started(node, cid, TRAPS_TERM, {"STASIS_CHECKPOINT": label})
    first = dump(node, cid)
    filler = fill(node.store)
    try:
        node.ctr("tasks", "kill", "-s", "SIGTERM", cid, timeout_s=60)  # the stop: fails
    finally:
        filler.unlink()
    assert node.checkpoint_ids(label) == [first]
    node.ctr("tasks", "exec", "--exec-id", "go", cid, "/bin/sh", "-c", "touch /data/go")
    ended(node, cid)
    heard(node, cid, label)
    assert node.checkpoint_ids(label) == [first], node.log()[-1500:]
    node.remove(cid)


def test_a_leave_running_checkpoint_cut_by_a_daemon_kill_leaves_the_container_running(
    node: FaultNode,
) -> None:
    """An interval's, a cordon's or a by-hand checkpoint (one path: leave-running) whose
    daemon dies with the container paused. (With an interval, the next interval's checkpoint
    would thaw it by chance; by hand, nothing would.)"""
    label, cid = f"intkill-{secrets.token_hex(3)}", "c-intkill"
    log = started(node, cid, COUNTER, {"STASIS_CHECKPOINT": label})
    node.arm("k8s.interval.after-dump")
    by_hand = subprocess.Popen(
        [STASIS_CLI, "dump", "--container", cid, "--leave-running"],
        env={**os.environ, "STASIS_CONFIG": node.info["stasis_config"]},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    node.died()
    _, err = by_hand.communicate(timeout=30)
    assert by_hand.returncode != 0 and "cannot reach the stasis daemon" in err, err
    assert node.frozen(cid) == "paused"  # by the checkpoint the daemon died in
    node.arm()  # started again: it settles what it had frozen
    wait_for(lambda: node.frozen(cid) == "running", 20, "the container to run again")
    counted = len(numbers(log))
    wait_for(lambda: len(numbers(log)) > counted + 3, 10, "the counter to go on")
    node.stop(cid)
    node.remove(cid)


def test_a_stop_checkpoint_cut_before_its_publish_resumes_and_keeps_the_label(
    node: FaultNode,
) -> None:
    """Killed with the container frozen and nothing published: the daemon started again
    thaws it, the stop's SIGTERM ends it (with 0: it trapped it), the label keeps its
    checkpoint, and the next start resumes from it."""
    label, cid = f"stopcut-{secrets.token_hex(3)}", "c-stopcut"
    log = started(node, cid, TRAPS_TERM, {"STASIS_CHECKPOINT": label})
    first = dump(node, cid)
    node.ctr("tasks", "exec", "--exec-id", "go", cid, "/bin/sh", "-c", "touch /data/go")
    node.arm("k8s.stop.after-dump")
    node.ctr("tasks", "kill", "-s", "SIGTERM", cid, timeout_s=60)
    node.died()
    node.arm()
    ended(node, cid)
    heard(node, cid, label)
    assert node.checkpoint_ids(label) == [first]
    node.remove(cid)
    again = node.run(cid, TRAPS_TERM, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: len(numbers(again)) >= 2, 20, "the resumed counter")
    assert f"restored from checkpoint {first}" in again.read_text()
    assert 1 < numbers(again)[0] <= numbers(log)[-1]
    node.ctr("tasks", "kill", "-s", "SIGKILL", cid)
    ended(node, cid)
    node.remove(cid)


def test_a_stop_checkpoint_cut_after_its_publish_ends_the_container_at_its_checkpoint(
    node: FaultNode,
) -> None:
    """Killed after the publish, the container still frozen: the daemon started again ends it
    (it never runs past its checkpoint), and the next start resumes exactly there, once."""
    label, cid = f"stoppub-{secrets.token_hex(3)}", "c-stoppub"
    token = secrets.token_hex(4)
    log = started(node, cid, f": {token}; " + COUNTER, {"STASIS_CHECKPOINT": label})
    node.arm("k8s.stop.after-publish")
    node.ctr("tasks", "kill", "-s", "SIGTERM", cid, timeout_s=60)
    node.died()
    assert node.frozen(cid) == "paused"
    node.arm()
    ended(node, cid)
    (published,) = node.checkpoint_ids(label)
    before = numbers(log)
    node.remove(cid)
    again = node.run(cid, COUNTER, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: len(numbers(again)) >= 2, 20, "the resumed counter")
    assert f"restored from checkpoint {published}" in again.read_text()
    assert numbers(again)[0] == before[-1] + 1
    assert len([p for p in tree_pids_of(token) if _is_shell(p)]) == 1  # not twice
    node.ctr("tasks", "kill", "-s", "SIGKILL", cid)
    ended(node, cid)
    node.remove(cid)


def _is_shell(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"/bin/sh")
    except OSError:
        return False


def _stopped_with_checkpoint(node: FaultNode, cid: str, label: str) -> tuple[str, list[int]]:
    log = started(node, cid, COUNTER, {"STASIS_CHECKPOINT": label})
    node.stop(cid)
    (ckpt,) = node.checkpoint_ids(label)
    node.remove(cid)
    return ckpt, numbers(log)


def _create(node: Node, cid: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    log = node.root / f"{cid}-{time.monotonic_ns()}.log"
    envs = [f"--env={k}={v}" for k, v in env.items()]
    return node.ctr(
        "run",
        "-d",
        f"--log-uri=file://{log}",
        f"--runtime={node.info['runtime']}",
        *envs,
        "stasis.test/busybox:1",
        cid,
        "/bin/sh",
        "-c",
        COUNTER,
        timeout_s=120,
    )


def test_without_a_daemon_a_create_waits_then_fails_unless_the_pod_asked_to_start_fresh(
    node: FaultNode,
) -> None:
    label, cid = f"nod-{secrets.token_hex(3)}", "c-nod"
    ckpt, before = _stopped_with_checkpoint(node, cid, label)
    detached.stop(node.pid)
    try:
        began = time.monotonic()
        r = _create(node, cid, {"STASIS_CHECKPOINT": label})
        waited = time.monotonic() - began
        assert r.returncode != 0 and "cannot reach the stasis daemon" in r.stderr, r.stderr
        assert STORE_WAIT_S - 1 <= waited <= STORE_WAIT_S + 30, waited
        assert node.status(cid) in (None, "STOPPED")
        node.remove(cid)
        # Asked to start fresh when stasis cannot tell: it does, and says so.
        fresh = node.run(
            cid, COUNTER, env={"STASIS_CHECKPOINT": label, "STASIS_FRESH": "if-unreachable"}
        )
        wait_for(lambda: len(numbers(fresh)) >= 2, 20, "the fresh counter")
        assert numbers(fresh)[0] == 1 and "starting fresh" in fresh.read_text()
        node.ctr("tasks", "kill", "-s", "SIGKILL", cid)
        ended(node, cid)
        node.remove(cid)
    finally:
        node.restart_daemon()
    assert node.checkpoint_ids(label) == [ckpt]

    # The daemon back within the wait: the create resumes the checkpoint.
    detached.stop(node.pid)
    threading.Timer(1.5, node.restart_daemon).start()
    log = node.run(cid, COUNTER, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: len(numbers(log)) >= 2, 20, "the resumed counter")
    assert numbers(log)[0] == before[-1] + 1
    node.ctr("tasks", "kill", "-s", "SIGKILL", cid)
    ended(node, cid)
    node.remove(cid)


def test_a_store_that_cannot_be_read_at_create_fails_it_naming_the_store(node: FaultNode) -> None:
    label, cid = f"unread-{secrets.token_hex(3)}", "c-unread"
    ckpt, before = _stopped_with_checkpoint(node, cid, label)
    # The label's index cannot be listed (an I/O error of the store, played by a file
    # where its directory is).
    index = node.store / ".index" / label / str(namespace_uid("stasis"))
    aside = index.with_name("aside")
    index.rename(aside)
    index.write_text("")
    try:
        r = _create(node, cid, {"STASIS_CHECKPOINT": label})
        assert r.returncode != 0, r.stdout
        assert f"cannot list checkpoints in {node.store}" in r.stderr, r.stderr
        node.remove(cid)
    finally:
        index.unlink()
        aside.rename(index)
    assert node.checkpoint_ids(label) == [ckpt]
    log = node.run(cid, COUNTER, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: len(numbers(log)) >= 2, 20, "the resumed counter")
    assert numbers(log)[0] == before[-1] + 1
    node.ctr("tasks", "kill", "-s", "SIGKILL", cid)
    ended(node, cid)
    node.remove(cid)


def test_a_daemon_killed_while_planning_a_restore_resumes_the_container_once(
    node: FaultNode,
) -> None:
    label, cid = f"plan-{secrets.token_hex(3)}", "c-plan"
    token = secrets.token_hex(4)
    log = started(node, cid, f": {token}; " + COUNTER, {"STASIS_CHECKPOINT": label})
    node.stop(cid)
    before = numbers(log)
    node.remove(cid)
    node.arm("k8s.restore.planned")
    out = node.root / f"{cid}.log"
    create = subprocess.Popen(
        [
            "ctr",
            "-a",
            node.info["containerd_address"],
            "-n",
            node.info["namespace"],
            "run",
            "-d",
            f"--log-uri=file://{out}",
            f"--runtime={node.info['runtime']}",
            f"--env=STASIS_CHECKPOINT={label}",
            "stasis.test/busybox:1",
            cid,
            "/bin/sh",
            "-c",
            COUNTER,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    node.died()
    node.arm()  # back within the create's wait
    _, err = create.communicate(timeout=120)
    assert create.returncode == 0, err
    wait_for(lambda: len(numbers(out)) >= 2, 20, "the resumed counter")
    assert numbers(out)[0] == before[-1] + 1
    assert len([p for p in tree_pids_of(token) if _is_shell(p)]) == 1
    node.ctr("tasks", "kill", "-s", "SIGKILL", cid)
    ended(node, cid)
    node.remove(cid)


def test_a_stop_whose_database_write_fails_after_the_publish_still_stops_the_container(
    node: FaultNode,
) -> None:
    """The daemon's database is write-locked by another process (an admin's sqlite3, a
    backup) through the stop: the checkpoint is published, the container ends at it (not
    frozen, not running on), the runtime hears of no failure, and the next start resumes."""
    label, cid = f"dblock-{secrets.token_hex(3)}", "c-dblock"
    log = started(node, cid, COUNTER, {"STASIS_CHECKPOINT": label})
    holder = sqlite3.connect(node.lay.stasis / "state" / "jobs.db", isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # the write lock, held
        r = node.ctr("tasks", "kill", "-s", "SIGTERM", cid, timeout_s=60)
        assert r.returncode == 0, r.stderr
        ended(node, cid)
        assert node.frozen(cid) in (None, "stopped")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    (published,) = node.checkpoint_ids(label)
    assert "internal error" not in log.read_text()
    assert f"checkpoint {published} published, but the database did not record it" in node.log()
    before = numbers(log)
    node.remove(cid)
    again = node.run(cid, COUNTER, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: len(numbers(again)) >= 2, 20, "the resumed counter")
    assert numbers(again)[0] == before[-1] + 1
    node.ctr("tasks", "kill", "-s", "SIGKILL", cid)
    ended(node, cid)
    node.remove(cid)


def test_a_runtime_killed_right_after_its_restore_leaves_the_container_running_once(
    node: FaultNode,
) -> None:
    """stasis-runc SIGKILLed between `runc restore` and its answer to containerd: the create
    fails (the kubelet creates again), and whatever runs of the checkpoint runs once."""
    label, cid = f"rtkill-{secrets.token_hex(3)}", "c-rtkill"
    token = secrets.token_hex(4)
    log = started(node, cid, f": {token}; " + COUNTER, {"STASIS_CHECKPOINT": label})
    node.stop(cid)
    before = numbers(log)
    node.remove(cid)
    node.arm("k8s.create.after-restore")
    r = _create(node, cid, {"STASIS_CHECKPOINT": label})
    assert r.returncode != 0 and "exit status 137" in r.stderr, r.stderr
    node.arm()
    # containerd deleted what the killed create left: the restored tree did not survive it.
    assert node.frozen(cid) is None
    assert [p for p in tree_pids_of(token) if _is_shell(p)] == []
    node.remove(cid)
    again = node.run(cid, COUNTER, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: len(numbers(again)) >= 2, 20, "the resumed counter")
    assert numbers(again)[0] == before[-1] + 1
    assert len([p for p in tree_pids_of(token) if _is_shell(p)]) == 1, [
        p for p in tree_pids_of(token) if _is_shell(p)
    ]
    node.ctr("tasks", "kill", "-s", "SIGKILL", cid)
    ended(node, cid)
    node.remove(cid)


# Counts until /data/go exists, then ends with 0 of its own accord (its work done).
COUNTS_TILL_GO = (
    "i=0; while [ ! -e /data/go ]; do i=$((i+1)); echo n=$i; sleep 0.1; done; " "exit 0"
)


def test_a_restored_containers_checkpoint_names_its_parent_and_retiring_keeps_a_pinned_one(
    node: FaultNode,
) -> None:
    """Lineage: the checkpoint of a container restored from P names P as its parent (the
    label's order follows that, not the nodes' clocks). Retirement: the container's genuine
    success retires its label, except a checkpoint a restore (on another node) pinned."""
    label, cid = f"lineage-{secrets.token_hex(3)}", "c-lineage"
    log = started(node, cid, COUNTS_TILL_GO, {"STASIS_CHECKPOINT": label})
    node.stop(cid)
    (stop,) = node.checkpoint_ids(label)
    before = numbers(log)
    node.remove(cid)
    again = node.run(cid, COUNTS_TILL_GO, env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: len(numbers(again)) >= 2, 20, "the resumed counter")
    assert numbers(again)[0] == before[-1] + 1
    child = dump(node, cid)
    listed = {c["id"]: c for c in json.loads(node.stasis("checkpoints", "--json").stdout)}
    assert listed[child]["parent"] == stop, listed[child]
    assert listed[stop]["parent"] is None  # its run started fresh
    # Another node restores `stop` now: its pin, as Store.pin writes it.
    pin = node.store / stop / "pin-elsewhere.json"
    pin.write_text(json.dumps({"host": "elsewhere", "pid": 1, "why": "restore"}))
    try:
        node.ctr("tasks", "exec", "--exec-id", "go", cid, "/bin/sh", "-c", "touch /data/go")
        ended(node, cid)
        wait_for(
            lambda: f"container {cid} exited 0: label {label} retired" in node.log(),
            20,
            "the label retired",
        )
        assert node.checkpoint_ids(label) == [stop], "a pinned checkpoint was retired"
    finally:
        pin.unlink()
    node.stasis("checkpoints", "rm", stop)
    node.remove(cid)
