"""`stasis slurm ...`: the Slurm integration's commands (install, uninstall, local-cluster;
drain in stasis/cli/slurm_remote.py, report in stasis/cli/slurm_report.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from stasis.cli import output
from stasis.cli.args import add_json, int_range, subcommands
from stasis.client import Client
from stasis.config import Settings


def add_slurm(commands: Any) -> None:
    """`stasis slurm install|uninstall|local-cluster ...` under the `stasis` parser."""
    top = commands.add_parser(
        "slurm", help="Slurm integration: plugin installer and a " "throwaway local cluster."
    )
    sub = subcommands(top)

    p = sub.add_parser(
        "install",
        help="Install the plugin set on this node (idempotent; "
        "`scontrol reconfigure` applies it).",
    )
    p.add_argument(
        "--node-role",
        dest="roles",
        action="append",
        required=True,
        choices=["controller", "worker", "login"],
        help="What this node is; repeat for a node with several roles.",
    )
    _conf_option(p)
    p.add_argument(
        "--lib-dir",
        type=Path,
        default=Path("/usr/local/lib/stasis"),
        help="Where the SPANK plugin and the launcher go (worker; default: " "%(default)s).",
    )
    p.add_argument(
        "--stasis-config",
        type=Path,
        help="The node daemon's config file (default: its own default).",
    )
    p.add_argument(
        "--systemd-dir",
        type=Path,
        default=Path("/etc/systemd/system"),
        help="Where the daemon's unit file goes (worker; default: %(default)s).",
    )
    p.add_argument("--no-systemd", action="store_true", help="Write no systemd unit.")
    p.add_argument(
        "--warn-s",
        type=int_range(5, 3600),
        default=60,
        help="Seconds before the time limit the job is told to checkpoint (at most "
        "a sixth of its time limit; default: %(default)s).",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="Print the exact changes; change nothing."
    )
    p.set_defaults(handler=install)

    p = sub.add_parser(
        "uninstall", help="Restore every file the installer touched, byte for " "byte."
    )
    _conf_option(p)
    p.add_argument(
        "--dry-run", action="store_true", help="Print what would be restored; change nothing."
    )
    p.set_defaults(handler=uninstall)

    local = sub.add_parser(
        "local-cluster",
        help="A throwaway cluster on this machine (munge, "
        "slurmctld, slurmd and a stasis daemon per "
        "node).",
    )
    lsub = subcommands(local)
    p = lsub.add_parser(
        "up",
        help="Start the cluster; then SLURM_CONF=<dir>/etc/slurm.conf " "sbatch ... talks to it.",
    )
    _dir_option(p)
    p.add_argument(
        "--nodes",
        type=int_range(1, 16),
        default=1,
        help="Nodes n1..nN; several are each a host of their own (a network and a "
        "UTS namespace, an address on a private bridge), sharing the store "
        "(default: %(default)s).",
    )
    p.add_argument(
        "--without-stasis",
        action="append",
        default=[],
        metavar="NODE",
        help="A node with no stasis at all (no plugin, no daemon); repeatable.",
    )
    p.add_argument(
        "--cpus", type=int_range(1, 256), default=8, help="CPUs of each node (default: %(default)s)"
    )
    p.add_argument(
        "--gpus",
        type=int_range(0, 64),
        default=0,
        help="GPUs of each node as Slurm counts them (`--gres=gpu:N`, GPU-hours in "
        "accounting); without devices (default: %(default)s).",
    )
    p.add_argument(
        "--job-container",
        action="store_true",
        help="Each job in a mount namespace with a private /tmp and /dev/shm "
        "(Slurm's job_container/tmpfs); --dir must not be under /tmp.",
    )
    p.add_argument(
        "--cgroup",
        action="store_true",
        help="Slurm as sites run it: proctrack/cgroup and task/cgroup with "
        "ConstrainRAMSpace (--mem is a hard limit), each node's slurmd in a "
        "cgroup subtree of its own (cgroup/v2 where the machine has it, else "
        "v1).",
    )
    p.add_argument(
        "--grace-s",
        type=int_range(1, 3600),
        default=10,
        help="GraceTime of the preemptable `low` partition (default: %(default)s).",
    )
    p.add_argument(
        "--socket-group",
        default="",
        help="Restrict the stasis daemons' sockets to this group (default: every "
        "local user, each acting on their own jobs).",
    )
    add_json(p, 'Print {"slurm_conf": PATH, "stasis_config": PATH, "nodes": [NAMES]}.')
    p.set_defaults(handler=up)
    p.add_argument(
        "--accounting",
        action="store_true",
        help="Also start slurmdbd with a private MariaDB (sacct, `stasis slurm " "report`).",
    )
    p = lsub.add_parser(
        "down", help="Cancel its jobs and stop its daemons (the directory and " "its logs stay)."
    )
    _dir_option(p)
    p.set_defaults(handler=down)
    p = lsub.add_parser("status", help="Which of its daemons run.")
    _dir_option(p)
    add_json(p)
    p.set_defaults(handler=status)
    p = lsub.add_parser(
        "exec",
        help="Run a command on a node: inside its namespaces, with its "
        "stasis config and the cluster's SLURM_CONF.",
    )
    _dir_option(p)
    p.add_argument("node", help="The node (n1, n2, ...).")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    p.set_defaults(handler=exec_on)
    p = lsub.add_parser(
        "kill-node",
        help="The node fails: its slurmd, stasis daemon and job "
        "processes killed without warning.",
    )
    _dir_option(p)
    p.add_argument("node")
    p.set_defaults(handler=kill_node)
    p = lsub.add_parser("start-node", help="Start a killed node's daemons again.")
    _dir_option(p)
    p.add_argument("node")
    p.set_defaults(handler=start_node)

    from stasis.cli.slurm_intervals import add_intervals
    from stasis.cli.slurm_remote import add_remote
    from stasis.cli.slurm_report import add_report

    add_remote(sub)
    add_report(sub)
    add_intervals(sub)


def _conf_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--slurm-conf",
        type=Path,
        default=Path("/etc/slurm/slurm.conf"),
        help="The cluster's slurm.conf (the lua scripts go beside it; default: " "%(default)s).",
    )


def _dir_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir",
        dest="root",
        type=Path,
        default=Path("/tmp/stasis-local-cluster"),
        help="The cluster's private directory (default: %(default)s).",
    )


def install(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.slurm import install as inst

    inst.install(
        inst.InstallOptions(
            roles=frozenset(args.roles),
            slurm_conf=args.slurm_conf.absolute(),
            lib_dir=args.lib_dir.absolute(),
            stasis_config=args.stasis_config.absolute() if args.stasis_config else None,
            systemd_dir=None if args.no_systemd else args.systemd_dir.absolute(),
            warn_s=args.warn_s,
        ),
        out=sys.stdout,
        dry_run=args.dry_run,
    )


def uninstall(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.slurm import install as inst

    inst.uninstall(args.slurm_conf.absolute(), out=sys.stdout, dry_run=args.dry_run)


def up(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.slurm import cluster

    lay = cluster.up(
        args.root,
        cpus=args.cpus,
        grace_s=args.grace_s,
        socket_group=args.socket_group,
        accounting=args.accounting,
        nodes=args.nodes,
        without_stasis=tuple(args.without_stasis),
        gpus=args.gpus,
        job_container=args.job_container,
        cgroup=args.cgroup,
    )
    if args.json:
        output.emit_json(
            {
                "slurm_conf": str(lay.slurm_conf),
                "stasis_config": str(lay.stasis_config),
                "nodes": lay.nodes(),
            }
        )
    else:
        output.say(
            f"local cluster up in {lay.root}: node(s) {', '.join(lay.nodes())}\n"
            f"  export SLURM_CONF={lay.slurm_conf} STASIS_CONFIG={lay.stasis_config}"
        )
        if len(lay.nodes()) > 1:
            output.say(
                f"  on a node: stasis slurm local-cluster exec --dir {lay.root} "
                f"{lay.nodes()[1]} -- CMD ..."
            )


def down(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.slurm import cluster

    cluster.down(args.root)
    output.say(f"local cluster in {args.root} is down")


def exec_on(args: argparse.Namespace, settings: Settings) -> None:
    import os

    from stasis.errors import UsageError
    from stasis.slurm import cluster

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise UsageError("give the command to run after --")
    full, env = cluster.exec_argv(args.root, args.node, argv)
    try:
        os.execvpe(full[0], full, env)
    except OSError as e:
        raise UsageError(f"cannot run {full[0]}: {e.strerror}") from None


def kill_node(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.slurm import cluster

    killed = cluster.kill_node(args.root, args.node)
    output.say(f"node {args.node} killed ({len(killed)} processes)")


def start_node(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.slurm import cluster

    cluster.start_node(args.root, args.node)
    output.say(f"node {args.node} started again")


def status(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.slurm import cluster

    report = cluster.status(args.root)
    if args.json:
        output.emit_json(report)
    else:
        for name, alive in report["daemons"].items():
            output.say(f"{name}: {'running' if alive else 'stopped'}")
    if not report["running"]:
        sys.exit(1)


__all__ = ["add_slurm"]
