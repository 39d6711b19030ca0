"""A job's own network (stasis/daemon/jobnet.py) carries a TCP connection between two of its parts
across a move (issue 31), on three separate nodes (tests/nodes.py: each its own host name,
network and address): a counter passed back and forth between a part on n1 and one on n2, each
in the job's network namespace on its node with an address of the job's, joined by the job's
VXLAN. Both parts frozen before either is dumped; the n1 part restored on n3 (its namespace
made there again with the same job address, every node's forwarding table updated), the n2
part on n2: the counter goes on from where it was, no number lost or repeated, the answers now
coming from n3."""

from __future__ import annotations

import ipaddress
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.daemon import jobnet
from stasis.dev import nodehost
from tests import nodes
from tests.conftest import ROOT, WORKLOADS, wait_for

# cgroup v1's freezer where the machine has it (this project's VMs), else cgroup v2's.
_V1 = Path("/sys/fs/cgroup/freezer")
_FREEZER = _V1 if _V1.is_dir() else Path("/sys/fs/cgroup")
_LINE = re.compile(r"^(\d+) on (\S+)$", re.M)
_PORT = 7000


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, nodehost.NodeHost]]:
    state = tmp_path_factory.mktemp("jobnet-nodes")
    made = {name: nodes.make_node(name, state) for name in ("n1", "n2", "n3")}
    yield made
    # The session's fixture ends the nodes (tests/conftest.py).


