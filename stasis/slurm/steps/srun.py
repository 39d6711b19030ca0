"""Our srun (`main`): a step of an opted-in job that stays on this node runs here, inside the
job's tree; any other goes to Slurm's own srun. Either way it gets the next step id and a
record in the job's step book."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import NoReturn

from stasis.slurm.steps.book import Book, StepStart
from stasis.slurm.steps.parse import Handoff, parse, plan
from stasis.slurm.steps.realsrun import SRUN_NAME, find_real_srun
from stasis.slurm.steps.runner import OUR_STEP_VAR, Runner

# Set by the launcher in the workload's environment: the job whose tree this is, and Slurm's
# own srun.
STEPS_VAR = "STASIS_SLURM_STEPS"
REAL_SRUN_VAR = "STASIS_REAL_SRUN"
# `STASIS_SRUN=slurm srun ...` hands a step to Slurm's srun on purpose.
OPT_OUT_VAR = "STASIS_SRUN"
LIST_OPTION = "--stasis-steps"


def in_our_tree(env: dict[str, str]) -> bool:
    """Whether this srun runs inside an opted-in job's tree (the launcher said so, and we are in
    a PID namespace) and not in the task of a step Slurm started."""
    if not env.get(STEPS_VAR) or env.get(STEPS_VAR) != env.get("SLURM_JOB_ID"):
        return False
    if "SLURM_STEP_ID" in env and env.get(OUR_STEP_VAR) != env["SLURM_STEP_ID"]:
        return False
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    m = re.search(r"^NSpid:\s*(.*)$", status, re.M)
    return m is not None and len(m.group(1).split()) > 1


def _exec_real(args: list[str], env: dict[str, str]) -> NoReturn:
    ours = str(Path(sys.argv[0]).resolve().parent) if sys.argv and sys.argv[0] else ""
    real = env.get(REAL_SRUN_VAR, "")
    if not os.access(real, os.X_OK):  # e.g. restored on a node that has it elsewhere
        real = find_real_srun(env.get("PATH", ""), ours) or ""
    if not real:
        sys.stderr.write("srun: error: Slurm's srun is not installed on this node\n")
        sys.exit(1)
    sys.stderr.flush()
    try:
        os.execve(real, [SRUN_NAME, *args], env)
    except OSError as e:
        sys.stderr.write(f"srun: error: cannot run {real}: {e.strerror}\n")
        sys.exit(1)


def _book() -> Book | None:
    try:
        return Book()
    except (OSError, AttributeError) as e:
        sys.stderr.write(
            f"stasis: warning: no step records in this job ({e}); step ids "
            "count from 0 in each srun\n"
        )
        return None


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    env = dict(os.environ)
    if not in_our_tree(env):
        _exec_real(args, env)
    if args == [LIST_OPTION]:
        book = _book()
        for rec in book.records() if book else []:
            print(json.dumps(rec))
        sys.exit(0)
    book = _book()
    try:
        if env.get(OPT_OUT_VAR) == "slurm":
            raise Handoff(f"{OPT_OUT_VAR}=slurm")
        p = plan(parse(args), env)
    except Handoff as e:
        _start(book, StepStart(where="slurm", argv=args, reason=e.reason))
        if not e.quiet:
            sys.stderr.write(
                f"stasis: this srun step runs outside stasis ({e.reason}): "
                "no checkpoint can be taken while it runs\n"
            )
        _exec_real(args, env)
    # Slurm names a step after its program unless -J says otherwise.
    step = _start(
        book,
        StepStart(
            where="stasis",
            argv=args,
            ntasks=p.ntasks,
            name=p.name or os.path.basename(p.command[0]),
        ),
    )
    runner = Runner(p, env, step)
    code = runner.run()
    if book:
        try:
            book.end(step, code, runner.signal)
        except OSError as e:
            sys.stderr.write(f"stasis: warning: step {step} not recorded: {e}\n")
    sys.exit(code)


def _start(book: Book | None, record: StepStart) -> int:
    if book is None:
        return 0
    try:
        return book.start(record)
    except OSError as e:
        sys.stderr.write(f"stasis: warning: no step record ({e}); this step's id is 0\n")
        return 0
