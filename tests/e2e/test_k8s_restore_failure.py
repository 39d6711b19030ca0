"""A `runc restore` that fails on a good checkpoint (issue 28): the container is not started
fresh. Its create fails (the kubelet retries it with backoff), naming the checkpoint and what to
do; the pod gets a Warning event; the checkpoint stays. Once the cause is gone the next create
resumes it. After `k8s_restore_attempts` failed restores of one checkpoint on this node, the
label's previous checkpoint is tried; when none is left, only the container's STASIS_FRESH
starts it from nothing.

Through containerd's real runc shim with the stasis runtime (`stasis-dev local-node`), real
runc and CRIU, and kmock's API server for the pod's events. What makes the restore fail is
real: the checkpointed process holds a file of a bind-mounted volume (a hostPath) open, and
that file is gone from the volume when the container is created again (CRIU: "Can't open
file"); put back, the restore works."""

from __future__ import annotations

import json
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.e2e.containerd_node import IMAGE, Node, numbers
from tests.k8s.apiserver import ApiServer
from tests.k8s.chart_rbac import agent_rules

NODE = "k8s-node-r"
NS = "stasis"  # the local node's containerd namespace: the containers' namespace
ATTEMPTS = 2  # k8s_restore_attempts here (3 by default)
COUNTER = "i=0; while :; do i=$((i+1)); echo n=$i; sleep 0.1; done"


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Node, ApiServer]]:
    root = Path(tempfile.mkdtemp(prefix="stasis-k8s-restorefail-"))
    api = ApiServer(root)
    node = Node(
        root / "node", min_interval_s=2, kubeconfig=root / "kubeconfig-stasis-agent", node_name=NODE
    )
    try:
        api.start()
        # The daemon's calls are the chart's service account's, with the chart's RBAC.
        assert api.authorize("stasis-agent", agent_rules()) == root / "kubeconfig-stasis-agent"
        api.add_ready_node(NODE)
        node.up()
        node.configure({"k8s_restore_attempts": ATTEMPTS})
        yield node, api
    finally:
        api.stop()
        node.down()


def volume(node: Node, name: str) -> Path:
    """A hostPath volume with the file the container holds open."""
    vol = node.root / name
    vol.mkdir()
    (vol / "held").write_text("the app's lock file\n")
    return vol


def pod_options(vol: Path, pod: str) -> list[str]:
    """What the kubelet would give the container: the volume, and the pod's CRI annotations."""
    return [
        f"--mount=type=bind,src={vol},dst=/vol,options=rbind:rw",
        f"--annotation=io.kubernetes.cri.sandbox-name={pod}",
        f"--annotation=io.kubernetes.cri.sandbox-namespace={NS}",
    ]


def create(
    node: Node, cid: str, script: str, env: dict[str, str], options: list[str]
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`ctr run -d` as the kubelet's CreateContainer+StartContainer: its answer, and the log."""
    log = node.root / f"{cid}-{time.monotonic_ns()}.log"
    log.touch()
    envs = [f"--env={k}={v}" for k, v in env.items()]
    r = node.ctr(
        "run",
        "-d",
        f"--log-uri=file://{log}",
        f"--runtime={node.info['runtime']}",
        *envs,
        *options,
        IMAGE,
        cid,
        "/bin/sh",
        "-c",
        script,
        timeout_s=120,
    )
    return r, log


def events(api: ApiServer, pod: str) -> list[dict[str, Any]]:
    found = api._call("GET", api._path("events", NS))["items"]
    return [e for e in found if e["involvedObject"]["name"] == pod]


def restore_failed(api: ApiServer, pod: str, checkpoint: str) -> list[dict[str, Any]]:
    return [
        e
        for e in events(api, pod)
        if e.get("reason") == "StasisRestoreFailed" and checkpoint in e.get("message", "")
    ]


def gone(node: Node, cid: str) -> None:
    """The failed create left nothing that runs (containerd cleans up after a failed create)."""
    assert node.status(cid) in (None, "STOPPED"), node.status(cid)
    node.remove(cid)


def kill(node: Node, cid: str) -> None:
    node.ctr("tasks", "kill", "-s", "SIGKILL", cid)
    wait_for(lambda: node.status(cid) == "STOPPED", 20, f"container {cid} to end")
    node.remove(cid)


def test_a_restore_that_fails_on_a_good_checkpoint_fails_the_create_and_resumes_later(
    cluster: tuple[Node, ApiServer],
) -> None:
    node, api = cluster
    label, cid, pod = f"rf-{secrets.token_hex(3)}", "c-rf", "pod-rf"
    vol = volume(node, f"vol-{label}")
    script = "exec 3</vol/held; " + COUNTER
    env = {"STASIS_CHECKPOINT": label}
    r, log = create(node, cid, script, env, pod_options(vol, pod))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: len(numbers(log)) >= 5, 30, "the counter to count")
    node.stop(cid)
    before = numbers(log)
    (ckpt,) = node.checkpoint_ids(label)
    node.remove(cid)

    (vol / "held").rename(vol / "held.aside")  # what the restore needs is gone, for now
    r, failed = create(node, cid, script, env, pod_options(vol, pod))
    # Not started fresh: the create fails (the kubelet retries it), naming the checkpoint.
    assert r.returncode != 0, (r.stdout, failed.read_text())
    assert f"restore of checkpoint {ckpt} failed" in r.stderr, r.stderr
    assert "not started fresh" in r.stderr and f"attempt 1 of {ATTEMPTS}" in r.stderr, r.stderr
    assert "Can't open file vol/held" in r.stderr, r.stderr  # the cause, from CRIU's log
    assert numbers(failed) == [], failed.read_text()
    gone(node, cid)
    # An event on the pod says so, with the checkpoint.
    wait_for(lambda: restore_failed(api, pod, ckpt), 20, "the StasisRestoreFailed event")
    (event,) = restore_failed(api, pod, ckpt)
    assert event["type"] == "Warning" and label in event["message"], event
    assert node.checkpoint_ids(label) == [ckpt]  # the checkpoint stays

    (vol / "held.aside").rename(vol / "held")  # the cause is gone: the next create resumes
    r, again = create(node, cid, script, env, pod_options(vol, pod))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: len(numbers(again)) >= 2, 30, "the resumed counter")
    assert numbers(again)[0] == before[-1] + 1, (before[-3:], numbers(again)[:3])
    assert f"restored from checkpoint {ckpt}" in again.read_text()
    kill(node, cid)


