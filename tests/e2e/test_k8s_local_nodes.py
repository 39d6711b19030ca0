"""Two Kubernetes local nodes on one machine as hosts of their own (`stasis k8s local-node up
--separate`): what one node's containerd, runc and daemon keep in /run (runc's state of a
container), /tmp and /dev/shm is seen neither on the other node nor on the machine, and each has
its own host name; `down` ends the node's namespaces."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.daemon import detached
from tests.conftest import wait_for
from tests.e2e.containerd_node import Node


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[Node, Node]]:
    made: list[Node] = []
    try:
        for name in ("kn-a", "kn-b"):
            n = Node(Path(tempfile.mkdtemp(prefix=f"stasis-{name}-")), node_name=name,
                     separate=True)
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
        assert (a.inside("hostname").stdout, b.inside("hostname").stdout) == ("kn-a\n",
                                                                              "kn-b\n")
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
    # Nothing left in its mount namespace (a zombie holder has no namespaces left to name).
    wait_for(lambda: not any(_in_ns(pid, mnt) for pid in _pids()), 10,
             "the node's processes to end")


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _in_ns(pid: int, mnt: str) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt") == mnt
    except OSError:
        return False
