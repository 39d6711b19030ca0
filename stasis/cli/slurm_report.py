"""`stasis slurm report`: what wall-time limits, over-requests and preemptions cost, from
Slurm's accounting (sacct), and whether checkpointing pays per partition and account.

The numbers come from stasis.slurm.report and stasis.slurm.payoff; this module reads the options
and prints: a table on the terminal, `--json`, `--csv`, or `--html FILE` (a page with charts).
The checkpoint costs measured on this node are asked of its daemon (`stasis slurm intervals`'
answer: the jobs running here); a daemon that does not answer leaves the stated default.
`stasis slurm poc` (stasis/cli/slurm_poc.py) is registered beside `report`, here.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stasis.cli import output
from stasis.config import Settings
from stasis.errors import StasisError, UsageError

if TYPE_CHECKING:
    from stasis.slurm.payoff import Model
    from stasis.slurm.report import Report


def add_report(sub: Any) -> None:
    """`stasis slurm report ...` under `stasis slurm`."""
    p = sub.add_parser(
        "report",
        help="What time limits, memory over-requests and preemptions cost, per user, "
        "account and partition, from Slurm's accounting (sacct).",
    )
    p.add_argument(
        "--since",
        metavar="DATE",
        help="Start of the period: YYYY-MM-DD or an ISO datetime, local time "
        "(default: 30 days before --until, at midnight).",
    )
    p.add_argument("--until", metavar="DATE", help="End of the period, excluded (default: now).")
    p.add_argument(
        "--window-h",
        type=_hours,
        default=24.0,
        metavar="HOURS",
        help="A job of the same user, name and directory starting this soon after a "
        "TIMEOUT is its resubmission (default: %(default)g).",
    )
    p.add_argument(
        "--checkpoint-cost-s",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="What one checkpoint costs a job (seconds frozen) in a partition where none was "
        "measured (default: 10).",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="Print one JSON value.")
    fmt.add_argument(
        "--csv", action="store_true", help="Print CSV: one row per user, account and partition."
    )
    fmt.add_argument(
        "--html", type=Path, metavar="FILE", help="Write a self-contained page with charts to FILE."
    )
    p.set_defaults(handler=report)
    from stasis.cli.slurm_poc import add_poc

    add_poc(sub)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"{value:g} is not in (0, 86400] seconds")
    return value


def measured_costs(settings: Settings) -> dict[str, list[float]]:
    """Per partition: the frozen seconds the node daemon last measured for each job running
    here (none when it does not answer: the report goes on with the default)."""
    from stasis.client import Client

    found: dict[str, list[float]] = {}
    try:
        with Client(settings.socket, timeout_s=10) as client:
            entries = client.slurm_intervals()
    except StasisError:
        return found
    for e in entries:
        cost = e.get("cost_s")
        if e.get("cost_measured") and isinstance(cost, (int, float)) and e.get("partition"):
            found.setdefault(str(e["partition"]), []).append(float(cost))
    return found


def model(settings: Settings, cost_s: float | None) -> "Model":
    from stasis.slurm.payoff import DEFAULT_COST_S, Model

    return Model(
        floor_s=settings.interval_min_s,
        ceiling_s=settings.interval_max_s,
        default_cost_s=cost_s if cost_s is not None else DEFAULT_COST_S,
        measured=measured_costs(settings),
    )


def _hours(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of hours") from None
    if not 0 < value <= 24 * 366:
        raise argparse.ArgumentTypeError(f"{value:g} is not in (0, 8784] hours")
    return value


def report(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.slurm import payoff
    from stasis.slurm import report as rep

    since, until = rep.period(args.since, args.until)
    window_s = int(args.window_h * 3600)
    if args.html:
        target = args.html.absolute()
        if not target.parent.is_dir():
            raise UsageError(f"--html {args.html}: directory {target.parent} does not exist")
    result = payoff.read(since, until, window_s, model(settings, args.checkpoint_cost_s))
    if args.json:
        output.emit_json(result.as_dict())
    elif args.csv:
        sys.stdout.write(to_csv(result))
    elif args.html:
        from stasis.slurm import report_html

        try:
            target.write_text(report_html.render(result))
        except OSError as e:
            raise StasisError(f"cannot write {args.html}: {e.strerror}") from e
        output.plain(
            f"wrote {args.html}: {result.totals.jobs} jobs, "
            f"{since.isoformat(sep=' ')} to {until.isoformat(sep=' ')}"
        )
    else:
        show(result)


def to_csv(result: "Report") -> str:
    from stasis.slurm.report import GROUP_COLUMNS

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=GROUP_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(result.group_rows())
    return buf.getvalue()


def _h(value: float) -> str:
    from stasis.slurm.report_html import hours

    return hours(value)


def show(result: "Report") -> None:
    t = result.totals
    output.plain(
        f"Slurm jobs that ended {result.since.isoformat(sep=' ')} to "
        f"{result.until.isoformat(sep=' ')}: {t.jobs}, {_h(t.node_hours)} node-hours"
    )
    output.plain(
        f"  TIMEOUT: {t.timeout_jobs} jobs, {_h(t.timeout_node_hours)} node-hours, "
        f"{_h(t.timeout_gpu_hours)} GPU-hours ({_h(t.timeout_overshoot_node_hours)} "
        "past the limit)"
    )
    output.plain(
        f"  resubmitted after a TIMEOUT: {t.resubmitted_jobs} jobs, "
        f"{_h(t.resubmit_redone_node_hours)} node-hours redone"
    )
    output.plain(
        f"  memory: {t.mem_overrequest_jobs} of {t.mem_measured_jobs} measured jobs "
        f"used under half their request, {_h(t.mem_blocked_node_hours)} node-hours "
        "blocked"
    )
    output.plain(
        f"  preempted or requeued: {t.preempted_jobs} jobs, "
        f"{_h(t.preempt_redone_node_hours)} node-hours redone; stasis kept "
        f"{_h(t.kept_node_hours)} node-hours of {t.protected_jobs} protected jobs"
    )
    output.plain(
        f"  checkpointing protected jobs: {t.checkpoints} checkpoints, "
        f"{_h(t.spent_node_hours)} node-hours frozen; net kept {_h(t.net_node_hours)} node-hours"
    )
    if not result.groups:
        return
    rows = [
        {
            "user": u,
            "account": a,
            "partition": p,
            "jobs": c.jobs,
            "node-h": _h(c.node_hours),
            "timeout": c.timeout_jobs,
            "timeout node-h": _h(c.timeout_node_hours),
            "GPU-h": _h(c.timeout_gpu_hours),
            "resubmitted": c.resubmitted_jobs,
            "redone": _h(c.resubmit_redone_node_hours),
            "mem over": c.mem_overrequest_jobs,
            "blocked": _h(c.mem_blocked_node_hours),
            "preempted": c.preempted_jobs,
            "preempt redone": _h(c.preempt_redone_node_hours),
            "kept": _h(c.kept_node_hours),
        }
        for (u, a, p), c in sorted(result.groups.items())
    ]
    output.plain("")
    output.table(rows, list(rows[0]))
    show_payoff(result)


def _s(seconds: float) -> str:
    from stasis.interval import duration

    return duration(seconds)


def show_payoff(result: "Report") -> None:
    """Per partition: the rate used and auto's interval; per account and partition: kept
    against spent, the net on one line."""
    output.plain("")
    output.plain("Interruptions and STASIS_INTERVAL=auto per partition:")
    output.table(
        [
            {
                "partition": p.partition,
                "interruptions": p.interruptions,
                "node-h": _h(p.node_hours),
                "per node-h": f"{p.rate_per_node_hour:.4g}",
                "nodes": p.nodes,
                "cost": _s(p.cost_s),
                "cost from": p.cost_source,
                "auto interval": _s(p.interval_s),
                "bound": p.bound or "-",
            }
            for _, p in sorted(result.partitions.items())
        ],
        [
            "partition",
            "interruptions",
            "node-h",
            "per node-h",
            "nodes",
            "cost",
            "cost from",
            "auto interval",
            "bound",
        ],
    )
    output.plain("")
    output.plain("Protected jobs: node-hours kept against node-hours spent checkpointing:")
    output.table(
        [
            {
                "account": a,
                "partition": p,
                "per node-h": f"{part.rate_per_node_hour:.4g}" if part else "-",
                "auto interval": _s(part.interval_s) if part else "-",
                "restored": c.protected_jobs,
                "kept": _h(c.kept_node_hours),
                "checkpoints": c.checkpoints,
                "spent": _h(c.spent_node_hours),
                "net": _h(c.net_node_hours),
            }
            for a, p, c, part in result.accounts()
        ],
        [
            "account",
            "partition",
            "per node-h",
            "auto interval",
            "restored",
            "kept",
            "checkpoints",
            "spent",
            "net",
        ],
    )
