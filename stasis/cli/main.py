"""`stasis`: run, dump, restore, ps, checkpoints, kill, logs, check, daemon."""

from __future__ import annotations

import os
import sys

import click

from stasis.cli import output
from stasis.cli.slurm import slurm
from stasis.config import Settings, load_settings
from stasis.daemon.client import Client
from stasis.errors import StasisError, UsageError


def _settings(ctx: click.Context) -> Settings:
    settings: Settings = ctx.obj
    return settings


def _client(ctx: click.Context) -> Client:
    return Client(_settings(ctx).socket)


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON value.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Checkpoint and restore running jobs."""
    ctx.obj = load_settings()


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--label", help="Label of this job's checkpoints (default: the job id).")
@click.option("--log", "log", type=click.Path(dir_okay=False), help="Append stdout/stderr here.")
@click.option("--cwd", type=click.Path(file_okay=False), help="Working directory (default: here).")
@click.option("--env", "env", multiple=True, metavar="K=V", help="Environment variable; repeat.")
@click.option("--user", help="Run as this user (root only, unless it is yourself).")
@json_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def run(ctx: click.Context, label: str | None, log: str | None, cwd: str | None,
        env: tuple[str, ...], user: str | None, as_json: bool, command: tuple[str, ...]) -> None:
    """Start COMMAND as a job that can be checkpointed."""
    env_map: dict[str, str] = {}
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {item!r}: expected NAME=VALUE")
        env_map[key] = value
    with _client(ctx) as client:
        answer = client.run(
            command=list(command), label=label, cwd=os.path.abspath(cwd or os.getcwd()),
            log=os.path.abspath(log) if log else None, env=env_map, user=user,
        )
    if as_json:
        output.emit_json(answer)
    else:
        output.say(f"job {answer['job']} running as pid {answer['pid']} "
                             f"(label {answer['label']})")


@cli.command()
@click.argument("job", required=False)
@click.option("--leave-running", is_flag=True, help="Keep the job running after the dump.")
@click.option("--label", help="Label of this checkpoint (default: the job's label).")
@click.option("--compress", type=click.Choice(["zstd", "lz4", "auto", "none"]), default="none",
              show_default=True)
@click.option("--incremental", is_flag=True,
              help="Only memory changed since the last dump, where the kernel tracks it.")
@click.option("--slurm-job", metavar="JOBID",
              help="Checkpoint this Slurm job on its node instead; it is requeued and resumes "
                   "from the checkpoint unless --leave-running.")
@json_option
@click.pass_context
def dump(ctx: click.Context, job: str | None, leave_running: bool, label: str | None,
         compress: str, incremental: bool, slurm_job: str | None, as_json: bool) -> None:
    """Checkpoint JOB into the store (the job stops unless --leave-running)."""
    if slurm_job is not None or job is None:
        if job is not None or slurm_job is None:
            raise UsageError("give either a JOB id or --slurm-job JOBID")
        from stasis.cli.slurm import dump_slurm_job

        dump_slurm_job(_client(ctx), slurm_job, leave_running, as_json)
        return
    with _client(ctx) as client, output.progress_bar("dumping", not as_json) as progress:
        answer = client.dump(job, progress, leave_running=leave_running, label=label,
                             compress=compress, incremental=incremental)
    if answer.get("note"):
        output.warn(answer["note"])
    if as_json:
        output.emit_json(answer)
    else:
        output.say(f"checkpoint {answer['checkpoint']} (label {answer['label']}, "
                             f"{answer['size_bytes']} bytes, {answer['duration_s']:.2f} s)")


@cli.command()
@click.argument("checkpoint", required=False)
@click.option("--label", help="Restore the newest checkpoint with this label.")
@click.option("--lazy/--no-lazy", default=None,
              help="Run before all memory is back (userfaultfd); default: the daemon's setting.")
@json_option
@click.pass_context
def restore(ctx: click.Context, checkpoint: str | None, label: str | None, lazy: bool | None,
            as_json: bool) -> None:
    """Restore CHECKPOINT (or the newest of --label) as a new job."""
    if bool(checkpoint) == bool(label):
        raise UsageError("give either a CHECKPOINT id or --label, not both or neither")
    with _client(ctx) as client, output.progress_bar("restoring", not as_json) as progress:
        answer = client.restore(progress, checkpoint=checkpoint, label=label, lazy=lazy)
    for skipped in answer.get("skipped", []):
        output.warn(f"skipped corrupt checkpoint {skipped}")
    if as_json:
        output.emit_json(answer)
    else:
        output.say(f"job {answer['job']} restored from {answer['checkpoint']} "
                             f"as pid {answer['pid']}")


@cli.command()
@json_option
@click.pass_context
def ps(ctx: click.Context, as_json: bool) -> None:
    """List jobs."""
    with _client(ctx) as client:
        jobs = client.jobs()
    rows = [{k: j[k] for k in ("job", "pid", "state", "label", "exit_code", "command")}
            for j in jobs]
    if as_json:
        output.emit_json(rows)
    else:
        for r in rows:
            r["command"] = " ".join(r["command"])
        output.table(rows, ["job", "pid", "state", "label", "exit_code", "command"])


@cli.group(invoke_without_command=True)
@click.option("--label", help="Only checkpoints with this label.")
@json_option
@click.pass_context
def checkpoints(ctx: click.Context, label: str | None, as_json: bool) -> None:
    """List checkpoints, newest first (`checkpoints rm ID` deletes one)."""
    if ctx.invoked_subcommand:
        return
    with _client(ctx) as client:
        found = client.checkpoints(label)
    if as_json:
        output.emit_json(found)
        return
    rows = [{"checkpoint": m["id"], "label": m["label"], "job": m["job"],
             "created": m["created"], "size_bytes": m["size_bytes"],
             "compression": m["compression"]} for m in found]
    output.table(rows, ["checkpoint", "label", "job", "created", "size_bytes", "compression"])


@checkpoints.command("rm")
@click.argument("checkpoint")
@click.pass_context
def checkpoints_rm(ctx: click.Context, checkpoint: str) -> None:
    """Delete CHECKPOINT from the store."""
    with _client(ctx) as client:
        client.delete_checkpoint(checkpoint)
    output.say(f"deleted {checkpoint}")


@cli.command()
@click.argument("job")
@json_option
@click.pass_context
def kill(ctx: click.Context, job: str, as_json: bool) -> None:
    """Kill JOB and every process in it."""
    with _client(ctx) as client:
        answer = client.kill(job)
    if as_json:
        output.emit_json(answer)
    else:
        output.say(f"job {job}: {answer['state']}")


@cli.command()
@click.argument("job")
@click.pass_context
def logs(ctx: click.Context, job: str) -> None:
    """Print JOB's output (read with your own rights, not the daemon's)."""
    with _client(ctx) as client:
        info = client.job(job)
    try:
        with open(info["log"], "rb") as f:
            while chunk := f.read(1 << 16):
                sys.stdout.buffer.write(chunk)
    except OSError as e:
        raise StasisError(f"cannot read {info['log']}: {e.strerror}") from e


@cli.command()
@json_option
@click.pass_context
def check(ctx: click.Context, as_json: bool) -> None:
    """Can this node checkpoint and restore? What is missing and how to fix it."""
    from stasis.engine.check import run_check

    report = run_check(_settings(ctx))
    if as_json:
        output.emit_json(report.model_dump(mode="json"))
    else:
        output.say(f"CRIU: {report.criu_path or 'missing'} {report.criu_version or ''}")
        output.say(f"kernel: {report.kernel}")
        for name, value in report.features.items():
            output.say(f"feature {name}: {'yes' if value else 'no'}")
        for note in report.notes:
            output.say(f"note: {note}")
        for p in report.problems:
            output.say(f"[red]problem:[/red] {p.what} -> {p.fix}")
        output.say("OK" if report.ok else "NOT READY")
    if not report.ok:
        sys.exit(1)


@cli.command()
@click.pass_context
def daemon(ctx: click.Context) -> None:
    """Run the node daemon in the foreground until SIGTERM (root)."""
    import asyncio
    import logging

    from stasis.daemon.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s stasis %(levelname)s %(message)s")
    asyncio.run(serve(_settings(ctx)))


def main() -> None:
    try:
        code = cli.main(standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except click.exceptions.Abort:
        output.fail("aborted")
        sys.exit(1)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except StasisError as e:
        output.fail(str(e))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(1)





cli.add_command(slurm)