class Tree:
    """A process tree started in a job's namespace on a node, in a freezer cgroup of its own."""

    def __init__(self, node: nodehost.NodeHost, net: jobnet.JobNet, name: str, log: Path) -> None:
        self.node, self.net, self.log = node, net, log
        self.freezer = _FREEZER / f"stasis-test-jobnet-{os.getpid()}-{name}"
        self.freezer.mkdir()
        self.proc: subprocess.Popen[bytes] | None = None
        self.init = 0

    def start(self, *argv: str) -> None:
        # Its files opened inside the node (CRIU finds no mount for one opened outside).
        self.proc = subprocess.Popen(
            [
                *self.node.prefix(),
                "sh",
                "-c",
                f'echo $$ > {self.freezer}/cgroup.procs && exec "$@" </dev/null >>{self.log} 2>&1',
                "sh",
                "nsenter",
                f"--net={self.net.netns_path}",
                "--",
                "unshare",
                "--pid",
                "--fork",
                "--",
                "setsid",
                "tini",
                "-g",
                "--",
                sys.executable,
                "-u",
                *argv,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.init = wait_for(lambda: self._tini(), what=f"the part's init on {self.node.name}")

    def _tini(self) -> int | None:
        for line in (self.freezer / "cgroup.procs").read_text().split():
            if Path(f"/proc/{line}/comm").read_text().strip() == "tini":
                return int(line)
        return None

    def freeze(self, frozen: bool = True) -> None:
        if _FREEZER == _V1:
            (self.freezer / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        else:
            (self.freezer / "cgroup.freeze").write_text("1" if frozen else "0")

    def frozen(self) -> bool:
        if _FREEZER == _V1:
            return (self.freezer / "freezer.state").read_text().strip() == "FROZEN"
        return "frozen 1" in (self.freezer / "cgroup.events").read_text()

    def engine(self, *argv: str, on: nodehost.NodeHost | None = None) -> str:
        done = subprocess.run(
            [
                *(on or self.node).prefix(),
                "env",
                f"PYTHONPATH={ROOT}",
                sys.executable,
                "-m",
                "tests.e2e.jobnet_engine",
                *argv,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def close(self) -> None:
        pids = (self.freezer / "cgroup.procs").read_text().split() if self.freezer.exists() else []
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        if self.freezer.exists():
            self.freeze(False)
            wait_for(lambda: not (self.freezer / "cgroup.procs").read_text().split(), 10)
            self.freezer.rmdir()
        if self.proc is not None:
            self.proc.wait(10)


def test_nodes_resolve_each_others_names(hosts: dict[str, nodehost.NodeHost]) -> None:
    # stasis/dev/nodehost.py's hosts file: what an MPI launcher needs to reach the other nodes.
    for here in hosts.values():
        for there in hosts.values():
            found = subprocess.run(
                [*here.prefix(), "getent", "ahostsv4", there.name],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            assert found[:1] == [there.address], (here.name, there.name, found)


def _counted(log: Path) -> list[tuple[int, str]]:
    return [(int(n), host) for n, host in _LINE.findall(log.read_text())]


def _connect(
    node: nodehost.NodeHost, net: jobnet.JobNet, address: ipaddress.IPv4Address, port: int = 9
) -> str:
    """A TCP connect from the job's namespace on `node` to `address`: "0" when it connected,
    else the errno's name (ECONNREFUSED from a closed port: the address was reached)."""
    probe = (
        "import errno, socket; s = socket.socket(); s.settimeout(5); "
        f"e = s.connect_ex(('{address}', {port})); print(errno.errorcode.get(e, e))"
    )
    done = subprocess.run(
        [*node.prefix(), "nsenter", f"--net={net.netns_path}", sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or done.stderr.strip()


def _firewall(node: nodehost.NodeHost, net: jobnet.JobNet) -> str:
    return subprocess.run(
        [*node.prefix(), "nsenter", f"--net={net.netns_path}", "iptables-save"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_a_connection_between_parts_survives_a_move_to_a_third_node(
    hosts: dict[str, nodehost.NodeHost], tmp_path: Path
) -> None:
    n1, n2, n3 = hosts["n1"], hosts["n2"], hosts["n3"]
    net = jobnet.JobNet(
        vni=random.randrange(1000, 1_000_000),
        subnet=ipaddress.IPv4Network(f"10.99.{random.randrange(256)}.0/24"),
    )
    node = {n.name: ipaddress.IPv4Address(n.address) for n in (n1, n2, n3)}
    server = jobnet.Part(net.address(0), node["n1"])
    client = jobnet.Part(net.address(1), node["n2"])
    for host, part in ((n1, server), (n2, client)):
        jobnet.make_part(net, part, [server, client], underlay="eth0", on=host.prefix())
    a = Tree(n1, net, "server", tmp_path / "server.log")
    b = Tree(n2, net, "client", tmp_path / "client.log")
    try:
        assert _connect(n2, net, server.address) == "ECONNREFUSED"
        a.start(str(WORKLOADS / "jobcounter.py"), "serve", str(server.address), str(_PORT))
        wait_for(lambda: "listening" in a.log.read_text(), 30, "the server listening")
        b.start(str(WORKLOADS / "jobcounter.py"), "count", str(server.address), str(_PORT))
        wait_for(lambda: len(_counted(b.log)) >= 20, 30, "the counter passed 20 times")

        # One cut across both nodes: both frozen before either is dumped.
        a.freeze()
        b.freeze()
        wait_for(lambda: a.frozen() and b.frozen(), 10, "both parts frozen")
        before = _counted(b.log)
        for tree, name in ((a, "server"), (b, "client")):
            images, logs = tmp_path / f"{name}-img", tmp_path / f"{name}-logs"
            images.mkdir()
            tree.engine("dump", str(tree.init), str(images), str(logs), str(tree.freezer))
        time.sleep(0.5)
        assert _counted(b.log) == before  # nothing moved after the cut

        # The server's part moves to n3: its namespace there, the same job address; n2's
        # forwarding table points at n3; n1 forgets the job.
        moved = jobnet.Part(server.address, node["n3"])
        jobnet.make_part(net, moved, [moved, client], underlay="eth0", on=n3.prefix())
        jobnet.set_peers(net, client.node, [moved, client], on=n2.prefix())
        jobnet.remove_part(net, on=n1.prefix())
        assert jobnet.forwarding(net, on=n2.prefix()) == {
            ("00:00:00:00:00:00", n3.address),
            (moved.mac, n3.address),
        }

        a.engine(
            "restore",
            str(tmp_path / "server-img"),
            str(tmp_path / "server-logs"),
            str(net.netns_path),
            on=n3,
        )
        b.engine(
            "restore", str(tmp_path / "client-img"), str(tmp_path / "client-logs"),
            str(net.netns_path),
        )  # fmt: skip
        wait_for(lambda: len(_counted(b.log)) >= len(before) + 20, 30, "the counter going on")
        after = _counted(b.log)
        numbers = [n for n, _ in after]
        assert numbers == list(range(2, 2 + len(numbers))), after  # none lost, none repeated
        assert after[: len(before)] == before
        assert {h for _, h in before} == {"n1"}
        assert {h for _, h in after[len(before) + 1 :]} == {"n3"}, after
        # The server still listens on its job address, now on n3.
        assert _connect(n2, net, server.address, _PORT) == "0"
        # CRIU's network lock held each namespace whole; no rule of it is left in either.
        for host in (n2, n3):
            assert "CRIU" not in _firewall(host, net), host.name
    finally:
        a.close()
        b.close()
        for host in (n1, n2, n3):
            jobnet.remove_part(net, on=host.prefix())


def test_a_network_that_cannot_be_made_is_refused_in_one_line() -> None:
    with pytest.raises(
        jobnet.JobNetError, match=r"^VXLAN id 0 is out of range: use 1\.\.16777215$"
    ):
        jobnet.JobNet(vni=0, subnet=ipaddress.IPv4Network("10.99.0.0/24"))
    net = jobnet.JobNet(
        vni=random.randrange(1000, 1_000_000), subnet=ipaddress.IPv4Network("10.99.0.0/30")
    )
    with pytest.raises(jobnet.JobNetError, match="has no address for part 2"):
        net.address(2)
    part = jobnet.Part(net.address(0), ipaddress.IPv4Address("10.213.0.1"))
    with pytest.raises(jobnet.JobNetError) as info:
        jobnet.make_part(net, part, [part], underlay="stsnosuch0")
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("cannot find the interface stsnosuch0: "), info.value
    assert not net.netns_path.exists()  # nothing left behind
