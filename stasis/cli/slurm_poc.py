"""`stasis slurm poc start|status|report`: the 90-day proof of concept as a site runs it.

`start` measures the baseline from Slurm's accounting and records it with the opted-in set and
the agreed thresholds (stasis.slurm.poc.State) in <state_dir>/slurm-poc.json (root's; `--state`
for another file); `status` says how far it is; `report` measures protected and unprotected jobs
since the start against the baseline, each threshold passed or not (`--json`, `--html FILE`).
"""

from __future__ import annotations

import argparse
import getpass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stasis.cli import output
from stasis.cli.args import subcommands
from stasis.config import Settings
from stasis.errors import StasisError, UsageError

if TYPE_CHECKING:
    from stasis.slurm.poc import Split, State


def add_poc(sub: Any) -> None:
    """`stasis slurm poc ...` under `stasis slurm`."""
    top = sub.add_parser(
        "poc",
        help="The proof of concept: a baseline from Slurm's accounting, then protected "
        "against unprotected jobs, with thresholds passed or not.",
    )
    poc = subcommands(top)

    p = poc.add_parser(
        "start",
        help="Measure the baseline before now and record it with the opted-in set and the "
        "thresholds.",
    )
    _state(p)
    for what in ("users", "accounts", "partitions"):
        p.add_argument(
            f"--{what}",
            action="append",
            default=[],
            metavar="NAMES",
            help=f"Opt in these {what} (comma-separated; repeatable). A job is in the set "
            "when its user, account or partition is named.",
        )
    p.add_argument(
        "--days",
        type=_positive_int,
        default=90,
        help="How long the PoC runs (default: %(default)s).",
    )
    p.add_argument(
        "--baseline-days",
        type=_positive_int,
        default=90,
        help="The accounting history before the start that makes the baseline "
        "(default: %(default)s).",
    )
    p.add_argument(
        "--max-completion-increase-pct",
        type=_non_negative,
        default=10.0,
        metavar="PCT",
        help="Protected jobs' median completion time may be at most this much longer than "
        "the baseline's (default: %(default)g).",
    )
    p.add_argument(
        "--max-queue-wait-increase-s",
        type=_non_negative,
        default=300.0,
        metavar="SECONDS",
        help="Protected jobs' median queue wait may be at most this much longer than the "
        "baseline's (default: %(default)g).",
    )
    p.add_argument(
        "--max-exceptions-increase-pct",
        type=_non_negative,
        default=1.0,
        metavar="POINTS",
        help="The share of protected jobs ending FAILED, NODE_FAIL, OUT_OF_MEMORY... may be "
        "at most this many points over the baseline's (default: %(default)g).",
    )
    p.add_argument(
        "--window-h",
        type=float,
        default=24.0,
        metavar="HOURS",
        help="A job of the same user, name and directory starting this soon after a "
        "TIMEOUT is its resubmission (default: %(default)g).",
    )
    p.add_argument("--force", action="store_true", help="Replace a PoC already recorded.")
    p.set_defaults(handler=start)

    p = poc.add_parser("status", help="Days elapsed and the counts so far.")
    _state(p)
    p.add_argument("--json", action="store_true", help="Print one JSON value.")
    p.set_defaults(handler=status)

    p = poc.add_parser(
        "report",
        help="Protected and unprotected jobs since the start against the baseline, each "
        "threshold passed or not.",
    )
    _state(p)
    p.add_argument(
        "--until",
        metavar="DATE",
        help="End of the period, excluded (default: now, or the PoC's end if sooner).",
    )
    p.add_argument(
        "--checkpoint-cost-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="One checkpoint's cost where none was measured (default: 10).",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="Print one JSON value.")
    fmt.add_argument(
        "--html", type=Path, metavar="FILE", help="Write a self-contained page with charts to FILE."
    )
    p.set_defaults(handler=report)


def _state(p: Any) -> None:
    p.add_argument(
        "--state",
        type=Path,
        metavar="FILE",
        help="The PoC's record (default: <state_dir>/slurm-poc.json, root's).",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 3660:
        raise argparse.ArgumentTypeError(f"{value} is not in [1, 3660]")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1e9:
        raise argparse.ArgumentTypeError(f"{value:g} is not a number >= 0")
    return value


def _path(args: argparse.Namespace, settings: Settings) -> Path:
    from stasis.slurm.poc import default_path

    return Path(args.state) if args.state else default_path(settings.state_dir)


def _names(values: list[str]) -> list[str]:
    return sorted({n.strip() for v in values for n in v.split(",") if n.strip()})


def start(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.cli.slurm_report import model
    from stasis.slurm import poc

    if not 0 < args.window_h <= 24 * 366:
        raise UsageError(f"--window-h {args.window_h:g} is not in (0, 8784] hours")
    scope = poc.Scope(
        users=_names(args.users), accounts=_names(args.accounts), partitions=_names(args.partitions)
    )
    if not (scope.users or scope.accounts or scope.partitions):
        raise UsageError(
            "poc start needs the opted-in set: --users, --accounts or --partitions (names, "
            "comma-separated)"
        )
    path = _path(args, settings)
    if not args.force:
        poc.refuse_existing(path)  # before minutes of sacct
    # The start is the next whole second: sacct's times are whole seconds, and a job that ended
    # in the second the PoC started ended before it (the baseline's), not after.
    now = datetime.now()
    if now.microsecond:
        now = now.replace(microsecond=0) + timedelta(seconds=1)
    since = now - timedelta(days=args.baseline_days)
    window_s = int(args.window_h * 3600)
    split = poc.measure(
        poc.read_records(since, now, window_s),
        since,
        now,
        scope,
        window_s,
        model(settings, None),
    )
    state = poc.State(
        started=now,
        days=args.days,
        baseline_since=since,
        scope=scope,
        thresholds=poc.Thresholds(
            completion_increase_pct=args.max_completion_increase_pct,
            queue_wait_increase_s=args.max_queue_wait_increase_s,
            exceptions_increase_pct=args.max_exceptions_increase_pct,
        ),
        window_h=args.window_h,
        baseline=poc.baseline_of(split.in_scope),
        started_by=getpass.getuser(),
    )
    poc.save(path, state, replace=args.force)
    b = state.baseline
    output.plain(
        f"PoC started {now.isoformat(sep=' ')} for {args.days} days ({scope.said()}), "
        f"recorded in {path}"
    )
    output.plain(
        f"  baseline {since.isoformat(sep=' ')} to {now.isoformat(sep=' ')}: {b.jobs} jobs, "
        f"{b.timeout_jobs} TIMEOUT, {b.preempted_jobs} preempted, {b.resubmitted_jobs} "
        f"resubmitted, {_h(b.redone_node_hours)} node-hours redone, "
        f"{b.mem_overrequest_jobs} memory over-requests"
    )


def _h(value: float) -> str:
    from stasis.slurm.report_html import hours

    return hours(value)


def _measure(
    args: argparse.Namespace, settings: Settings, until_text: str | None
) -> tuple["State", "Split", datetime]:
    from stasis.cli.slurm_report import model
    from stasis.slurm import poc
    from stasis.slurm.report import parse_date

    state = poc.load(_path(args, settings))
    now = datetime.now().replace(microsecond=0)
    until = parse_date(until_text, "--until") if until_text else min(now, state.ends)
    if until <= state.started:
        raise UsageError(
            f"--until {until.isoformat(sep=' ')} is not after the PoC's start "
            f"{state.started.isoformat(sep=' ')}"
        )
    window_s = int(state.window_h * 3600)
    cost = getattr(args, "checkpoint_cost_s", None)
    split = poc.measure(
        poc.read_records(state.started, until, window_s),
        state.started,
        until,
        state.scope,
        window_s,
        model(settings, cost),
    )
    return state, split, until


def status(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.slurm import poc

    state, split, until = _measure(args, settings, None)
    elapsed = poc.days_between(state.started, until)
    p, u = split.protected, split.unprotected
    if args.json:
        output.emit_json(
            {
                "started": state.started.isoformat(timespec="seconds"),
                "days": state.days,
                "days_elapsed": elapsed,
                "until": until.isoformat(timespec="seconds"),
                "scope": state.scope.model_dump(),
                "protected": p.as_dict(),
                "unprotected": u.as_dict(),
            }
        )
        return
    output.plain(
        f"PoC started {state.started.isoformat(sep=' ')} ({state.scope.said()}): day "
        f"{elapsed:.1f} of {state.days}"
    )
    for name, m in (("protected", p), ("unprotected", u)):
        output.plain(
            f"  {name}: {m.jobs} jobs, {m.timeout_jobs} TIMEOUT, {m.preempted_jobs} preempted, "
            f"{m.resubmitted_jobs} resubmitted, {_h(m.redone_node_hours)} node-hours redone, "
            f"{m.exception_jobs} exceptions"
        )
    output.plain(
        f"  kept {_h(p.kept_node_hours)} node-hours, spent {_h(p.spent_node_hours)} in "
        f"{p.checkpoints} checkpoints: net {_h(p.net_node_hours)}"
    )


def report(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.slurm import poc

    if args.html:
        target = args.html.absolute()
        if not target.parent.is_dir():
            raise UsageError(f"--html {args.html}: directory {target.parent} does not exist")
    state, split, until = _measure(args, settings, args.until)
    verdicts = poc.verdicts(state, split.protected)
    if args.json:
        output.emit_json(
            {
                "started": state.started.isoformat(timespec="seconds"),
                "until": until.isoformat(timespec="seconds"),
                "days": state.days,
                "days_elapsed": poc.days_between(state.started, until),
                "scope": state.scope.model_dump(),
                "thresholds": state.thresholds.model_dump(),
                "baseline_since": state.baseline_since.isoformat(timespec="seconds"),
                "baseline": state.baseline.model_dump(),
                "protected": split.protected.as_dict(),
                "unprotected": split.unprotected.as_dict(),
                "protected_outside_scope": split.protected_outside,
                "verdicts": [
                    {
                        "name": v.name,
                        "limit": v.limit,
                        "baseline": v.baseline,
                        "protected": v.protected,
                        "passed": v.passed,
                    }
                    for v in verdicts
                ],
                "rows": poc.compare_rows(state, split),
                "weeks": [
                    {"week": w, "protected": p.as_dict(), "unprotected": u.as_dict()}
                    for w, (p, u) in poc.weeks_sorted(split)
                ],
            }
        )
        return
    if args.html:
        from stasis.slurm import poc_html

        try:
            target.write_text(poc_html.render(state, split, verdicts, until))
        except OSError as e:
            raise StasisError(f"cannot write {args.html}: {e.strerror}") from e
        output.plain(
            f"wrote {args.html}: {split.protected.jobs} protected and "
            f"{split.unprotected.jobs} unprotected jobs since {state.started.isoformat(sep=' ')}"
        )
        return
    output.plain(
        f"PoC since {state.started.isoformat(sep=' ')} ({state.scope.said()}) to "
        f"{until.isoformat(sep=' ')}, against the baseline from "
        f"{state.baseline_since.isoformat(sep=' ')}"
    )
    output.plain("")
    from stasis.slurm.poc_html import cell

    output.table(
        [
            {
                "measure": r["measure"],
                "baseline": cell(r["measure"], r["baseline"]),
                "protected": cell(r["measure"], r["protected"]),
                "unprotected": cell(r["measure"], r["unprotected"]),
            }
            for r in poc.compare_rows(state, split)
        ],
        ["measure", "baseline", "protected", "unprotected"],
    )
    output.plain("")
    for v in verdicts:
        unit = "v_" + v.unit
        output.plain(
            f"  {v.name}: {v.said()} ({cell(unit, v.protected)} against "
            f"{cell(unit, v.baseline)}; {v.limit})"
        )
