"""Slurm's own srun beside ours: where ours is installed, finding Slurm's, the steps of a job
that run it (outside the job's tree), and why a checkpoint is refused while they do."""

from __future__ import annotations

import os
from pathlib import Path

SRUN_NAME = "srun"


def find_real_srun(path: str, ours: str) -> str | None:
    """Slurm's srun on `path`, skipping the directory `ours` (and any other srun of ours)."""
    skip = os.path.realpath(ours) if ours else ""
    for d in path.split(os.pathsep):
        if not d or (skip and os.path.realpath(d) == skip):
            continue
        candidate = os.path.join(d, SRUN_NAME)
        if (
            os.access(candidate, os.X_OK)
            and not os.path.isdir(candidate)
            and not _is_ours(candidate)
        ):
            return candidate
    return None


def _is_ours(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"stasis.slurm.steps" in f.read(512)
    except OSError:
        return False


_CMDLINE_MAX = 4096


def real_srun_running(pid: int) -> list[str]:
    """The command lines of Slurm's own srun processes among the descendants of `pid`: steps
    whose tasks run outside the tree, so a checkpoint now would restore a dead client."""
    from stasis.engine import proctree

    found = []
    for p in proctree.tree(pid)[1:]:
        try:
            exe = os.readlink(f"/proc/{p}/exe")
            with open(f"/proc/{p}/cmdline", "rb") as f:
                # The daemon reads it too: a job's command line may be megabytes long, the
                # refusal shows 120 characters of it.
                cmdline = f.read(_CMDLINE_MAX)
        except OSError:
            continue
        if os.path.basename(exe.removesuffix(" (deleted)")) != SRUN_NAME:
            continue
        command = " ".join(c.decode(errors="replace") for c in cmdline.split(b"\0") if c)
        # Caught in its execve (the new exe set, its arguments not yet: seen on Debian 13), it
        # is srun all the same: named by its path.
        command = command or exe
        if command not in found:  # srun forks a helper with the same command line
            found.append(command)
    return found


def refusal(commands: list[str]) -> str:
    """Why a checkpoint is refused while Slurm's srun runs `commands` (one line)."""
    shown = "; ".join(c if len(c) <= 120 else c[:117] + "..." for c in commands[:3])
    more = f" (+{len(commands) - 3} more)" if len(commands) > 3 else ""
    return (
        f"a step runs outside stasis ({shown}{more}): a checkpoint now could not restore it; "
        "try again when the step has ended"
    )


def install_dir(lib_dir: Path) -> Path:
    """Where install puts our srun: a directory of its own, so that putting it on the
    workload's PATH adds nothing else."""
    return lib_dir / "bin"
