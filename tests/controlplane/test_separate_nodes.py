"""The control plane's test nodes as hosts of their own (`new_daemon(..., separate=True)`,
tests/nodes.py, stasis/dev/nodehost.py): what one node keeps in /tmp, /var/tmp, /dev/shm and /run is
seen neither on another node nor on the machine, each has its own host name, address and
network; and a job the control plane migrates from one to the other carries the /tmp file it
keeps open, its unix socket in /tmp and its SQLite database in /dev/shm (the node-local files of
stasis/engine/nodelocal.py) and goes on counting."""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
from pathlib import Path

from tests.conftest import Daemon, new_daemon, wait_for, workload
from tests.controlplane.conftest import SQLITE_ONLY, ControlPlane
from tests.controlplane.test_commands import site_nodes
from tests.controlplane.test_node import node_env
from tests.s3server import S3Server

PRIVATE = ("/tmp", "/var/tmp", "/dev/shm", "/run")


def inside(d: Daemon, *cmd: str) -> subprocess.CompletedProcess[str]:
    """`cmd` run in `d`'s node."""
    assert d.node is not None
    return subprocess.run([*d.node.prefix(), *cmd], capture_output=True, text=True, timeout=30)


def namespaces(pid: int) -> dict[str, str]:
    return {ns: os.readlink(f"/proc/{pid}/ns/{ns}") for ns in ("mnt", "uts", "net")}