def test_a_checkpoint_that_fails_every_attempt_gives_way_to_the_previous_one(
    cluster: tuple[Node, ApiServer],
) -> None:
    node, api = cluster
    label, cid, pod = f"rfprev-{secrets.token_hex(3)}", "c-rfprev", "pod-rfprev"
    vol = volume(node, f"vol-{label}")
    # Opens the file only from n=40 on: its first checkpoint (before) does not hold it.
    script = (
        "i=0; while :; do i=$((i+1)); echo n=$i; [ $i = 40 ] && exec 3</vol/held; "
        "sleep 0.1; done"
    )
    env = {"STASIS_CHECKPOINT": label}
    r, log = create(node, cid, script, env, pod_options(vol, pod))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: len(numbers(log)) >= 3, 30, "the counter to count")
    first = node.stasis("dump", "--container", cid, "--leave-running", "--json")
    assert first.returncode == 0, first.stderr
    older = json.loads(first.stdout)["checkpoint"]
    wait_for(lambda: len(numbers(log)) >= 45, 30, "the counter to pass 40")
    node.stop(cid)
    newest = numbers(log)[-1]
    (_, stop) = sorted(node.checkpoint_ids(label))
    node.remove(cid)

    (vol / "held").unlink()
    for attempt in range(1, ATTEMPTS + 1):
        r, failed = create(node, cid, script, env, pod_options(vol, pod))
        assert r.returncode != 0 and f"attempt {attempt} of {ATTEMPTS}" in r.stderr, r.stderr
        assert numbers(failed) == []
        gone(node, cid)
    # Given up on that one (on this node): the label's previous checkpoint, not nothing.
    r, log = create(node, cid, script, env, pod_options(vol, pod))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: len(numbers(log)) >= 2, 30, "the counter restored from the older one")
    text = log.read_text()
    assert f"checkpoint {stop} skipped: its restore failed {ATTEMPTS} times" in text, text
    assert f"restored from checkpoint {older}" in text, text
    assert 1 < numbers(log)[0] < 40 < newest, (numbers(log)[:3], newest)
    assert sorted(node.checkpoint_ids(label))[-1] == stop  # still listed, for its owner to see
    kill(node, cid)


def test_when_no_checkpoint_can_be_restored_only_stasis_fresh_starts_from_nothing(
    cluster: tuple[Node, ApiServer],
) -> None:
    node, api = cluster
    label, cid, pod = f"rfnone-{secrets.token_hex(3)}", "c-rfnone", "pod-rfnone"
    vol = volume(node, f"vol-{label}")
    script = "[ -e /vol/held ] && exec 3</vol/held; " + COUNTER
    env = {"STASIS_CHECKPOINT": label}
    r, log = create(node, cid, script, env, pod_options(vol, pod))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: len(numbers(log)) >= 5, 30, "the counter to count")
    node.stop(cid)
    (ckpt,) = node.checkpoint_ids(label)
    node.remove(cid)

    (vol / "held").unlink()
    for _ in range(ATTEMPTS):
        r, _ = create(node, cid, script, env, pod_options(vol, pod))
        assert r.returncode != 0, r.stderr
        gone(node, cid)
    # Every checkpoint given up: still no fresh start without the user's word.
    r, failed = create(node, cid, script, env, pod_options(vol, pod))
    assert r.returncode != 0, failed.read_text()
    assert f"checkpoint {ckpt}" in r.stderr and "STASIS_FRESH" in r.stderr, r.stderr
    assert numbers(failed) == []
    gone(node, cid)
    assert node.checkpoint_ids(label) == [ckpt]
    wait_for(
        lambda: [
            e
            for e in restore_failed(api, pod, ckpt)
            if "none of its checkpoints can be restored" in e["message"]
        ],
        20,
        "the event that no checkpoint of the label can be restored",
    )
    # The user's word: STASIS_FRESH starts it from nothing, and its log says why.
    r, fresh = create(node, cid, script, {**env, "STASIS_FRESH": "1"}, pod_options(vol, pod))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: len(numbers(fresh)) >= 2, 30, "the fresh counter")
    assert numbers(fresh)[0] == 1
    assert f"checkpoint {ckpt}" in fresh.read_text() and "starting fresh" in fresh.read_text()
    kill(node, cid)
