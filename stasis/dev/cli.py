"""`stasis-dev` (`python -m stasis.dev`): starts the harnesses of stasis.dev, the ones tests,
benches and demos use; usage errors and refusals are one line, as `stasis`'s own commands."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from stasis.cli import output
from stasis.cli.args import Parser, add_json, int_range, subcommands
from stasis.dev import k8snode, slurmcluster
from stasis.dev.demo import main as demo_main
from stasis.errors import StasisError, UsageError

Handler = Callable[[argparse.Namespace], None]


def parser() -> Parser:
    """The `stasis-dev` parser."""
    top = Parser(prog="stasis-dev", description="The test bench and demos of stasis.")
    commands = subcommands(top)
    _add_local_cluster(commands)
    _add_local_node(commands)
    p = commands.add_parser(
        "demo", help="`make demo`: a job checkpointed, killed, restored; then Slurm preemption."
    )
    p.set_defaults(handler=demo)
    return top


def _add_local_cluster(commands: Any) -> None:
    local = commands.add_parser(
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
    _dir_option(p, "/tmp/stasis-local-cluster", "cluster")
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
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Slurm as sites run it, the default (but with --job-container): proctrack/cgroup "
        "and task/cgroup with ConstrainRAMSpace (--mem is a hard limit), each node's slurmd "
        "in a cgroup subtree of its own (cgroup/v2 where the machine has it, else v1). "
        "--no-cgroup: proctrack/linuxproc and task/none, no memory limit.",
    )
    p.add_argument(
        "--configless",
        action="store_true",
        help="Slurm's configless mode: slurmctld serves its configuration, each node's slurmd "
        "fetches it (--conf-server) and the nodes have no slurm.conf of their own; needs "
        "--nodes 2 or more.",
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
    p.set_defaults(handler=cluster_up)
    p.add_argument(
        "--accounting",
        action="store_true",
        help="Also start slurmdbd with a private MariaDB (sacct, `stasis slurm " "report`).",
    )
    p = lsub.add_parser(
        "down", help="Cancel its jobs and stop its daemons (the directory and " "its logs stay)."
    )
    _dir_option(p, "/tmp/stasis-local-cluster", "cluster")
    p.set_defaults(handler=cluster_down)
    p = lsub.add_parser("status", help="Which of its daemons run.")
    _dir_option(p, "/tmp/stasis-local-cluster", "cluster")
    add_json(p)
    p.set_defaults(handler=cluster_status)
    p = lsub.add_parser(
        "exec",
        help="Run a command on a node: inside its namespaces, with its "
        "stasis config and the cluster's SLURM_CONF.",
    )
    _dir_option(p, "/tmp/stasis-local-cluster", "cluster")
    p.add_argument("node", help="The node (n1, n2, ...).")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    p.set_defaults(handler=cluster_exec)
    p = lsub.add_parser(
        "kill-node",
        help="The node fails: its slurmd, stasis daemon and job "
        "processes killed without warning.",
    )
    _dir_option(p, "/tmp/stasis-local-cluster", "cluster")
    p.add_argument("node")
    p.set_defaults(handler=cluster_kill_node)
    p = lsub.add_parser("start-node", help="Start a killed node's daemons again.")
    _dir_option(p, "/tmp/stasis-local-cluster", "cluster")
    p.add_argument("node")
    p.set_defaults(handler=cluster_start_node)


def _dir_option(p: argparse.ArgumentParser, default: str, what: str) -> None:
    p.add_argument(
        "--dir",
        dest="root",
        type=Path,
        default=Path(default),
        help=f"The {what}'s private directory (default: %(default)s).",
    )


def cluster_up(args: argparse.Namespace) -> None:
    lay = slurmcluster.up(
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
        configless=args.configless,
    )
    cgroup = slurmcluster.status(lay.root)["cgroup"]
    if args.json:
        output.emit_json(
            {
                "slurm_conf": str(lay.slurm_conf),
                "stasis_config": str(lay.stasis_config),
                "nodes": lay.nodes(),
                "cgroup": cgroup,
            }
        )
    else:
        tracking = (
            f"proctrack/cgroup and task/cgroup (cgroup/{cgroup}, --mem a hard limit)"
            if cgroup
            else "proctrack/linuxproc and task/none (no memory limit)"
        )
        output.say(
            f"local cluster up in {lay.root}: node(s) {', '.join(lay.nodes())}; {tracking}\n"
            f"  export SLURM_CONF={lay.slurm_conf} STASIS_CONFIG={lay.stasis_config}"
        )
        if len(lay.nodes()) > 1:
            output.say(
                f"  on a node: stasis-dev local-cluster exec --dir {lay.root} "
                f"{lay.nodes()[1]} -- CMD ..."
            )


def cluster_down(args: argparse.Namespace) -> None:
    slurmcluster.down(args.root)
    output.say(f"local cluster in {args.root} is down")


def cluster_exec(args: argparse.Namespace) -> None:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise UsageError("give the command to run after --")
    full, env = slurmcluster.exec_argv(args.root, args.node, argv)
    try:
        os.execvpe(full[0], full, env)
    except OSError as e:
        raise UsageError(f"cannot run {full[0]}: {e.strerror}") from None


def cluster_kill_node(args: argparse.Namespace) -> None:
    killed = slurmcluster.kill_node(args.root, args.node)
    output.say(f"node {args.node} killed ({len(killed)} processes)")


def cluster_start_node(args: argparse.Namespace) -> None:
    slurmcluster.start_node(args.root, args.node)
    output.say(f"node {args.node} started again")


def cluster_status(args: argparse.Namespace) -> None:
    report = slurmcluster.status(args.root)
    if args.json:
        output.emit_json(report)
    else:
        for name, alive in report["daemons"].items():
            output.say(f"{name}: {'running' if alive else 'stopped'}")
    if not report["running"]:
        sys.exit(1)


def _add_local_node(commands: Any) -> None:
    local = commands.add_parser(
        "local-node",
        help="A private containerd (own root, state and "
        "socket) with the stasis runtime, and a daemon.",
    )
    lsub = subcommands(local)
    p = lsub.add_parser(
        "up",
        help="Start it; `ctr -a ADDRESS -n NAMESPACE run --runtime "
        "RUNTIME ...` then runs containers through stasis.",
    )
    _dir_option(p, "/tmp/stasis-local-node", "node")
    p.add_argument("--store", default="", help="Checkpoint store (default: DIR/stasis/store).")
    p.add_argument(
        "--bundle",
        action="store_true",
        help="Run stasis-runc and CRIU from a host bundle (DIR/runtime), as on a "
        "node the agent installed, not from this venv.",
    )
    p.add_argument(
        "--separate",
        action="store_true",
        help="A host of its own: containerd, the daemon and the containers in their "
        "own mount, UTS and network namespaces, with their own /tmp, /var/tmp, "
        "/dev/shm and /run (runc's state), host name (--node-name, or DIR's "
        "name) and address on a bridge of the local nodes (10.213.252.0/24). "
        "`--json` gives the node_prefix that runs a command inside it.",
    )
    p.add_argument(
        "--kubeconfig",
        default="",
        help="The Kubernetes API the daemon drains this node in (default: none).",
    )
    p.add_argument(
        "--node-name", default="", help="This node's name in that API (default: the host name)."
    )
    p.add_argument(
        "--min-interval",
        type=int,
        default=None,
        metavar="SECONDS",
        help="Floor on containers' checkpoint intervals (default: the daemon's, " "60).",
    )
    add_json(p, 'Print {"containerd_address": PATH, "runtime": NAME, "namespace": NS, ...}.')
    p.set_defaults(handler=node_up)
    p = lsub.add_parser(
        "down",
        help="Kill its containers, stop containerd and the daemon "
        "(the directory and its logs stay).",
    )
    _dir_option(p, "/tmp/stasis-local-node", "node")
    p.set_defaults(handler=node_down)


def node_up(args: argparse.Namespace) -> None:
    if args.min_interval is not None and args.min_interval < 0:
        raise UsageError(f"--min-interval {args.min_interval}: seconds, 0 or more")
    lay = k8snode.up(
        args.root,
        store=args.store,
        bundle=args.bundle,
        kubeconfig=args.kubeconfig,
        node_name=args.node_name,
        min_interval_s=args.min_interval,
        separate=args.separate,
    )
    info = lay.describe()
    if args.json:
        output.emit_json(info)
    else:
        output.say(
            f"local node up in {lay.root}\n  ctr -a {info['containerd_address']} -n "
            f"{info['namespace']} run --runtime {info['runtime']} IMAGE ID ..."
        )


def node_down(args: argparse.Namespace) -> None:
    k8snode.down(args.root)
    output.say(f"local node in {args.root} is down")


def demo(args: argparse.Namespace) -> None:
    demo_main()


def main(argv: list[str] | None = None) -> NoReturn:
    """Settings are not read here: each harness writes the config of the daemons it starts."""
    try:
        args = parser().parse_args(sys.argv[1:] if argv is None else argv)
        handler: Handler = args.handler
        handler(args)
    except StasisError as e:
        output.fail(str(e))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0)


__all__ = ["main", "parser"]
