"""On a running cluster: `stasis slurm uninstall` and `install` take effect with `scontrol
reconfigure` alone (no restart of slurmctld or slurmd)."""

from __future__ import annotations

from stasis.slurm import scontrol
from tests.e2e.conftest import Cluster

ENABLE = "--export=STASIS_ENABLE=1"


def _controller_pid(cluster: Cluster) -> str:
    return (cluster.lay.slurm / "slurmctld.pid").read_text().strip()


def test_uninstall_and_install_apply_with_scontrol_reconfigure(cluster: Cluster) -> None:
    lay = cluster.lay
    controller = _controller_pid(cluster)
    installed = lay.slurm_conf.read_text()
    cluster.stasis("slurm", "uninstall", "--slurm-conf", str(lay.slurm_conf))
    assert "JobSubmitPlugins" not in lay.slurm_conf.read_text()
    cluster.run("scontrol", "reconfigure")
    plain = cluster.sbatch(cluster.counter_script("before", ENABLE, stop=2, interval=0.1))
    cluster.wait_state(plain, ("COMPLETED",))
    assert "stasis" not in cluster.output(plain)  # exactly as without stasis
    assert cluster.numbers(plain) == [0, 1]

    cluster.stasis(
        "slurm",
        "install",
        "--node-role",
        "controller",
        "--node-role",
        "worker",
        "--node-role",
        "login",
        "--slurm-conf",
        str(lay.slurm_conf),
        "--lib-dir",
        str(lay.lib),
        "--stasis-config",
        str(lay.stasis_config),
        "--no-systemd",
    )
    assert lay.slurm_conf.read_text() == installed
    cluster.run("scontrol", "reconfigure")
    job = cluster.sbatch(cluster.counter_script("after", ENABLE, stop=2, interval=0.1))
    cluster.wait_state(job, ("COMPLETED",))
    assert f"stasis: job {job} is protected" in cluster.output(job)
    assert "stasis-token=" in cluster.job(job)["AdminComment"]  # job_submit.lua is back
    if _reconfigure_keeps_the_process(cluster):
        assert _controller_pid(cluster) == controller
    else:  # Slurm's own restart: our install did not stop the controller or its jobs
        assert cluster.state(plain) == "COMPLETED" and cluster.state(job) == "COMPLETED"


def _reconfigure_keeps_the_process(cluster: Cluster) -> bool:
    """`scontrol reconfigure` re-reads slurm.conf in the running slurmctld on 22.05 (seen); on
    24.11 slurmctld starts itself anew under another pid (seen)."""
    return scontrol.parse_version(cluster.run("scontrol", "--version").stdout) < (24, 11)
