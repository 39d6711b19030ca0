"""Containers through containerd's real runc shim with the stasis runtime (`stasis-dev
local-node`): the way the kubelet stops, deletes and creates them again, driven with `ctr`."""

from __future__ import annotations

import io
import json
import secrets
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stasis.daemon import detached
from tests.conftest import wait_for
from tests.e2e.containerd_node import Node, numbers

# Counts in memory (never re-read from disk), writes a token into its own filesystem once.
COUNTER = "echo token-$0 > /data/made; i=0; while :; do i=$((i+1)); echo n=$i; " "sleep 0.1; done"


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    root = Path(tempfile.mkdtemp(prefix="stasis-node-"))
    n = Node(root, min_interval_s=2)  # the floor on intervals, low for a short test
    try:
        n.up()
        yield n
    finally:
        n.down()


def registered(node: Node) -> list[dict[str, Any]]:
    from stasis.client import Client

    with Client(node.lay.stasis_socket) as c:
        found: list[dict[str, Any]] = c.request("GET", "/k8s/containers")
    return found


def counter(node: Node, cid: str, label: str, token: str = "x") -> Path:
    return node.run(cid, COUNTER.replace("$0", token), env={"STASIS_CHECKPOINT": label})


def test_a_stopped_container_created_again_continues_its_count_and_keeps_its_files(
    node: Node,
) -> None:
    label, token = f"count-{secrets.token_hex(3)}", secrets.token_hex(4)
    log = counter(node, "c-count", label, token)
    wait_for(lambda: len(numbers(log)) >= 8, 20, "the counter to count")
    node.stop("c-count")
    assert node.status("c-count") == "STOPPED"
    before = numbers(log)
    listed = node.stasis("checkpoints", "--json")
    assert listed.returncode == 0, listed.stderr
    mine = [c for c in json.loads(listed.stdout) if c["label"] == label]
    assert [c["user"] for c in mine] == ["k8s:stasis"]
    node.remove("c-count")

    # Created again from the same spec, in a new container (new rootfs snapshot).
    log2 = counter(node, "c-count", label, "second-start")
    wait_for(lambda: len(numbers(log2)) >= 3, 20, "the restored counter to count")
    after = numbers(log2)
    assert "stasis: restored from checkpoint" in log2.read_text()
    assert after[0] == before[-1] + 1, (before[-3:], after[:3])
    assert node.read("c-count", "/data/made").strip() == f"token-{token}"
    node.stop("c-count")
    node.remove("c-count")


