"""Two Kubernetes local nodes on one machine as hosts of their own (`stasis-dev local-node up
--separate`): what one node's containerd, runc and daemon keep in /run (runc's state of a
container), /tmp and /dev/shm is seen neither on the other node nor on the machine, each has its
own host name, network and address; `down` ends the node's namespaces, and the last one the
nodes' bridge."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.daemon import detached
from stasis.dev import k8snode
from tests.conftest import STASIS_DEV, wait_for
from tests.e2e.containerd_node import Node


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node]]:
    made: list[Node] = []
    try:
        for name in ("kn-a", "kn-b"):
            n = Node(
                Path(tempfile.mkdtemp(prefix=f"stasis-{name}-")), node_name=name, separate=True
            )
            made.append(n)
            n.up()
        yield made[0], made[1]
    finally:
        for n in made:
            n.down()


def test_two_local_nodes_see_nothing_of_each_other(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    tag = f"sep-{os.urandom(4).hex()}"
    runc_root = f"/run/containerd/runc/{a.info['namespace']}"
    cid = f"c-{tag}"
    a.run(cid, "sleep 600")
    try:
        wait_for(lambda: a.status(cid) == "RUNNING", 30, "the container on kn-a")
        # runc's state of the container is node A's alone.
        assert cid in a.inside("runc", "--root", runc_root, "list", "-q").stdout.split()
        assert cid not in b.inside("runc", "--root", runc_root, "list", "-q").stdout.split()
        assert not Path(runc_root, cid).exists()
        for d in ("/tmp", "/var/tmp", "/dev/shm", "/run"):
            assert a.inside("sh", "-c", f"echo x > {d}/{tag}").returncode == 0
            assert b.inside("test", "-e", f"{d}/{tag}").returncode == 1, d
            assert not Path(d, tag).exists(), d
        assert (a.inside("hostname").stdout, b.inside("hostname").stdout) == ("kn-a\n", "kn-b\n")
        # Their own networks: A's loopback is A's; B reaches A at its address.
        assert a.info["address"] != b.info["address"]
        assert f"inet {a.info['address']}/24" in a.inside("ip", "-4", "addr", "show", "eth0").stdout
        server = subprocess.Popen(
            [
                *a.info["node_prefix"],
                "python3",
                "-c",
                "import socket,time; s=socket.socket(); "
                "s.bind(('0.0.0.0', 0)); s.listen(); "
                "print(s.getsockname()[1], flush=True); time.sleep(60)",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())

            def reach(n: Node, host: str) -> bool:
                probe = (
                    f"import socket; s=socket.socket(); s.settimeout(2); "
                    f"print(s.connect_ex(('{host}', {port})))"
                )
                return n.inside("python3", "-c", probe).stdout.strip() == "0"

            assert reach(a, "127.0.0.1") and not reach(b, "127.0.0.1")
            assert reach(b, a.info["address"])
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex(("127.0.0.1", port)) != 0
        finally:
            server.kill()
            server.wait()
            assert server.stdout is not None
            server.stdout.close()
        # The node's directory (its containerd socket, store, logs) is shared with the machine.
        assert a.inside("test", "-S", a.info["containerd_address"]).returncode == 0
    finally:
        a.remove(cid)


def test_down_ends_the_node_s_namespaces() -> None:
    n = Node(Path(tempfile.mkdtemp(prefix="stasis-kn-c-")), node_name="kn-c", separate=True)
    n.up()
    holder = detached.read_pid(n.lay.holder_file)
    assert holder is not None and n.info["node_prefix"][:3] == ["nsenter", "-t", str(holder)]
    mnt = os.readlink(f"/proc/{holder}/ns/mnt")
    n.down()
    assert not n.lay.holder_file.exists()
    # The last local node gone, their bridge too (kn-a and kn-b went with the first test).
    assert not Path(f"/sys/class/net/{k8snode.LOCAL_NET.bridge}").exists()
    # Nothing left in its mount namespace (a zombie holder has no namespaces left to name).
    wait_for(
        lambda: not any(_in_ns(pid, mnt) for pid in _pids()), 10, "the node's processes to end"
    )


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _in_ns(pid: int, mnt: str) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt") == mnt
    except OSError:
        return False


def test_a_separate_node_refuses_an_api_on_the_machine_s_loopback(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nclusters:\n- cluster:\n    server: " "https://127.0.0.1:6443\n  name: c\n"
    )
    root = tmp_path / "node"
    r = subprocess.run(
        [
            STASIS_DEV,
            "local-node",
            "up",
            "--dir",
            str(root),
            "--separate",
            f"--kubeconfig={kubeconfig}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "STASIS_CONFIG": ""},
    )
    assert (r.returncode, r.stderr) == (
        2,
        (
            "stasis: error: --separate: the node has a network of its own, where the Kubernetes "
            "API at https://127.0.0.1:6443 (this machine's loopback) cannot be reached; serve it "
            f"on {k8snode.LOCAL_NET.host_addr} (this machine on the nodes' network), or leave "
            "out --separate\n"
        ),
    ), r.stderr
    assert not root.exists()  # nothing made