def test_a_node_of_its_own_shows_nothing_of_another(
    world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    a = new_daemon(world_tmp, "node-a", separate=True)
    b = new_daemon(world_tmp, "node-b", separate=True)
    started: list[Daemon] = []
    try:
        for d in (a, b):
            d.start()
            started.append(d)
        assert a.node is not None and b.node is not None and a.proc and b.proc
        tag = f"sep-{os.urandom(4).hex()}"
        # A job of node A makes its files where a program keeps node-local state.
        script = "; ".join(f"echo {p} > {p}/{tag}" for p in PRIVATE) + "; hostname; sleep 600"
        job = a.run("sh", "-c", script, label=tag)["job"]
        wait_for(lambda: "node-a" in a.log_of(job), 20, "the job to write its files")
        for p in PRIVATE:
            assert inside(a, "cat", f"{p}/{tag}").stdout == f"{p}\n"
            assert inside(b, "test", "-e", f"{p}/{tag}").returncode == 1, p
            assert not Path(p, tag).exists(), p
        # Their own host names, addresses and networks; the job is in its node's.
        here = socket.gethostname()
        assert (inside(a, "hostname").stdout, inside(b, "hostname").stdout) == (
            "node-a\n",
            "node-b\n",
        ) and here not in ("node-a", "node-b")
        assert a.node.address != b.node.address
        assert f"inet {a.node.address}/24" in inside(a, "ip", "-4", "addr", "show", "eth0").stdout
        assert inside(a, "ip", "-4", "addr", "show", "eth0").returncode == 0
        daemon_ns = [namespaces(a.proc.pid), namespaces(b.proc.pid)]
        own = namespaces(os.getpid())
        for ns in ("mnt", "uts", "net"):
            assert len({daemon_ns[0][ns], daemon_ns[1][ns], own[ns]}) == 3, ns
        assert namespaces(a.job(job)["pid"])["net"] == daemon_ns[0]["net"]
        # Node A's loopback is its own: a listener there is not on B's nor on the machine's;
        # A is reached at its address.
        server = subprocess.Popen(
            [
                *a.node.prefix(),
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

            def probe(host: str) -> str:
                return (
                    f"import socket; s=socket.socket(); s.settimeout(2); "
                    f"print(s.connect_ex(('{host}', {port})))"
                )

            assert inside(a, "python3", "-c", probe("127.0.0.1")).stdout.strip() == "0"
            assert inside(b, "python3", "-c", probe("127.0.0.1")).stdout.strip() != "0"
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex(("127.0.0.1", port)) != 0
            assert inside(b, "python3", "-c", probe(a.node.address)).stdout.strip() == "0"
        finally:
            server.kill()
            server.wait()
            assert server.stdout is not None
            server.stdout.close()
        # What a site shares is shared: the test's directories (store, sockets), /run/lock.
        assert inside(b, "test", "-d", str(a.root)).returncode == 0
        assert inside(b, "stat", "-c", "%a", "/run/lock").stdout == "1777\n"
    finally:
        for d in started:
            d.kill_all()
            d.stop()


@SQLITE_ONLY
def test_a_job_migrated_between_nodes_of_their_own_carries_its_tmp_file(
    site_controlplane: ControlPlane, world_tmp: Path, site_key: Path, test_user: pwd.struct_passwd
) -> None:
    cp = site_controlplane
    tag = f"mv-{os.urandom(4).hex()}"
    with site_nodes(cp, world_tmp, site_key, "node-a", "node-b", separate=True) as nodes:
        a, b = nodes["node-a"], nodes["node-b"]
        # A tempfile in /tmp and one in /var/tmp, a unix socket in /tmp and SQLite in /dev/shm.
        job = a.run(
            *workload("nodelocal.py", "tmp,vartmp,sock,shm", tag, 0.2),
            label=tag,
            user=test_user.pw_name,
        )["job"]

        def counts(d: Daemon, j: str) -> list[int]:
            return [
                int(line.split()[1])
                for line in d.log_of(j).splitlines()
                if line.startswith("count ")
            ]

        wait_for(lambda: len(counts(a, job)) >= 3, 30, "the counter to count on A")
        held = inside(
            a, "sh", "-c", f"ls -d /tmp/{tag}-* /var/tmp/{tag}-* /dev/shm/{tag}-*"
        ).stdout.split()
        # The tempfiles, the socket's directory, the database with its -wal and -shm.
        assert len(held) == 6, held
        for path in held:
            assert inside(b, "test", "-e", path).returncode == 1, path
            assert not Path(path).exists(), path
        wait_for(lambda: job in [j["job"] for j in cp.json("jobs")], 30, "the job report")
        moved = cp.json("migrate", job, "--to", "node-b")
        assert (moved["from_node"], moved["node"]) == ("node-a", "node-b")
        before = counts(a, job)
        new = moved["job"]
        wait_for(lambda: len(counts(b, new)) >= len(before) + 3, 30, "the count on B")
        after = counts(b, new)
        # The files' counts, the socket server's and the memory's agreed on B (else MISMATCH):
        # they travelled.
        assert after == list(range(1, len(after) + 1)), after[-10:]
        assert "MISMATCH" not in b.log_of(new)
        for path in held:
            assert inside(b, "test", "-e", path).returncode == 0, path
        assert b.job(new)["state"] in ("running", "restored")
        assert b.proc is not None
        assert namespaces(b.job(new)["pid"])["net"] == namespaces(b.proc.pid)["net"]
        assert not [p for p in held if Path(p).exists()]


@SQLITE_ONLY
def test_nodes_of_their_own_share_an_s3_store_on_their_network(
    site_controlplane: ControlPlane,
    site_s3: S3Server,
    world_tmp: Path,
    site_key: Path,
    test_user: pwd.struct_passwd,
) -> None:
    """The shared store a real site has: S3 reached over the nodes' network, not a path."""
    cp = site_controlplane
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    store = f"s3://{site_s3.make_bucket(f't-{os.urandom(6).hex()}')}/site"
    a, b = (
        new_daemon(
            world_tmp,
            n,
            store=store,
            separate=True,
            env={**node_env(cp, cluster, n), **site_s3.env(), "STASIS_SITE_KEY": str(site_key)},
        )
        for n in ("node-a", "node-b")
    )
    started: list[Daemon] = []
    try:
        for d in (a, b):
            d.start()
            started.append(d)
        job = a.run(*workload("counter.py"), label="s3-move", user=test_user.pw_name)["job"]
        wait_for(lambda: len(a.log_of(job).split()) >= 3, 30, "the counter to count")
        wait_for(lambda: job in [j["job"] for j in cp.json("jobs")], 30, "the job report")
        moved = cp.json("migrate", job, "--to", "node-b")
        before = [int(x) for x in a.log_of(job).split()]
        wait_for(
            lambda: len(b.log_of(moved["job"]).split()) >= len(before) + 2, 30, "the count on B"
        )
        after = [int(x) for x in b.log_of(moved["job"]).split()]
        assert after[len(before)] == before[-1] + 1
    finally:
        for d in started:
            d.kill_all()
            d.stop()
