"""Slurm commands that act on whichever node a job runs on: `stasis dump --slurm-job JOBID` from
any node of the cluster, and `stasis slurm drain NODE`.

A job the local daemon runs is checkpointed through the unix socket, as before; any other goes
to the daemon of the node Slurm says it runs on (BatchHost, reached at its NodeAddr on
`slurm_remote_port`), with a munge credential saying who asks (stasis.slurm.remote).
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any, TypedDict

from stasis.cli import output
from stasis.cli.args import add_json
from stasis.client import Client
from stasis.config import Settings
from stasis.errors import DaemonAPIError, NotFoundError, UsageError
from stasis.poll import poll
from stasis.slurm import remote, scontrol
from stasis.wire import SlurmCheckpointAnswer

_DRAIN_POLL_S = 1.0
# What Slurm's Reason and a checkpoint's reason may hold (stasis.slurm.models' CheckpointRequest).
_REASON = re.compile(r"[A-Za-z0-9 ._:-]{1,60}")


def dump_slurm_job(settings: Settings, slurm_job: str, leave_running: bool, as_json: bool) -> None:
    """`stasis dump --slurm-job JOBID`: through this node's daemon when the job is under it,
    else through the daemon of the node the job runs on."""
    scontrol.validate_slurm_job_id(slurm_job)
    here = _checkpoint_here(settings, slurm_job, leave_running)
    if here is None or isinstance(here, DaemonAPIError):
        answer = _checkpoint_there(settings, slurm_job, leave_running, here)
    else:
        answer = here
    if as_json:
        output.emit_json(answer)
        return
    then = "requeued; it resumes from it" if answer["requeued"] else "still running"
    output.say(
        f"checkpoint {answer['checkpoint']} of Slurm job {slurm_job} "
        f"(label {answer['label']}, {answer['size_bytes']} bytes, "
        f"{answer['duration_s']:.2f} s); job {then}"
    )


def _checkpoint_here(
    settings: Settings, slurm_job: str, leave_running: bool
) -> SlurmCheckpointAnswer | DaemonAPIError | None:
    """The checkpoint from this node's daemon; None when the job's workload is not running
    under it (another node's job; a registration left by a run requeued from here), or the
    error saying why no daemon answers here (a login node has none)."""
    with Client(settings.socket) as client:
        try:
            registered = client.slurm_job(slurm_job)
        except NotFoundError:
            return None
        except DaemonAPIError as e:
            if e.status:
                raise
            return e
        if registered["state"] != "running":
            return None
        return client.slurm_checkpoint(slurm_job, leave_running=leave_running)


def _checkpoint_there(
    settings: Settings, slurm_job: str, leave_running: bool, local: DaemonAPIError | None
) -> SlurmCheckpointAnswer:
    info = scontrol.job_info(slurm_job)
    if info.state != "RUNNING" or not info.batch_host:
        raise UsageError(
            f"Slurm job {slurm_job} is not running ({info.state or 'no state'}); "
            "only a running job can be checkpointed"
        )
    here = remote.this_node(settings)
    if info.batch_host == here:
        if local is not None:
            raise local
        raise NotFoundError(
            f"Slurm job {slurm_job} runs on this node ({here}) but not under "
            "its stasis daemon (was it submitted with STASIS_ENABLE=1?)"
        )
    target = remote.remote_node(settings, info.batch_host, scontrol.node_address(info.batch_host))
    return remote.checkpoint(settings, target, slurm_job, leave_running)


class DrainReport(TypedDict):
    node: str
    requeued: list[remote.Requeued]
    failed: list[str]
    unprotected: list[str]  # jobs on the node not under stasis: they run until they end
    running: list[str]  # jobs still on the node when the command gave up waiting
    empty: bool
    empty_after_s: float | None  # from the drain's answer to the node found empty


def drain(args: argparse.Namespace, settings: Settings) -> None:
    """`stasis slurm drain NODE`: the node's daemon drains it in Slurm and checkpoints and
    requeues its protected jobs; then wait until Slurm runs nothing there."""
    node = scontrol.validate_node_name(args.node)
    if not _REASON.fullmatch(args.reason):
        raise UsageError(
            f"--reason {args.reason!r}: letters, digits, spaces and ._:- only, "
            "1 to 60 characters"
        )
    target = remote.remote_node(settings, node, scontrol.node_address(node))
    answer = remote.drain(settings, target, args.reason)
    requeued = {r["job"] for r in answer["requeued"]}
    failed = {f.split(":", 1)[0] for f in answer["failed"]}
    on_node = scontrol.jobs_on_node(node)
    unprotected = [j for j in on_node if j not in requeued | failed]
    start = time.monotonic()
    empty = not on_node or poll(
        lambda: not scontrol.jobs_on_node(node), args.timeout, _DRAIN_POLL_S
    )
    waited = round(time.monotonic() - start, 1)
    report = DrainReport(
        node=node,
        requeued=answer["requeued"],
        failed=answer["failed"],
        unprotected=unprotected,
        running=[] if empty else scontrol.jobs_on_node(node),
        empty=bool(empty),
        empty_after_s=waited if empty else None,
    )
    if args.json:
        output.emit_json(report)
    else:
        _say_drained(report, args.timeout)
    if not empty or report["failed"]:
        raise SystemExit(1)


def _say_drained(report: DrainReport, timeout_s: int) -> None:
    node = report["node"]
    output.plain(f"node {node} drained in Slurm: no new job starts there")
    for r in report["requeued"]:
        output.plain(
            f"Slurm job {r['job']}: checkpoint {r['checkpoint']}, requeued; it "
            "resumes from it where Slurm runs it next"
        )
    for f in report["failed"]:
        output.warn(f"Slurm job {f} (not checkpointed; it keeps running)")
    if report["unprotected"]:
        output.plain(
            f"not under stasis, running until they end: Slurm job(s) "
            f"{', '.join(report['unprotected'])}"
        )
    if report["empty"]:
        output.plain(f"node {node} is empty after {report['empty_after_s']:.1f} s")
    else:
        output.warn(
            f"node {node} is not empty after {timeout_s} s: Slurm job(s) "
            f"{', '.join(report['running'])} still run there"
        )


def add_remote(sub: Any) -> None:
    """`stasis slurm drain ...` under `stasis slurm`."""
    p = sub.add_parser(
        "drain",
        help="Drain NODE for maintenance: checkpoint and requeue its protected jobs, "
        "then wait until it is empty (root).",
        description="Drain NODE in Slurm (no new job starts there), checkpoint and requeue "
        "every job under stasis on it (they resume elsewhere from their "
        "checkpoints), then wait until Slurm runs nothing there. Jobs not under "
        "stasis are not touched: they run until they end. Root only, checked by "
        "NODE's daemon (munge); needs slurm_remote_port. Exit 1 when a checkpoint "
        "failed or the node is not empty in time.",
    )
    p.add_argument("node", metavar="NODE", help="The node's Slurm NodeName.")
    p.add_argument(
        "--reason",
        default="stasis drain",
        help="Slurm's Reason for the drain and the checkpoints' (letters, digits, "
        "' ._:-', at most 60; default: %(default)s).",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=300,
        metavar="S",
        help="Seconds to wait for the node to be empty after the checkpoints (0: "
        "do not wait; default: %(default)s).",
    )
    add_json(
        p,
        'Print {"node", "requeued": [{"job", "checkpoint"}], "failed", '
        '"unprotected", "running", "empty", "empty_after_s"}.',
    )
    p.set_defaults(handler=drain)


def _seconds(text: str) -> int:
    if not text.isdigit() or int(text) > 86400:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0..86400)")
    return int(text)


__all__ = ["add_remote", "drain", "dump_slurm_job"]
