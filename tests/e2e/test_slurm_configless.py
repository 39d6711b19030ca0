"""Slurm's configless mode on a real cluster of two nodes (`local-cluster up --configless`):
slurmctld serves its configuration, each node's slurmd fetches it into its cache, and the nodes
have no slurm.conf of their own; their stasis daemons are not told where one is. Stasis finds
Slurm's cached copy (/run/slurm/conf): an opted-in job is protected, a preempted one resumes
from its checkpoint, and a checkpoint asked from a login node (the node daemon checks the
request names its cluster, read from that copy) requeues it and it goes on.

On a cluster of its own.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import STASIS, TEST_USER, ensure_test_user
from tests.e2e.conftest import COUNTER, Cluster, close_cluster

ENABLE = "--export=STASIS_ENABLE=1"
RESTORED = "stasis: restored checkpoint"


class ConfiglessCluster(Cluster):
    def up(self) -> None:
        self.start("--socket-group", TEST_USER, "--nodes", "2", "--configless")
        self.work.mkdir(exist_ok=True)
        self.work.chmod(0o777)
        (self.work / "counter.py").write_text(COUNTER)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ensure_test_user()
    root = Path(tempfile.mkdtemp(prefix="stasis-e2e-configless-"))
    root.chmod(0o755)
    c = ConfiglessCluster(root, nodes=2)
    try:
        c.up()
        yield c
    finally:
        close_cluster(c)


def numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^(\d+)$", text, re.M)]


def resumed_once(c: Cluster, job: str, stop: int) -> None:
    out = c.output(job)
    assert RESTORED in out, out
    at_dump = numbers(out[: out.index(RESTORED)])[-1]
    assert numbers(out[out.index(RESTORED) :])[0] == at_dump + 1, out
    assert numbers(out) == list(range(stop)), out
    record = c.job(job)
    assert record["Restarts"] == "1" and record["JobState"] == "COMPLETED", record
    assert record["ExitCode"] == "0:0"


def test_the_nodes_have_no_slurm_conf_but_slurms_cached_copy(cluster: Cluster) -> None:
    c = cluster
    conf = c.lay.slurm_conf.read_text()
    assert "enable_configless" in conf and "PlugStackConfig" not in conf
    for node in ("n1", "n2"):
        assert c.on(node, "test", "-e", str(c.lay.slurm_conf), check=False).returncode == 1
        cached = c.on(node, "cat", "/run/slurm/conf/slurm.conf").stdout
        assert cached == conf
        assert "stasis_spank.so" in c.on(node, "cat", "/run/slurm/conf/plugstack.conf").stdout
        assert "slurm_conf" not in c.lay.config_of(node).read_text()
        ping = c.on(node, "env", "-u", "SLURM_CONF", "scontrol", "ping").stdout
        assert "is UP" in ping


def test_a_preempted_job_resumes_from_its_checkpoint(cluster: Cluster) -> None:
    c = cluster
    victim = c.sbatch(c.counter_script("victim", ENABLE, stop=25))
    c.wait_number(victim, 5)
    assert "stasis: job" in c.output(victim) and "is protected" in c.output(victim)
    node = c.job(victim)["NodeList"]
    preemptor = c.script(
        "preemptor",
        "echo preemptor; sleep 2",
        "--partition=high",
        "--cpus-per-task=8",
        f"--nodelist={node}",
        f"--output={c.work}/preemptor-%j.out",
    )
    pre = c.sbatch(preemptor)
    c.wait_state(victim, ("COMPLETED", "FAILED", "CANCELLED"), 150)
    assert c.state(pre) == "COMPLETED"
    assert "SIGURG: taking a checkpoint" in c.output(victim)
    resumed_once(c, victim, 25)


def test_a_checkpoint_asked_from_a_login_node_requeues_the_job(cluster: Cluster) -> None:
    c = cluster
    job = c.sbatch(c.counter_script("remote", ENABLE, stop=20), user=TEST_USER)
    c.wait_number(job, 3)
    port = re.search(r"^slurm_remote_port = (\d+)$", c.lay.config_of("n1").read_text(), re.M)
    assert port
    # As on a login node: no daemon here, another node name; the controller's slurm.conf.
    answer = c.run(
        "env",
        f"STASIS_SOCKET={Path(c.root) / 'no-daemon-here.sock'}",
        "STASIS_SLURM_NODE_NAME=login",
        f"STASIS_SLURM_REMOTE_PORT={port.group(1)}",
        STASIS,
        "dump",
        "--slurm-job",
        job,
        "--json",
        user=TEST_USER,
    ).stdout
    assert '"requeued": true' in answer, answer
    c.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 120)
    resumed_once(c, job, 20)


def test_a_worker_install_on_a_configless_node_puts_only_its_own_files(cluster: Cluster) -> None:
    c = cluster
    etc, lib = c.root / "node-etc", c.root / "node-lib"  # no slurm.conf there: a configless node
    args = ["slurm", "install", "--node-role", "worker", "--slurm-conf", str(etc / "slurm.conf")]
    out = c.on("n2", STASIS, *args, "--lib-dir", str(lib), "--no-systemd").stdout
    assert f"built {lib / 'stasis_spank.so'}" in out, out
    assert sorted(p.name for p in etc.iterdir()) == [".stasis-install.json"]
    # Off a configless node (here, where /run/slurm/conf has no copy) it is refused.
    refused = c.stasis(*args, "--lib-dir", str(lib), "--no-systemd", check=False)
    assert refused.returncode == 2 and "does not exist" in refused.stderr
    c.on("n2", STASIS, "slurm", "uninstall", "--slurm-conf", str(etc / "slurm.conf"))
    assert not lib.exists() or not any(lib.rglob("*.so"))
