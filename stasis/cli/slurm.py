"""`stasis slurm ...`: the Slurm integration's commands (install, uninstall, local-cluster)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from stasis.cli import output
from stasis.daemon.client import Client, _seg


def dump_slurm_job(client: Client, slurm_job: str, leave_running: bool, as_json: bool) -> None:
    """`stasis dump --slurm-job JOBID`: through the node daemon."""
    from stasis.daemon.slurm import validate_slurm_job_id

    validate_slurm_job_id(slurm_job)
    with client:
        answer = client.request("POST", f"/slurm/jobs/{_seg(slurm_job)}/checkpoint",
                                {"leave_running": leave_running})
    if as_json:
        output.emit_json(answer)
        return
    then = "requeued; it resumes from it" if answer.get("requeued") else "still running"
    output.say(f"checkpoint {answer['checkpoint']} of Slurm job {slurm_job} "
                         f"(label {answer['label']}, {answer['size_bytes']} bytes, "
                         f"{answer['duration_s']:.2f} s); job {then}")


@click.group()
def slurm() -> None:
    """Slurm integration: plugin installer and a throwaway local cluster."""


_conf_option = click.option("--slurm-conf", type=click.Path(dir_okay=False, path_type=Path),
                            default=Path("/etc/slurm/slurm.conf"), show_default=True,
                            help="The cluster's slurm.conf (the lua scripts go beside it).")


@slurm.command()
@click.option("--node-role", "roles", multiple=True, required=True,
              type=click.Choice(["controller", "worker", "login"]),
              help="What this node is; repeat for a node with several roles.")
@_conf_option
@click.option("--lib-dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("/usr/local/lib/stasis"), show_default=True,
              help="Where the SPANK plugin and the launcher go (worker).")
@click.option("--stasis-config", type=click.Path(dir_okay=False, path_type=Path),
              help="The node daemon's config file (default: its own default).")
@click.option("--systemd-dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("/etc/systemd/system"), show_default=True,
              help="Where the daemon's unit file goes (worker).")
@click.option("--no-systemd", is_flag=True, help="Write no systemd unit.")
@click.option("--warn-s", type=click.IntRange(5, 3600), default=60, show_default=True,
              help="Seconds before the time limit the job is told to checkpoint "
                   "(at most a sixth of its time limit).")
@click.option("--dry-run", is_flag=True, help="Print the exact changes; change nothing.")
def install(roles: tuple[str, ...], slurm_conf: Path, lib_dir: Path, stasis_config: Path | None,
            systemd_dir: Path, no_systemd: bool, warn_s: int, dry_run: bool) -> None:
    """Install the plugin set on this node (idempotent; `scontrol reconfigure` applies it)."""
    from stasis.slurm import install as inst

    inst.install(inst.InstallOptions(
        roles=frozenset(roles), slurm_conf=slurm_conf.absolute(), lib_dir=lib_dir.absolute(),
        stasis_config=stasis_config.absolute() if stasis_config else None,
        systemd_dir=None if no_systemd else systemd_dir.absolute(), warn_s=warn_s,
    ), out=sys.stdout, dry_run=dry_run)


@slurm.command()
@_conf_option
@click.option("--dry-run", is_flag=True, help="Print what would be restored; change nothing.")
def uninstall(slurm_conf: Path, dry_run: bool) -> None:
    """Restore every file the installer touched, byte for byte."""
    from stasis.slurm import install as inst

    inst.uninstall(slurm_conf.absolute(), out=sys.stdout, dry_run=dry_run)


@slurm.group("local-cluster")
def local_cluster() -> None:
    """A throwaway single-node cluster (munge, slurmctld, slurmd, stasis daemon)."""


_dir_option = click.option("--dir", "root", type=click.Path(file_okay=False, path_type=Path),
                           default=Path("/tmp/stasis-local-cluster"), show_default=True,
                           help="The cluster's private directory.")


@local_cluster.command()
@_dir_option
@click.option("--cpus", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--grace-s", type=click.IntRange(1, 3600), default=10, show_default=True,
              help="GraceTime of the preemptable `low` partition.")
@click.option("--socket-group", default="stasis", show_default=True,
              help="Group allowed on the stasis daemon's socket (job users must be in it).")
@click.option("--json", "as_json", is_flag=True, help='Print {"slurm_conf": PATH}.')
def up(root: Path, cpus: int, grace_s: int, socket_group: str, as_json: bool) -> None:
    """Start the cluster; then SLURM_CONF=<dir>/etc/slurm.conf sbatch ... talks to it."""
    from stasis.slurm import cluster

    lay = cluster.up(root, cpus=cpus, grace_s=grace_s, socket_group=socket_group)
    if as_json:
        output.emit_json({"slurm_conf": str(lay.slurm_conf),
                          "stasis_config": str(lay.stasis_config)})
    else:
        output.say(f"local cluster up in {lay.root}\n"
                             f"  export SLURM_CONF={lay.slurm_conf} "
                             f"STASIS_CONFIG={lay.stasis_config}")


@local_cluster.command()
@_dir_option
def down(root: Path) -> None:
    """Cancel its jobs and stop its daemons (the directory and its logs stay)."""
    from stasis.slurm import cluster

    cluster.down(root)
    output.say(f"local cluster in {root} is down")


@local_cluster.command()
@_dir_option
@click.option("--json", "as_json", is_flag=True)
def status(root: Path, as_json: bool) -> None:
    """Which of its daemons run."""
    from stasis.slurm import cluster

    report = cluster.status(root)
    if as_json:
        output.emit_json(report)
    else:
        for name, alive in report["daemons"].items():
            output.say(f"{name}: {'running' if alive else 'stopped'}")
    if not report["running"]:
        sys.exit(1)


__all__ = ["dump_slurm_job", "slurm"]
