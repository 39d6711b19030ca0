"""`stasis`: run, dump, restore, ps, checkpoints, kill, logs, check, daemon (and `slurm ...`,
`k8s ...`, `controlplane ...`).

Built on argparse, not click: importing click cost ~40 ms of every command on these machines,
most of what `stasis dump` and `stasis restore` took over the plain `criu` command that issue 4
holds them against (argparse: ~10 ms).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from stasis.cli import output
from stasis.cli.args import Parser, add_json, subcommands
from stasis.client import Client
from stasis.config import Settings, load_settings
from stasis.errors import StasisError, UsageError

if TYPE_CHECKING:
    from stasis import wire

Handler = Callable[[argparse.Namespace, Settings], None]


def run(args: argparse.Namespace, settings: Settings) -> None:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("give the COMMAND to run, after the options: stasis run [...] -- CMD")
    env_map: dict[str, str] = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {item!r}: expected NAME=VALUE")
        env_map[key] = value
    with Client(settings.socket) as client:
        answer = client.run(
            command=command,
            label=args.label,
            cwd=os.path.abspath(args.cwd or os.getcwd()),
            log=os.path.abspath(args.log) if args.log else None,
            env=env_map,
            user=args.user,
            private_tmp=args.private_tmp,
        )
    if args.json:
        output.emit_json(answer)
    else:
        output.say(f"job {answer['job']} running as pid {answer['pid']} (label {answer['label']})")


def dump(args: argparse.Namespace, settings: Settings) -> None:
    if args.check and args.slurm_job is not None:
        raise UsageError("--check looks at a stasis JOB; it cannot check a --slurm-job")
    if args.container is not None:
        if args.job is not None or args.slurm_job is not None:
            raise UsageError("give one of JOB, --slurm-job JOBID or --container ID")
        from stasis.cli.k8s import dump_container

        dump_container(Client(settings.socket), args.container, args.leave_running, args.json)
        return
    if args.slurm_job is not None or args.job is None:
        if args.job is not None or args.slurm_job is None:
            raise UsageError("give either a JOB id or --slurm-job JOBID")
        from stasis.cli.slurm_remote import dump_slurm_job

        dump_slurm_job(settings, args.slurm_job, args.leave_running, args.json)
        return
    if args.check:
        dump_check(args, settings)
        return
    with (
        Client(settings.socket) as client,
        output.progress_bar("dumping", not args.json) as progress,
    ):
        answer = client.dump(
            args.job,
            progress,
            leave_running=args.leave_running,
            label=args.label,
            compress=args.compress,
            incremental=args.incremental,
            encrypt=args.encrypt,
        )
    _done(
        args,
        answer,
        f"checkpoint {answer['checkpoint']} (label {answer['label']}, "
        f"{answer['size_bytes']} bytes, {answer['duration_s']:.2f} s)",
    )


def _done(
    args: argparse.Namespace, answer: wire.DumpAnswer | wire.RestoreAnswer, line: str
) -> None:
    """A dump's or restore's answer: its notes on stderr, then JSON or one line."""
    output.notes(answer)
    if args.json:
        output.emit_json(answer)
    else:
        output.say(line)


def dump_check(args: argparse.Namespace, settings: Settings) -> None:
    """`dump --check`: exit 0 when nothing is known to block a dump of the job, else 1."""
    with Client(settings.socket) as client:
        answer = client.dump_check(args.job)
    if args.json:
        output.emit_json(answer)
    else:
        if answer["obstacles"]:
            output.plain(f"job {args.job} cannot be dumped as it is:")
            for obstacle in answer["obstacles"]:
                output.plain(f"- {obstacle}")
        else:
            output.plain(f"job {args.job}: no obstacles found")
        for note in answer["notes"]:
            output.plain(f"note: {note}")
    if answer["obstacles"]:
        sys.exit(1)


def restore(args: argparse.Namespace, settings: Settings) -> None:
    if bool(args.checkpoint) == bool(args.label):
        raise UsageError("give either a CHECKPOINT id or --label, not both or neither")
    if args.user is not None and not args.label:
        raise UsageError("--user says whose --label to restore; a CHECKPOINT id needs none")
    if args.verified and not args.label:
        raise UsageError(
            "--verified picks among a --label's checkpoints; for a CHECKPOINT id, "
            "run `stasis verify CHECKPOINT` first"
        )
    with (
        Client(settings.socket) as client,
        output.progress_bar("restoring", not args.json) as progress,
    ):
        answer = client.restore(
            progress,
            checkpoint=args.checkpoint,
            label=args.label,
            user=args.user,
            lazy=args.lazy,
            **({"verified": True} if args.verified else {}),
        )
    for skipped in answer.get("skipped", []):
        output.warn(f"skipped corrupt checkpoint {skipped}")
    _done(
        args,
        answer,
        f"job {answer['job']} restored from {answer['checkpoint']} " f"as pid {answer['pid']}",
    )


def ps(args: argparse.Namespace, settings: Settings) -> None:
    with Client(settings.socket) as client:
        jobs = client.jobs()
        # The integrations' jobs that checkpoint every so often (Slurm's STASIS_INTERVAL, a
        # container's): the interval in force and why.
        intervals = client.intervals()
    rows: list[dict[str, object]] = [
        {
            "job": j["job"],
            "pid": j["pid"],
            "state": j["state"],
            "label": j["label"],
            "exit_code": j["exit_code"],
            "command": j["command"],
            "private_tmp": j.get("private_tmp", False),
            "frozen": j.get("frozen", False),
            **_part(j["label"]),
        }
        for j in jobs
    ]
    if args.json:
        output.emit_json(
            rows
            + [
                {"job": i["job"], "kind": i["kind"], "label": i["label"], "interval": i}
                for i in intervals
            ]
        )
        return
    for r, j in zip(rows, jobs):
        r["command"] = " ".join(j["command"])
        r["tmp"] = "private" if r.pop("private_tmp") else "node"
        if r.pop("frozen"):
            r["state"] = f"{r['state']}, frozen"
        if "slurm_job" in r:
            r["of"] = f"slurm job {r.pop('slurm_job')} part {r.pop('part')}"
    # (the column only where this node runs a part of a Slurm job on several nodes)
    of = ["of"] if any("of" in r for r in rows) else []
    output.table(rows, ["job", "pid", "state", "label", *of, "exit_code", "tmp", "command"])
    if intervals:
        from rich.markup import escape

        output.plain("")
        output.table(
            [
                {
                    "kind": i["kind"],
                    "job": i["job"],
                    "label": i["label"],
                    "interval": _interval(i["interval_s"]),
                    "asked": i["requested"],
                    "why": escape(i["why"]),
                }
                for i in intervals
            ],
            ["kind", "job", "label", "interval", "asked", "why"],
        )


def _part(label: str) -> dict[str, str]:
    """The Slurm job a daemon job is a part of (on this node: the rest of the job runs on its
    other nodes), and its key; nothing for a job of its own (its row as ever)."""
    from stasis.slurm.partnames import part_of

    of = part_of(label)
    return {"slurm_job": of[0], "part": of[1]} if of else {}


def _interval(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s" if seconds < 3600 else f"{seconds:.0f} s ({seconds / 3600:.1f} h)"


def checkpoints(args: argparse.Namespace, settings: Settings) -> None:
    with Client(settings.socket) as client:
        if args.action == "rm":
            client.delete_checkpoint(args.checkpoint)
            output.say(f"deleted {args.checkpoint}")
            return
        if args.action == "gc":
            report = client.collect_garbage(idle_s=args.idle)
            if args.json:
                output.emit_json(report)
                return
            output.say(
                f"removed {len(report['staging'])} staging dir(s), {len(report['partial'])} "
                f"partial checkpoint(s), {len(report['uploads'])} unfinished upload(s), "
                f"{report['index_entries_removed']} stale index entr(ies); expired "
                f"{len(report['expired'])} checkpoint(s); indexed "
                f"{report['index_entries_added']}"
            )
            return
        if args.action == "rekey":
            done = client.rekey()
            if args.json:
                output.emit_json(done)
            else:
                output.say(
                    f"rekeyed {len(done['rekeyed'])} checkpoints to the current key "
                    f"({done['current']} were on it already)"
                )
            if done["unknown_key"]:
                output.warn(
                    f"{done['unknown_key']} encrypted checkpoints are wrapped by a key "
                    "this node has not got (not in encryption_key_file or "
                    "old_encryption_key_files): left as they are"
                )
            return
        found = client.checkpoints(args.label, args.user)
    if args.json:
        output.emit_json(found)
        return
    from stasis.cli.verify import verdict_column

    rows = [
        {
            "checkpoint": m["id"],
            "label": m["label"],
            "user": m["user"],
            "job": m["job"],
            "created": m["created"],
            "size_bytes": m["size_bytes"],
            "compression": m["compression"],
            "verified": verdict_column(dict(m)),
        }
        for m in found
    ]
    output.table(
        rows,
        ["checkpoint", "label", "user", "job", "created", "size_bytes", "compression", "verified"],
    )


def kill(args: argparse.Namespace, settings: Settings) -> None:
    with Client(settings.socket) as client:
        answer = client.kill(args.job, signal=args.signal, timeout_s=args.timeout)
    if args.json:
        output.emit_json(answer)
        return
    code = "" if answer["exit_code"] is None else f", exit code {answer['exit_code']}"
    if answer["ended_by"] is None:
        output.say(f"job {args.job} was not running ({answer['state']}{code})")
    elif answer["ended_by"] == answer["signal"]:
        output.say(f"job {args.job} ended by {answer['ended_by']}{code}")
    else:
        output.say(
            f"job {args.job} ended by {answer['ended_by']}: {answer['signal']} did not "
            f"end it within {answer['timeout_s']:g} s{code}"
        )


def logs(args: argparse.Namespace, settings: Settings) -> None:
    with Client(settings.socket) as client:
        info = client.job(args.job)
    try:
        with open(info["log"], "rb") as f:
            while chunk := f.read(1 << 16):
                sys.stdout.buffer.write(chunk)
    except OSError as e:
        raise StasisError(f"cannot read {info['log']}: {e.strerror}") from e


def check(args: argparse.Namespace, settings: Settings) -> None:
    if args.checkpoint is not None:
        check_checkpoint(args, settings)
        return
    from stasis.engine.check import run_check

    report = run_check(settings)
    try:
        with Client(settings.socket, timeout_s=30) as client:
            # What keeps the running daemon from protecting its jobs (its database, the store).
            ready = client.check()
        not_ready = [p for p in ready["problems"] if p["what"].startswith("not ready")]
        report["problems"].extend(not_ready)
        report["ok"] = report["ok"] and not not_ready
    except StasisError as e:
        # No daemon, no protection: a node whose daemon is down is not ready (the Kubernetes
        # agent's readiness probe and a site's monitoring run this), whatever CRIU can do.
        report["problems"].append(
            {
                "what": f"not ready: {e}",
                "fix": "systemctl start stasis (or `stasis daemon` as root); its log: journalctl -u stasis",
            }
        )
        report["ok"] = False
    if report["network_locks"]:
        try:
            with Client(settings.socket, timeout_s=10) as client:
                # The daemon knows which checkpoint holds each rule, and until when.
                report["network_locks"] = client.network_locks()
        except StasisError as e:
            report["notes"].append(
                f"cannot ask the daemon which checkpoints hold the network " f"locks below: {e}"
            )
    if args.json:
        output.emit_json(report)
    else:
        output.say(f"CRIU: {report['criu_path'] or 'missing'} {report['criu_version'] or ''}")
        output.say(f"kernel: {report['kernel']}")
        for name, value in report["features"].items():
            output.say(f"feature {name}: {'yes' if value else 'no'}")
        for note in report["notes"]:
            output.say(f"note: {note}")
        for lock in report["network_locks"]:
            if lock["checkpoint"]:
                until = f" until {lock['release_at']}" if lock["release_at"] else ""
                output.say(
                    f"network lock: {lock['rule']} (held for checkpoint "
                    f"{lock['checkpoint']} of job {lock['job']}{until}, or until it is "
                    "restored or deleted)"
                )
            else:
                output.say(
                    f"network lock: {lock['rule']} (no checkpoint of this daemon holds "
                    f"it; it blocks that connection for good: {lock['remove_with']})"
                )
        for p in report["problems"]:
            output.say(f"[red]problem:[/red] {p['what']} -> {p['fix']}")
        output.say("OK" if report["ok"] else "NOT READY")
    if not report["ok"]:
        sys.exit(1)


def check_checkpoint(args: argparse.Namespace, settings: Settings) -> None:
    """`check --checkpoint ID`: what the checkpoint recorded of the node that dumped it against
    this node. Exit 0 when a restore here would go ahead (notes or not), 1 when it would be
    refused."""
    with Client(settings.socket) as client:
        report = client.check_checkpoint(args.checkpoint)
    if args.json:
        output.emit_json(report)
    elif not report["recorded"]:
        output.plain(
            f"checkpoint {report['checkpoint']} records nothing to compare: it was "
            "dumped before stasis recorded what a restore depends on, and restores "
            "unchecked"
        )
    else:
        rows = [
            {
                "what": f["what"],
                "checkpoint": f["recorded"],
                "this node": f["here"],
                "verdict": f["verdict"],
            }
            for f in report["facts"]
        ]
        output.table(rows, ["what", "checkpoint", "this node", "verdict"])
        for f in report["facts"]:
            if f["verdict"] != "ok":
                output.plain(f"{f['verdict']}: {f['why']}")
        output.plain(
            f"checkpoint {report['checkpoint']} "
            + ("can be restored" if report["restorable"] else "would be refused")
            + f" on this node ({report['node']})"
        )
    if not report["restorable"]:
        sys.exit(1)


def daemon(args: argparse.Namespace, settings: Settings) -> None:
    import asyncio
    import logging

    from stasis.controlplane.node import ControlPlaneNode
    from stasis.daemon.server import serve
    from stasis.k8s.integration import K8sIntegration
    from stasis.slurm.integration import SlurmIntegration

    logging.basicConfig(level=logging.INFO, format="%(asctime)s stasis %(levelname)s %(message)s")
    # The integrations this daemon serves: the core knows none of them.
    asyncio.run(serve(settings, [SlurmIntegration, K8sIntegration, ControlPlaneNode]))


def _add_run(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="Start COMMAND as a job that can be checkpointed.",
        description="Start COMMAND as a job that can be checkpointed. Options go "
        "before COMMAND; everything after it is COMMAND's.",
    )
    p.add_argument("--label", help="Label of this job's checkpoints (default: the job id).")
    p.add_argument("--log", metavar="FILE", help="Append stdout/stderr here.")
    p.add_argument("--cwd", metavar="DIR", help="Working directory (default: here).")
    p.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="Environment variable; repeat."
    )
    p.add_argument("--user", help="Run as this user (root only, unless it is yourself).")
    p.add_argument(
        "--private-tmp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="The job sees its own empty /tmp and /var/tmp (in memory, at most "
        "node_local_limit each), saved in its checkpoints and gone when it "
        "ends (default: the private_tmp setting).",
    )
    add_json(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="[--] COMMAND ...")
    p.set_defaults(handler=run)


def _add_dump(sub: Any) -> None:
    p = sub.add_parser(
        "dump", help="Checkpoint JOB into the store (it stops unless " "--leave-running)."
    )
    p.add_argument("job", nargs="?", metavar="JOB")
    p.add_argument(
        "--leave-running", action="store_true", help="Keep the job running after the dump."
    )
    p.add_argument("--label", help="Label of this checkpoint (default: the job's label).")
    p.add_argument(
        "--compress",
        choices=["zstd", "lz4", "auto", "none"],
        default="none",
        help="Compress the images while CRIU writes them; auto: zstd only where it "
        "pays (mostly-zero or text memory) (default: none).",
    )
    p.add_argument(
        "--incremental",
        action="store_true",
        help="Only memory changed since the last dump, where the kernel tracks it.",
    )
    p.add_argument(
        "--encrypt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Encrypt the images (AES-256-GCM, with the daemon's "
        "encryption_key_file); --no-encrypt stores this dump unencrypted even "
        "where the daemon encrypts every dump; default: the daemon's setting "
        "(encrypt).",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="Dump nothing: report what would make the dump fail (a unix stream "
        "connection to a process outside the job) and what a restore would "
        "not bring back as it was; exit 1 if the dump would fail.",
    )
    p.add_argument(
        "--slurm-job",
        metavar="JOBID",
        help="Checkpoint this Slurm job on its node instead; it is requeued and "
        "resumes from the checkpoint unless --leave-running.",
    )
    p.add_argument(
        "--container",
        metavar="ID",
        help="Checkpoint this container (run by the stasis runtime on this node) "
        "instead; it is stopped and resumes when created again, unless "
        "--leave-running.",
    )
    add_json(p)
    p.set_defaults(handler=dump)


def _add_restore(sub: Any) -> None:
    p = sub.add_parser(
        "restore", help="Restore CHECKPOINT (or the newest of --label) as a new " "job."
    )
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT")
    p.add_argument("--label", help="Restore the newest of your checkpoints with this label.")
    p.add_argument(
        "--user",
        metavar="NAME|UID",
        help="Whose --label (root only, for another user's; default: yours).",
    )
    p.add_argument(
        "--lazy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Run before all memory is back (userfaultfd); --no-lazy loads all "
        "memory first even where the daemon restores lazily by default; "
        "default: the daemon's setting (lazy_restore).",
    )
    p.add_argument(
        "--verified",
        action="store_true",
        help="With --label: the newest checkpoint whose `stasis verify` verdict is " "ok.",
    )
    add_json(p)
    p.set_defaults(handler=restore)


def _add_ps(sub: Any) -> None:
    p = sub.add_parser("ps", help="List jobs.")
    add_json(p)
    p.set_defaults(handler=ps)


def _add_checkpoints(sub: Any) -> None:
    p = sub.add_parser(
        "checkpoints",
        help="List checkpoints, newest first "
        "(`checkpoints rm ID` deletes one, "
        "`checkpoints gc` cleans the store, `checkpoints "
        "rekey` re-wraps encryption keys).",
    )
    p.add_argument("--label", help="Only your checkpoints with this label (or --user's).")
    p.add_argument(
        "--user",
        metavar="NAME|UID",
        help="Only this user's checkpoints (root only, for another user's; without "
        "it root lists every user's, but --label looks among root's own).",
    )
    add_json(p)
    p.set_defaults(handler=checkpoints, action=None)
    actions = subcommands(p, dest="action", required=False)
    rm = actions.add_parser("rm", help="Delete CHECKPOINT from the store.")
    rm.add_argument("checkpoint", metavar="CHECKPOINT")
    gc = actions.add_parser(
        "gc",
        help="Remove what dead dumps and nodes left in the store (staging, partial "
        "uploads, stale index entries) and apply retention to every label (root).",
    )
    gc.add_argument(
        "--idle",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="Only what nothing was written to for this long (default 3600).",
    )
    # SUPPRESS: `checkpoints --json gc` keeps the --json given before `gc`.
    gc.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="Print one JSON value."
    )
    rekey = actions.add_parser(
        "rekey",
        help="Re-wrap the data keys of checkpoints encrypted with an old key file "
        "(old_encryption_key_files) with the current one; images are not "
        "rewritten (root only).",
    )
    # SUPPRESS: `checkpoints --json rekey` keeps the --json given before it.
    rekey.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="Print one JSON value."
    )


def _signal(text: str) -> str:
    from stasis.daemon.signals import parse_signal

    try:
        return parse_signal(text).name
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= 3600:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text} is not in 0..3600 seconds")
    return value


def _add_kill(sub: Any) -> None:
    p = sub.add_parser(
        "kill", help="Stop JOB and every process in it: SIG first, SIGKILL after " "the timeout."
    )
    p.add_argument("job", metavar="JOB")
    p.add_argument(
        "--signal",
        type=_signal,
        default="SIGTERM",
        metavar="SIG",
        help="Signal to end the job with: a name (TERM, INT, HUP, USR1...) or a "
        "number (default: TERM).",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        metavar="S",
        help="Seconds the job has to end on SIG before SIGKILL; 0: SIGKILL at once "
        "(default: the daemon's kill_timeout_s, 10).",
    )
    add_json(p)
    p.set_defaults(handler=kill)


def _add_logs(sub: Any) -> None:
    p = sub.add_parser(
        "logs", help="Print JOB's output (read with your own rights, not the " "daemon's)."
    )
    p.add_argument("job", metavar="JOB")
    p.set_defaults(handler=logs)


def _add_check(sub: Any) -> None:
    p = sub.add_parser(
        "check", help="Can this node checkpoint and restore? What is missing and " "how to fix it."
    )
    p.add_argument(
        "--checkpoint",
        metavar="ID",
        help="Compare what checkpoint ID recorded of the node that dumped it (CPU, "
        "kernel, CRIU, user, open files) with this node: ok, note, or refuses.",
    )
    add_json(p)
    p.set_defaults(handler=check)


def _add_daemon(sub: Any) -> None:
    p = sub.add_parser(
        "daemon", help="Run the node daemon in the foreground until SIGTERM " "(root)."
    )
    p.set_defaults(handler=daemon)


def _elsewhere(module: str, adder: str) -> Callable[[Any], None]:
    """A command whose parser `module` adds (its function `adder`): imported only when that
    command runs, or for the whole parser."""

    def add(sub: Any) -> None:
        getattr(importlib.import_module(module), adder)(sub)

    return add


COMMANDS: dict[str, Callable[[Any], None]] = {
    "run": _add_run,
    "dump": _add_dump,
    "restore": _add_restore,
    "ps": _add_ps,
    "checkpoints": _add_checkpoints,
    "kill": _add_kill,
    "logs": _add_logs,
    "check": _add_check,
    "daemon": _add_daemon,
    "slurm": _elsewhere("stasis.cli.slurm", "add_slurm"),
    "k8s": _elsewhere("stasis.cli.k8s", "add_k8s"),
    "export": _elsewhere("stasis.cli.k8s", "add_export"),
    "import": _elsewhere("stasis.cli.k8s", "add_import"),
    "controlplane": _elsewhere("stasis.cli.controlplane", "add_controlplane"),
    "verify": _elsewhere("stasis.cli.verify", "add_verify"),
}


def parser(only: str | None = None) -> Parser:
    """The `stasis` parser; with `only`, that command's alone. Each sub-parser costs ~1 ms here
    (argparse asks gettext for its messages), so a command builds just the one it runs."""
    top = Parser(prog="stasis", description="Checkpoint and restore running jobs.")
    # Answered in main() before parsing (a command is required otherwise); here for --help.
    top.add_argument(
        "--version",
        action="store_true",
        help="Print stasis's version and exit (with --json: also CRIU's, "
        "Python's and the kernel's).",
    )
    sub = subcommands(top)
    for name, add in COMMANDS.items():
        if only is None or name == only:
            add(sub)
    return top


def main(argv: list[str] | None = None) -> NoReturn:
    try:
        argv = sys.argv[1:] if argv is None else argv
        first = argv[0] if argv else ""
        if first == "--version" and set(argv[1:]) <= {"--json"}:
            from stasis.cli.version import print_version

            print_version("--json" in argv, load_settings())
            sys.exit(0)
        args = parser(first if first in COMMANDS else None).parse_args(argv)
        handler: Handler = args.handler
        settings = load_settings()
        if settings.test_fault_points:
            from stasis import faults

            faults.arm(settings.test_fault_points)
        handler(args, settings)
    except StasisError as e:
        output.fail(str(e))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(1)
    sys.exit(0)
