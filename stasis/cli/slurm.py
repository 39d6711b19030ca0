"""`stasis slurm ...`: the Slurm integration's commands (install, uninstall;
drain in stasis/cli/slurm_remote.py, report in stasis/cli/slurm_report.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from stasis.cli.args import int_range, subcommands
from stasis.config import Settings


def add_slurm(commands: Any) -> None:
    """`stasis slurm install|uninstall|drain|report|intervals ...` under the `stasis` parser."""
    top = commands.add_parser("slurm", help="Slurm integration: plugin installer, drain, reports.")
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


__all__ = ["add_slurm"]