def test_a_container_without_the_variable_is_runc_s_alone(node: Node) -> None:
    script = "echo out; echo err >&2; echo hi > /tmp/f; cat /tmp/f; exit 7"
    ours = node.run_attached("c-plain", script)
    plain = node.run_attached("c-plain-runc", script, runtime="io.containerd.runc.v2")
    assert (
        (ours.returncode, ours.stdout, ours.stderr)
        == (plain.returncode, plain.stdout, plain.stderr)
        == (7, "out\nhi\n", "err\n")
    )
    # Its stop signal reaches it (no checkpoint is taken): TERM ends it as with runc.
    log = node.run(
        "c-plain-term", "trap 'echo got-term; exit 3' TERM; " "while :; do sleep 0.1; done"
    )
    wait_for(lambda: node.status("c-plain-term") == "RUNNING", 10, "the container to run")
    node.stop("c-plain-term")
    wait_for(lambda: "got-term" in log.read_text(), 10, "the trap to run")
    node.remove("c-plain-term")
    assert node.stasis("checkpoints").stdout.count("c-plain") == 0


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(node: Node) -> None:
    label = f"fallback-{secrets.token_hex(3)}"
    log = counter(node, "c-fb", label)
    wait_for(lambda: len(numbers(log)) >= 3, 20, "the counter to count")
    first = node.stasis("dump", "--container", "c-fb", "--leave-running", "--json")
    assert first.returncode == 0, first.stderr
    wait_for(lambda: len(numbers(log)) >= 15, 20, "the counter to go on")
    node.stop("c-fb")
    newest = numbers(log)[-1]
    node.remove("c-fb")
    store = Path(node.info["dir"]) / "stasis" / "store"
    ids = sorted(
        p.name
        for p in store.iterdir()
        if p.name[:1].isdigit() and label in (p / "manifest.json").read_text()
    )
    assert len(ids) == 2
    pages = max((store / ids[-1]).glob("pages-*.img"), key=lambda p: p.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(bytes(data))

    log2 = counter(node, "c-fb", label)
    wait_for(lambda: len(numbers(log2)) >= 2, 20, "the restored counter")
    text = log2.read_text()
    assert f"checkpoint {ids[-1]} skipped" in text, text[:500]
    assert f"restored from checkpoint {ids[0]}" in text
    assert numbers(log2)[0] < newest  # from the older checkpoint, not fresh
    assert numbers(log2)[0] > 1
    node.stop("c-fb")
    node.remove("c-fb")


def test_without_a_daemon_a_container_starts_fresh_and_says_so(node: Node) -> None:
    label = f"nodaemon-{secrets.token_hex(3)}"
    pid_file = Path(node.info["dir"]) / "stasis" / "daemon.pid"
    detached.stop(detached.read_pid(pid_file))
    try:
        # Asked to (STASIS_FRESH=if-unreachable): without it, a create that cannot ask waits
        # and fails (issue 28; tests/e2e/test_k8s_faults.py).
        log = node.run(
            "c-nod",
            COUNTER.replace("$0", "x"),
            env={"STASIS_CHECKPOINT": label, "STASIS_FRESH": "if-unreachable"},
        )
        wait_for(lambda: len(numbers(log)) >= 2, 20, "the counter")
        text = log.read_text()
        assert "stasis: cannot ask for a checkpoint of label" in text and "starting fresh" in text
        assert numbers(log)[0] == 1
        # Stopped without a daemon: stopped as usual.
        # (Its shell, the container's PID 1, ignores TERM: the kill after the grace ends it.)
        node.stop("c-nod", grace_s=3)
        assert node.status("c-nod") == "STOPPED"
        node.remove("c-nod")
    finally:
        node.restart_daemon()


def test_stasis_interval_checkpoints_a_running_container_no_more_often_than_the_floor(
    node: Node,
) -> None:
    label = f"interval-{secrets.token_hex(3)}"
    log = node.run(
        "c-int",
        COUNTER.replace("$0", "i"),
        env={"STASIS_CHECKPOINT": label, "STASIS_INTERVAL": "1"},
    )

    # Asked for 1 s, below the node's floor (2 s): raised, and the container's log says so.
    floored = (
        "stasis: checkpoint interval 1 s (STASIS_INTERVAL or the pod's "
        "stasis.dev/interval) is below this node's minimum of 2 s: checkpoints every 2 s"
    )
    wait_for(lambda: floored in log.read_text(), 20, "the floor's line in the container's log")
    (row,) = [c for c in registered(node) if c["container_id"] == "c-int"]
    assert row["interval_s"] == 2
    wait_for(lambda: len(node.checkpoints(label)) >= 2, 30, "two interval checkpoints")
    created = sorted(str(c["created"]) for c in node.checkpoints(label))
    from datetime import datetime

    gap = datetime.fromisoformat(created[1]) - datetime.fromisoformat(created[0])
    assert gap.total_seconds() >= 1.5, created
    assert node.status("c-int") == "RUNNING"
    counted = len(numbers(log))
    wait_for(lambda: len(numbers(log)) > counted + 3, 10, "the counter to go on")
    node.stop("c-int")
    node.remove("c-int")


def test_a_container_that_exits_0_retires_its_label_and_one_that_fails_keeps_it(node: Node) -> None:
    label = f"done-{secrets.token_hex(3)}"

    env = {"STASIS_CHECKPOINT": label}
    node.run("c-done", "while [ ! -e /data/go ]; do sleep 0.1; done; exit $(cat /data/go)", env)
    wait_for(lambda: node.status("c-done") == "RUNNING", 10, "the container to run")
    assert node.stasis("dump", "--container", "c-done", "--leave-running").returncode == 0
    node.ctr("tasks", "exec", "--exec-id", "fail", "c-done", "/bin/sh", "-c", "echo 3 > /data/go")
    wait_for(lambda: node.status("c-done") == "STOPPED", 10, "the container to exit 3")
    node.remove("c-done")
    assert len(node.checkpoints(label)) == 1  # a failure keeps them: the next start resumes

    node.run("c-done", "while [ ! -e /data/go ]; do sleep 0.1; done; exit 0", env)
    wait_for(lambda: node.status("c-done") == "RUNNING", 10, "the restored container to run")
    node.ctr("tasks", "exec", "--exec-id", "ok", "c-done", "/bin/sh", "-c", "echo 0 > /data/go")
    wait_for(lambda: node.checkpoints(label) == [], 15, "the label to be retired")
    node.remove("c-done")


def test_a_checkpoint_exported_as_an_oci_image_and_imported_again_restores(
    node: Node, tmp_path: Path
) -> None:
    label = f"oci-{secrets.token_hex(3)}"
    log = counter(node, "c-oci", label, "oci")
    wait_for(lambda: len(numbers(log)) >= 5, 20, "the counter")
    node.stop("c-oci")
    before = numbers(log)
    node.remove("c-oci")
    listed = [
        c for c in json.loads(node.stasis("checkpoints", "--json").stdout) if c["label"] == label
    ]
    assert len(listed) == 1
    archive = tmp_path / "checkpoint.tar"
    exported = node.stasis("export", listed[0]["id"], "--oci", str(archive), "--json")
    assert exported.returncode == 0, exported.stderr
    assert archive.stat().st_mode & 0o777 == 0o600  # the container's memory, in the clear

    # A real OCI tool reads it, with the annotations CRI-O and Podman look for.
    inspect = subprocess.run(
        ["skopeo", "inspect", "--raw", f"oci-archive:{archive}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert inspect.returncode == 0, inspect.stderr
    manifest = json.loads(inspect.stdout)
    assert manifest["annotations"]["io.kubernetes.cri-o.annotations.checkpoint.name"] == label
    assert manifest["annotations"]["dev.stasis.checkpoint.id"] == listed[0]["id"]
    with tarfile.open(archive) as tar:
        layer_name = "blobs/sha256/" + manifest["layers"][0]["digest"].split(":")[1]
        layer = tar.extractfile(layer_name)
        assert layer is not None
        with tarfile.open(fileobj=io.BytesIO(layer.read())) as inner:
            names = inner.getnames()
    assert {
        "spec.dump",
        "config.dump",
        "rootfs-diff.tar",
        "deleted.files",
        "checkpoint/inventory.img",
    } <= set(names)

    # Gone from the store; imported back; a new container resumes from it.
    assert node.stasis("checkpoints", "rm", listed[0]["id"]).returncode == 0
    imported = node.stasis("import", str(archive), "--json")
    assert imported.returncode == 0, imported.stderr
    assert json.loads(imported.stdout)["label"] == label
    log2 = counter(node, "c-oci", label, "again")
    wait_for(lambda: len(numbers(log2)) >= 2, 20, "the counter restored from the import")
    assert numbers(log2)[0] == before[-1] + 1
    assert node.read("c-oci", "/data/made").strip() == "token-oci"
    node.stop("c-oci")
    node.remove("c-oci")


def test_export_of_an_unknown_checkpoint_and_import_of_a_non_image_fail_in_one_line(
    node: Node, tmp_path: Path
) -> None:
    r = node.stasis("export", "20200101T000000Z-abcdef", "--oci", str(tmp_path / "x.tar"))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "x.tar").exists()
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar")
    r = node.stasis("import", str(junk))
    assert r.returncode == 2 and "is not an OCI image archive" in r.stderr, r.stderr


def test_a_node_without_a_kubernetes_api_has_no_drain_and_says_so(node: Node) -> None:
    r = node.stasis("k8s", "drain")
    assert (r.returncode, r.stderr.strip()) == (
        2,
        "stasis: error: this node has no Kubernetes API to drain it in",
    ), r.stderr


def test_a_label_resumes_only_into_a_container_with_the_checkpointed_credentials(
    node: Node,
) -> None:
    """A restore gives the processes the credentials CRIU recorded: a container spec that adds
    a capability does not resume a label dumped without it (it starts fresh), nor does one
    without it resume the privileged one's checkpoint; the matching one still resumes."""
    label = f"creds-{secrets.token_hex(3)}"
    plain = counter(node, "c-creds", label, "plain")
    wait_for(lambda: len(numbers(plain)) >= 5, 20, "the counter to count")
    node.stop("c-creds")
    before = numbers(plain)
    node.remove("c-creds")
    (first,) = [
        c["id"]
        for c in json.loads(node.stasis("checkpoints", "--json").stdout)
        if c["label"] == label
    ]

    # The same label from a spec with CAP_SYS_ADMIN added: refused, one line; fresh start.
    extra = node.run(
        "c-creds",
        COUNTER.replace("$0", "admin"),
        env={"STASIS_CHECKPOINT": label},
        options=["--cap-add=CAP_SYS_ADMIN"],
    )
    wait_for(lambda: len(numbers(extra)) >= 3, 20, "the fresh counter")
    text = extra.read_text()
    refusal = next(line for line in text.splitlines() if f"checkpoint {first} refused" in line)
    assert refusal.startswith(
        f"stasis: checkpoint {first} refused: it was taken of a container "
        "with other credentials (bounding capabilities "
    ), refusal
    assert "CAP_SYS_ADMIN" in refusal and refusal.endswith(
        "resume it from a pod whose securityContext (runAsUser, runAsGroup, "
        "supplementalGroups, capabilities, hostUsers) is the checkpointed one's"
    ), refusal
    assert numbers(extra)[0] == 1  # not resumed
    # Its own layer, not the checkpoint's.
    assert node.read("c-creds", "/data/made").strip() == "token-admin"
    node.stop("c-creds")  # its own checkpoint now: the label's newest, with CAP_SYS_ADMIN
    node.remove("c-creds")

    # The reverse: the plain spec skips the privileged newest and resumes its own.
    again = counter(node, "c-creds", label, "plain-again")
    wait_for(lambda: len(numbers(again)) >= 2, 20, "the resumed counter")
    text = again.read_text()
    assert "refused: it was taken of a container with other credentials" in text, text[:800]
    assert f"restored from checkpoint {first}" in text
    assert numbers(again)[0] == before[-1] + 1
    node.stop("c-creds")
    node.remove("c-creds")


def test_within_a_namespace_any_pod_may_resume_a_label_and_none_of_another_namespace(
    node: Node,
) -> None:
    """The namespace is the unit of trust (as for its Secrets): a container of another pod of
    the same namespace with the label resumes it; one of another namespace starts fresh."""
    label = f"shared-{secrets.token_hex(3)}"

    def in_namespace(ns: str, pod: str) -> list[str]:
        return [
            f"--annotation=io.kubernetes.cri.sandbox-namespace={ns}",
            f"--annotation=io.kubernetes.cri.sandbox-name={pod}",
        ]

    log = node.run(
        "c-ns",
        COUNTER.replace("$0", "a"),
        env={"STASIS_CHECKPOINT": label},
        options=in_namespace("team-a", "trainer-1"),
    )
    wait_for(lambda: len(numbers(log)) >= 5, 20, "the counter to count")
    node.stop("c-ns")
    before = numbers(log)
    node.remove("c-ns")
    mine = [
        c for c in json.loads(node.stasis("checkpoints", "--json").stdout) if c["label"] == label
    ]
    assert [c["user"] for c in mine] == ["k8s:team-a"]

    other = node.run(
        "c-ns",
        COUNTER.replace("$0", "b"),
        env={"STASIS_CHECKPOINT": label},
        options=in_namespace("team-b", "trainer-1"),
    )
    wait_for(lambda: len(numbers(other)) >= 2, 20, "the other namespace's counter")
    assert numbers(other)[0] == 1
    assert f"no checkpoint of label {label} in namespace team-b yet" in other.read_text()
    node.ctr("tasks", "kill", "-s", "SIGKILL", "c-ns")  # no checkpoint of team-b's taken
    wait_for(lambda: node.status("c-ns") == "STOPPED", 10, "team-b's container to stop")
    node.remove("c-ns")

    same = node.run(
        "c-ns",
        COUNTER.replace("$0", "a2"),
        env={"STASIS_CHECKPOINT": label},
        options=in_namespace("team-a", "trainer-2"),
    )
    wait_for(lambda: len(numbers(same)) >= 2, 20, "team-a's other pod's counter")
    assert numbers(same)[0] == before[-1] + 1
    node.stop("c-ns")
    node.remove("c-ns")


def test_no_local_user_is_the_owner_of_a_namespace_s_checkpoints(node: Node) -> None:
    """A namespace's owner uid is above every kernel uid: a local user whose uid is the
    nearest a kernel has (the owner uid's low 32 bits) can neither list nor restore them
    through the daemon's socket."""
    import pwd

    from stasis.k8s.runc import namespace_uid
    from tests.conftest import STASIS, TEST_USER, ensure_test_user

    label = f"owner-{secrets.token_hex(3)}"
    log = counter(node, "c-owner", label, "owner")
    wait_for(lambda: len(numbers(log)) >= 3, 20, "the counter to count")
    node.stop("c-owner")
    node.remove("c-owner")
    (ckpt,) = [
        c["id"]
        for c in json.loads(node.stasis("checkpoints", "--json").stdout)
        if c["label"] == label
    ]

    owner = namespace_uid("stasis")
    uid = owner & 0xFFFFFFFF
    ensure_test_user()
    name = f"ns-{secrets.token_hex(3)}"
    subprocess.run(
        [
            "useradd",
            "--no-create-home",
            "--no-log-init",
            "--non-unique",
            "-u",
            str(uid),
            "-g",
            TEST_USER,
            "-s",
            "/bin/sh",
            name,
        ],
        check=True,
    )
    try:
        # The attacker may talk to the daemon (the socket's group).
        node.configure({"socket_group": TEST_USER})

        def as_user(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [
                    "runuser",
                    "-u",
                    name,
                    "--",
                    "env",
                    f"STASIS_CONFIG={node.info['stasis_config']}",
                    STASIS,
                    *args,
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )

        listed = as_user("checkpoints", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [c for c in json.loads(listed.stdout) if c["label"] == label] == []
        by_label = as_user("restore", "--label", label)
        assert by_label.returncode != 0
        assert by_label.stderr.strip() == f"stasis: error: no checkpoint with label {label}"
        by_id = as_user("restore", ckpt)
        assert by_id.returncode != 0 and "permission denied" in by_id.stderr, by_id.stderr
        assert len(by_id.stderr.strip().splitlines()) == 1
        # Still there, the namespace's own.
        assert [
            c["id"]
            for c in json.loads(node.stasis("checkpoints", "--json").stdout)
            if c["label"] == label
        ] == [ckpt]
    finally:
        subprocess.run(["userdel", name], check=False)
    assert owner > 2**32 - 1  # no account of any node can have it
    assert owner not in {p.pw_uid for p in pwd.getpwall()}
