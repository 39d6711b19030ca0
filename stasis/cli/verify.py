"""`stasis verify CHECKPOINT`: restore it in a sandbox, check its whole tree came back, remove it;
the verdict is recorded (signed) in the store, and shown by `stasis checkpoints`."""

from __future__ import annotations

import argparse
from typing import Any

from stasis.cli import output
from stasis.cli.args import add_json
from stasis.client import Client
from stasis.config import Settings
from stasis.errors import RestoreError


def verify(args: argparse.Namespace, settings: Settings) -> None:
    with Client(settings.socket) as client:
        verdict = client.verify(args.checkpoint)
    if args.json:
        output.emit_json(verdict)
    if not verdict["ok"]:
        raise RestoreError(
            f"checkpoint {verdict['checkpoint']} failed verification: " f"{verdict['reason']}"
        )
    if not args.json:
        output.say(
            f"checkpoint {verdict['checkpoint']} verified: its {verdict['processes']} "
            f"process(es) restored in a sandbox on {verdict['node']} "
            f"({verdict['duration_s']:g} s)"
        )


def add_verify(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="Restore CHECKPOINT in a sandbox (stopped, no network, "
        "removed after) to know it will come back; records the "
        "verdict in the store.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    add_json(p)
    p.set_defaults(handler=verify)


def verdict_column(checkpoint: dict[str, Any]) -> str:
    """What `stasis checkpoints` shows of a checkpoint's verdict."""
    found = checkpoint.get("verdict")
    if not isinstance(found, dict):
        return "-"
    return "ok" if found.get("ok") else "failed"
