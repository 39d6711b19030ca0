"""`stasis slurm intervals`: each Slurm job's periodic checkpoint interval on this node, and why
(STASIS_INTERVAL=<seconds> as asked; `auto`: Young/Daly from its checkpoint cost and its
partition's interruption rate, stasis.slurm.intervals)."""

from __future__ import annotations

import argparse
from typing import Any

from stasis.cli import output
from stasis.cli.args import add_json
from stasis.client import Client
from stasis.config import Settings


def add_intervals(sub: Any) -> None:
    p = sub.add_parser(
        "intervals",
        help="Each Slurm job's periodic checkpoint interval on this "
        "node, and why (root: every job; a user: their own).",
    )
    add_json(p)
    p.set_defaults(handler=intervals)


def intervals(args: argparse.Namespace, settings: Settings) -> None:
    with Client(settings.socket) as client:
        found = client.slurm_intervals()
    if args.json:
        output.emit_json(found)
        return
    output.table(
        [
            {
                "job": e["slurm_job"],
                "user": e["user"],
                "partition": e["partition"],
                "asked": e["requested"],
                "interval_s": f"{e['interval_s']:.1f}",
                "why": e["why"],
            }
            for e in found
        ],
        ["job", "user", "partition", "asked", "interval_s", "why"],
    )
