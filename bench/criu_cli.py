"""The baseline a user without stasis has: `criu dump -t PID -D DIR`, `criu restore -D DIR -d`."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.procs import BenchError

CRIU = "/usr/local/sbin/criu"
TIMEOUT_S = 300


@dataclass(frozen=True)
class CliResult:
    wall_s: float
    pid: int | None  # restore only: the restored tree's root


def _run(args: list[str], what: str, log: Path) -> float:
    start = time.monotonic()
    try:
        # A hung baseline must fail its case, not the suite (seen: `criu restore` spinning).
        done = subprocess.run(
            args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what} did not finish in {TIMEOUT_S} s; see {log}") from None
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise BenchError(f"{what} failed ({done.returncode}); see {log}: {done.stderr[-300:]}")
    return wall


def dump(pid: int, images: Path, work: Path, leave_running: bool) -> CliResult:
    """Dump the tree of `pid`; CRIU kills it afterwards unless `leave_running`.

    The log goes to a separate work dir (-W) so the images dir holds images only, like stasis'.
    CRIU's default verbosity, as a user would run it.
    """
    args = [CRIU, "dump", "-t", str(pid), "-D", str(images), "-W", str(work), "-o", "dump.log"]
    if leave_running:
        args.append("--leave-running")
    return CliResult(_run(args, "criu dump", work / "dump.log"), None)


def restore(images: Path, work: Path) -> CliResult:
    """Restore detached (-d): the command returns once the tree runs again."""
    pidfile = work / "restore.pid"
    pidfile.unlink(missing_ok=True)
    args = [
        CRIU,
        "restore",
        "-D",
        str(images),
        "-W",
        str(work),
        "-o",
        "restore.log",
        "-d",
        "--pidfile",
        str(pidfile),
    ]
    wall = _run(args, "criu restore", work / "restore.log")
    return CliResult(wall, int(pidfile.read_text().strip()))
