"""The agent's image (`make image`) run as the chart's DaemonSet runs it: a privileged container
with the host's PIDs, network and root (/host), started by a real containerd (node A). From
there it installs the runtime into a second containerd's config and bin dir on the host
(node B, started once the entry is in, as a restart would), puts its bundle of stasis-runc and
CRIU (the image's Python and libraries) on the host, runs the daemon, and removes the node's
not-ready taint in kmock's API emulator. A counting container on B is then stopped the way
the kubelet stops it, created again, and continues its count."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stasis.daemon import detached
from stasis.dev import k8snode
from stasis.k8s import shim
from tests.conftest import wait_for
from tests.e2e.containerd_node import IMAGE, Node, busybox_archive, numbers
from tests.k8s.apiserver import ApiServer

REPO = Path(__file__).resolve().parents[2]
NODE = "node-b"
CID = f"counter-{secrets.token_hex(3)}"  # runc's state of a namespace is machine-wide
COUNTER = "i=0; while :; do i=$((i+1)); echo n=$i; sleep 0.1; done"


@dataclass
class Cluster:
    infra: Node  # node A: runs the agent's container
    b: k8snode.K8sNodeDirs  # node B: the host the agent installs into
    api: ApiServer
    agent_log: Path

    def ctr_b(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ctr", "-a", str(self.b.address), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


def version() -> str:
    from importlib.metadata import version as v

    return v("stasis")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Built before anything is mounted: a build that fails leaves no mount behind.
    out = Path(tempfile.mkdtemp(prefix="stasis-image-build-", dir="/var/tmp"))
    archive = out / "agent.oci.tar"
    built = subprocess.run(
        ["bash", str(REPO / "scripts" / "build-image.sh"), str(archive)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    if built.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
    assert built.returncode == 0, built.stderr[-3000:]
    root = Path(tempfile.mkdtemp(prefix="stasis-image-"))
    os.chmod(root, 0o755)
    # A node's root is a shared mount (systemd makes it one; HostToContainer needs it): the
    # rootfs mounts node B's containerd makes must reach the agent. This machine's is private.
    for cmd in (["mount", "--bind", str(root), str(root)], ["mount", "--make-rshared", str(root)]):
        subprocess.run(cmd, check=True)
    infra = Node(root / "a")
    b = k8snode.K8sNodeDirs(root / "b")
    for d in (b.containerd, b.bin, b.stasis):
        d.mkdir(parents=True)
    # Node B's containerd config as a node has it before stasis: no runtime entry yet.
    (b.containerd / "config.toml").write_text(
        k8snode.containerd_config(b).replace(shim.cri_runtime_entry(), "")
    )
    (b.stasis / "agent.toml").write_text(
        f'socket = "{b.stasis_socket}"\nstate_dir = "{b.stasis / "state"}"\n'
        f'store = "{b.stasis / "store"}"\ncontainerd_address = "{b.address}"\n'
        "k8s_check_interval_s = 0.5\n"
    )
    api = ApiServer(root)
    log = root / "agent.log"
    agent = f"agent-{secrets.token_hex(3)}"  # runc's state of a namespace is machine-wide
    try:
        infra.up()
        api.start()
        api.create(
            "nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": NODE},
                "spec": {"taints": [{"key": "stasis.dev/not-ready", "effect": "NoSchedule"}]},
            },
        )
        r = infra.ctr("images", "import", str(archive), timeout_s=300)
        assert r.returncode == 0, r.stderr
        mounts = [
            f"type=bind,src={src},dst={dst},options=rbind:{mode}"
            for src, dst, mode in (
                ("/", "/host", "rslave"),
                (root, root, "rslave"),
                ("/run/containerd", "/run/containerd", "rslave"),
                ("/sys/fs/cgroup", "/sys/fs/cgroup", "rw"),
            )
        ]
        r = infra.ctr(
            # The host's PIDs (hostPID) are this process's: PID 1's may be closed to us here.
            "run",
            "-d",
            "--privileged",
            "--net-host",
            "--with-ns",
            f"pid:/proc/{os.getpid()}/ns/pid",
            f"--log-uri=file://{log}",
            *[f"--mount={m}" for m in mounts],
            f"--env=STASIS_CONFIG={b.stasis / 'agent.toml'}",
            f"stasis/agent:{version()}",
            "agent",
            "stasis",
            "k8s",
            "agent",
            "--node",
            NODE,
            "--kubeconfig",
            str(api.kubeconfig),
            "--host-root",
            "/host",
            "--containerd-config",
            str(b.containerd / "config.toml"),
            "--bin-dir",
            str(b.bin),
            "--bundle-dir",
            str(b.root / "runtime"),
            "--runtime-config",
            str(b.stasis / "runtime.toml"),
        )
        assert r.returncode == 0, r.stderr
        wait_for(
            lambda: shim.HANDLER in (b.containerd / "config.toml").read_text(),
            120,
            f"the agent to install the runtime ({log})",
        )
        wait_for(lambda: b.stasis_socket.exists(), 60, "the agent's daemon")
        env = {"PATH": f"{b.bin}:" + os.environ["PATH"], "LANG": "C.UTF-8"}
        clog = b.containerd / "containerd.log"
        pid = detached.start(
            ["containerd", "--config", str(b.containerd / "config.toml")],
            b.containerd / "containerd.pid",
            clog,
            env,
        )
        detached.wait_listening(pid, b.address, clog, 20, AssertionError)
        c = Cluster(infra, b, api, log)
        r = c.ctr_b("images", "import", str(busybox_archive(root / "busybox.tar")))
        assert r.returncode == 0, r.stderr
        yield c
    finally:
        cpid = detached.read_pid(b.containerd / "containerd.pid")
        if detached.alive(cpid):
            for args in (["tasks", "delete", "-f", CID], ["containers", "delete", CID]):
                subprocess.run(
                    ["ctr", "-a", str(b.address), "-n", "k8s.io", *args],
                    capture_output=True,
                    timeout=60,
                )
        detached.stop(cpid)
        infra.ctr("tasks", "kill", "-s", "SIGTERM", agent)
        wait_for(lambda: infra.status(agent) in ("STOPPED", None), 40, "the agent to stop")
        infra.down()
        api.stop()
        k8snode._unmount_under(root)
        subprocess.run(["umount", "-l", str(root)], check=False)
        shutil.rmtree(root / "b" / "runtime", ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def test_the_agent_from_its_image_makes_a_node_whose_containers_resume(cluster: Cluster) -> None:
    c = cluster
    wait_for(
        lambda: not c.api.get("nodes", NODE)["spec"].get("taints"),
        60,
        f"the agent to untaint the node ({c.agent_log})",
    )
    runtime = c.b.root / "runtime"
    assert f"exec {runtime}/bin/stasis-runc" in (c.b.bin / "runc-wrapper" / "runc").read_text()
    # The bundle's Python is the image's, not this machine's venv.
    assert "/opt/stasis/venv" in (runtime / "STAMP").read_text()

    label = f"image-{secrets.token_hex(3)}"

    def start() -> Path:
        log = c.b.root / f"counter-{secrets.token_hex(3)}.log"
        r = c.ctr_b(
            "run",
            "-d",
            f"--log-uri=file://{log}",
            f"--runtime={shim.RUNTIME_TYPE}",
            f"--env=STASIS_CHECKPOINT={label}",
            IMAGE,
            CID,
            "/bin/sh",
            "-c",
            COUNTER,
        )
        assert r.returncode == 0, r.stderr
        return log

    log = start()
    wait_for(lambda: len(numbers(log)) >= 8, 30, "the counter to count")
    r = c.ctr_b("tasks", "kill", "-s", "SIGTERM", CID, timeout_s=60)
    assert r.returncode == 0, r.stderr

    def stopped() -> bool:
        return "STOPPED" in c.ctr_b("tasks", "ls").stdout

    wait_for(stopped, 40, "the container to stop")
    before = numbers(log)
    listed = subprocess.run(
        [str(Path(sys.executable).parent / "stasis"), "checkpoints", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "STASIS_CONFIG": str(c.b.stasis / "agent.toml")},
    )
    assert [x["label"] for x in json.loads(listed.stdout)] == [label], listed.stderr
    c.ctr_b("tasks", "delete", "-f", CID)
    c.ctr_b("containers", "delete", CID)

    log2 = start()
    wait_for(lambda: len(numbers(log2)) >= 3, 30, f"the restored counter ({log2})")
    assert "stasis: restored from checkpoint" in log2.read_text()
    after = numbers(log2)
    assert after[0] == before[-1] + 1, (before[-3:], after[:3])
