"""A multi-node job's network identity (stasis/slurm/jobnetnode.py) and what `stasis slurm
install` writes with slurm_multinode (issue 31); the network itself on real nodes is
tests/e2e/test_mpi_jobnet.py's."""

from __future__ import annotations

import ipaddress
import os
import subprocess
from pathlib import Path

import pytest

from stasis.daemon import jobnet
from stasis.errors import StasisError
from stasis.slurm import jobnetnode
from tests.conftest import STASIS


def test_vni_per_cluster_and_job() -> None:
    assert jobnetnode.vni_of_job(1, 1) == (1 << 20) + 1
    # Two clusters' jobs of the same id never share a VXLAN; a cluster's block wraps.
    assert jobnetnode.vni_of_job(7, 1) != jobnetnode.vni_of_job(7, 2)
    assert jobnetnode.vni_of_job(5 + (1 << 20), 3) == jobnetnode.vni_of_job(5, 3)
    assert jobnetnode.vni_of_job((1 << 20) - 1, 15) == (1 << 24) - 1  # the largest VXLAN id
    for bad in (0, 16):
        with pytest.raises(StasisError, match="cluster number from 1 to 15"):
            jobnetnode.vni_of_job(1, bad)


def test_subnets_and_gateways() -> None:
    pool = ipaddress.IPv4Network("100.64.0.0/10")
    nets = {jobnetnode.subnet_of(jobnetnode.vni_of_job(j, 1)) for j in range(1, 16385)}
    assert len(nets) == 16384 and all(n.subnet_of(pool) and n.prefixlen == 24 for n in nets)
    vni = jobnetnode.vni_of_job(3, 1)
    net = jobnet.JobNet(vni, jobnetnode.subnet_of(vni))
    parts = {net.address(i) for i in range(4)}
    gateways = {jobnetnode.gateway(net, i) for i in range(4)}
    assert str(jobnetnode.gateway(net, 0)).endswith(".254") and not parts & gateways


@pytest.mark.parametrize("number", [0, 2])
def test_install_writes_the_setting(tmp_path: Path, number: int) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "slurm.conf").write_text(f"ClusterName=x\nPlugStackConfig={etc}/plugstack.conf\n")
    config = tmp_path / "stasis.toml"
    config.write_text(f"slurm_multinode = {number}\n")
    done = subprocess.run(
        [
            STASIS,
            "slurm",
            "install",
            "--node-role",
            "controller",
            "--node-role",
            "worker",
            "--slurm-conf",
            str(etc / "slurm.conf"),
            "--lib-dir",
            str(tmp_path / "lib"),
            "--no-systemd",
            "--stasis-config",
            str(config),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "STASIS_CONFIG": ""},
    )
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"local stasis_multinode = {number}\n" in (etc / "job_submit.lua").read_text()
    assert ("PrologFlags=Alloc" in (etc / "slurm.conf").read_text()) == bool(number)
    assert ("multinode=1" in (etc / "plugstack.conf").read_text()) == bool(number)
