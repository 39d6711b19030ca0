"""srun's command line as we read it (`parse`), and whether the step stays on this node and
how it runs there (`plan`): anything else is a Handoff to Slurm's own srun."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field

NONE, REQUIRED, OPTIONAL = 0, 1, 2
# long name -> (short letter or "", argument). Anything else goes to Slurm's srun.
OPTIONS: dict[str, tuple[str, int]] = {
    "ntasks": ("n", REQUIRED),
    "cpus-per-task": ("c", REQUIRED),
    "nodes": ("N", REQUIRED),
    "ntasks-per-node": ("", REQUIRED),
    "nodelist": ("w", REQUIRED),
    "exclude": ("x", REQUIRED),
    "label": ("l", NONE),
    "output": ("o", REQUIRED),
    "error": ("e", REQUIRED),
    "input": ("i", REQUIRED),
    "open-mode": ("", REQUIRED),
    "job-name": ("J", REQUIRED),
    "export": ("", REQUIRED),
    "chdir": ("D", REQUIRED),
    "kill-on-bad-exit": ("K", OPTIONAL),
    "mpi": ("", REQUIRED),
    "jobid": ("", REQUIRED),
    "overcommit": ("O", NONE),
    "time": ("t", REQUIRED),
    "unbuffered": ("u", NONE),
    # Accepted, not enforced (see the module docstring).
    "mem": ("", REQUIRED),
    "mem-per-cpu": ("", REQUIRED),
    "mem-bind": ("", REQUIRED),
    "cpu-bind": ("", REQUIRED),
    "hint": ("", REQUIRED),
    "distribution": ("m", REQUIRED),
    "exclusive": ("", OPTIONAL),
    "overlap": ("", NONE),
    "exact": ("", NONE),
    "whole": ("", NONE),
    "oversubscribe": ("s", NONE),
    "quiet": ("Q", NONE),
    "verbose": ("v", NONE),
    "disable-status": ("X", NONE),
}
_SHORT = {short: name for name, (short, _) in OPTIONS.items() if short}
# srun's own `-q` is --qos; it takes an argument we do not want: not listed, so handed off.


class Handoff(Exception):
    """This step goes to Slurm's srun; `reason` says why (one line for the job's output).
    `quiet`: bad usage that Slurm's srun reports better than we would."""

    def __init__(self, reason: str, quiet: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.quiet = quiet


@dataclass
class Step:
    """One srun call as parsed: the options we act on, and the command."""

    command: list[str]
    options: dict[str, str] = field(default_factory=dict)  # long name -> value ("" for flags)


def parse(args: list[str]) -> Step:
    """srun's command line as getopt_long reads it (options stop at the first word that is not
    one, or at `--`); raises Handoff for an option we do not handle or bad usage."""
    options: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if name not in OPTIONS:
                raise Handoff(f"option --{name} is not handled by stasis")
            kind = OPTIONS[name][1]
            if kind == NONE and eq:
                raise Handoff(f"option --{name} takes no value", quiet=True)
            if kind == REQUIRED and not eq:
                i += 1
                if i >= len(args):
                    raise Handoff(f"option --{name} needs a value", quiet=True)
                value = args[i]
            options[name] = value
            i += 1
            continue
        if arg.startswith("-") and len(arg) > 1:
            j = 1
            while j < len(arg):
                letter = arg[j]
                if letter not in _SHORT:
                    raise Handoff(f"option -{letter} is not handled by stasis")
                name = _SHORT[letter]
                kind = OPTIONS[name][1]
                rest = arg[j + 1 :]
                if kind == NONE:
                    options[name] = ""
                    j += 1
                    continue
                if kind == OPTIONAL:
                    options[name] = rest
                elif rest:
                    options[name] = rest
                else:
                    i += 1
                    if i >= len(args):
                        raise Handoff(f"option -{letter} needs a value", quiet=True)
                    options[name] = args[i]
                break
            i += 1
            continue
        break
    command = args[i:]
    if not command:
        raise Handoff("no command", quiet=True)
    return Step(command, options)


# -- what the step asks of the node ------------------------------------------------------------


@dataclass
class Plan:
    """A step we run here: its tasks, their environment, where their output goes."""

    command: list[str]
    ntasks: int
    cpus_per_task: int | None
    label: bool = False
    output: str | None = None
    error: str | None = None
    input: str | None = None
    append: bool = False
    name: str = ""
    export: str = "ALL"
    chdir: str | None = None
    kill_on_bad_exit: bool = False
    time_limit_s: float | None = None


def _count(value: str, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise Handoff(f"{what} {value!r} is not a number", quiet=True) from None
    if n < 1:
        raise Handoff(f"{what} {value!r} must be at least 1", quiet=True)
    return n


def _node_range(value: str) -> tuple[int, int]:
    low, _, high = value.partition("-")
    first = _count(low, "--nodes")
    return first, _count(high, "--nodes") if high else first


def _names(hostlist: str) -> list[str] | None:
    """Plain comma-separated host names; None for a hostlist expression (n[1-3]) or a file."""
    if any(c in hostlist for c in "[]/"):
        return None
    return [n for n in hostlist.split(",") if n]


def plan(step: Step, env: dict[str, str], mpi_default: str | None = None) -> Plan:
    """Whether `step` stays on this node, and how to run it; raises Handoff otherwise.

    `mpi_default` is Slurm's MpiDefault (asked of scontrol when None and the step names no
    --mpi)."""
    o = step.options
    node = env.get("SLURMD_NODENAME", "")
    job = env.get("SLURM_JOB_ID", "")
    if o.get("jobid") is not None and o["jobid"] != job:
        raise Handoff(f"the step runs in another job ({o['jobid']})")
    job_nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
    ntasks = (
        _count(o["ntasks"], "--ntasks")
        if "ntasks" in o
        else _count(o["ntasks-per-node"], "--ntasks-per-node")
        if "ntasks-per-node" in o
        else _count(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or "1", "SLURM_NTASKS")
    )
    if "ntasks-per-node" in o and ntasks > _count(o["ntasks-per-node"], "--ntasks-per-node"):
        raise Handoff(f"{ntasks} tasks at {o['ntasks-per-node']} per node")
    if "nodes" in o:
        low, high = _node_range(o["nodes"])
        if low > 1 or (high > 1 and job_nodes > 1):
            raise Handoff(f"the step asks for {o['nodes']} nodes")
        nodes = 1
    else:
        nodes = min(job_nodes, ntasks)
    if "nodelist" in o:
        names = _names(o["nodelist"])
        if names != [node]:
            raise Handoff(f"the step names nodes {o['nodelist']}")
    elif nodes > 1 and "ntasks" not in o:
        raise Handoff(f"the job has {job_nodes} nodes and the step asks for no single one")
    elif nodes > 1:
        raise Handoff(f"{ntasks} tasks over the job's {job_nodes} nodes")
    if "exclude" in o:
        names = _names(o["exclude"])
        if names is None or node in names:
            raise Handoff(f"the step excludes nodes {o['exclude']}")
    cpt_text = o.get("cpus-per-task") or env.get("SRUN_CPUS_PER_TASK")
    cpus_per_task = _count(cpt_text, "--cpus-per-task") if cpt_text else None
    cpus_here = env.get("SLURM_CPUS_ON_NODE", "")
    if cpus_here.isdigit() and "overcommit" not in o:
        wanted = ntasks * (cpus_per_task or 1)
        if wanted > int(cpus_here):
            raise Handoff(
                f"{ntasks} task(s) x {cpus_per_task or 1} CPU(s) is more than the "
                f"job's {cpus_here} CPU(s) on this node"
            )
    mpi = o.get("mpi") or env.get("SLURM_MPI_TYPE")
    if mpi is None:
        mpi = mpi_default if mpi_default is not None else _mpi_default()
    if mpi != "none":
        raise Handoff(f"MPI plugin {mpi}")
    mode = o.get("open-mode", "truncate")
    if mode not in ("append", "truncate", "a", "t"):
        raise Handoff(f"--open-mode {mode!r}", quiet=True)
    inp = o.get("input")
    if inp is not None and inp != "none" and (inp == "all" or inp.isdigit()):
        raise Handoff(f"--input {inp}")
    # As srun: SLURM_EXPORT_ENV (which sbatch --export=... leaves in the batch environment) is
    # the default of --export.
    export = o.get("export") or env.get("SLURM_EXPORT_ENV") or "ALL"
    kill = o.get("kill-on-bad-exit")
    limit = time_limit_s(o["time"]) if "time" in o else None
    return Plan(
        command=step.command,
        ntasks=ntasks,
        cpus_per_task=cpus_per_task,
        label="label" in o,
        output=o.get("output"),
        error=o.get("error"),
        input=inp,
        append=mode.startswith("a"),
        name=o.get("job-name", ""),
        export=export,
        chdir=o.get("chdir"),
        kill_on_bad_exit=kill is not None and kill != "0",
        time_limit_s=limit,
    )


def time_limit_s(text: str) -> float | None:
    """Slurm's time formats (minutes, m:s, h:m:s, d-h, d-h:m, d-h:m:s) in seconds; None for no
    limit (0, -1, INFINITE, UNLIMITED)."""
    if text.upper() in ("INFINITE", "UNLIMITED", "-1", "0"):
        return None
    days, dash, rest = text.partition("-")
    if not dash:
        days, rest = "0", text
    parts = rest.split(":")
    if not (days.isdigit() and 1 <= len(parts) <= 3 and all(x.isdigit() for x in parts)):
        raise Handoff(f"--time {text!r} is not a time", quiet=True)
    values = [int(x) for x in parts]
    if dash:  # d-h, d-h:m, d-h:m:s
        values += [0] * (3 - len(values))
        h, m, sec = values
    elif len(values) == 1:  # minutes
        h, m, sec = 0, values[0], 0
    elif len(values) == 2:  # minutes:seconds
        h, m, sec = 0, values[0], values[1]
    else:
        h, m, sec = values
    total = ((int(days) * 24 + h) * 60 + m) * 60 + sec
    return float(total) if total > 0 else None


def _mpi_default() -> str:
    """Slurm's MpiDefault: a step that would get an MPI plugin from it is not ours to run."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise Handoff(f"cannot ask Slurm for its MpiDefault ({e})") from None
    m = re.search(r"^MpiDefault\s*=\s*(\S+)", out, re.M)
    # Slurm 24.11 prints MpiDefault=none as "(null)".
    return m.group(1) if m and m.group(1) != "(null)" else "none"
