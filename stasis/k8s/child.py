"""A child Python running one of stasis's own modules, isolated: where the Kubernetes side
reads what a tenant controls (a layer, an imported archive), a crash or a hang costs that one
child, and its answer comes back as its exit status and its last line. The child's side: how it
confines itself first, and how it says an error in one short line."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from typing import IO

# A child's address space: a tar header or a JSON that claims gigabytes fails there, not in the
# daemon.
MEMORY_BYTES = 1 << 31


def confine_self() -> None:
    """In the child, before it reads anything: what it creates is its own only, and its memory
    is bounded (MEMORY_BYTES)."""
    os.umask(0o077)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def short(e: BaseException) -> str:
    """The first line of what `e` says (its class's name if it says nothing), at most 200
    characters: what a child prints of an error."""
    return (str(e) or type(e).__name__).splitlines()[0][:200]


def run_module(
    module: str, args: list[str], timeout_s: float, stdin: IO[bytes] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -I -m module args...`, from /, its output as text; raises what subprocess.run
    raises (TimeoutExpired, OSError)."""
    # -I: no PYTHON* variables, no user site, not the current directory on sys.path.
    return subprocess.run(
        [sys.executable, "-I", "-m", module, *args],
        stdin=stdin,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout_s,
        cwd="/",
    )


def last_line(r: subprocess.CompletedProcess[str]) -> str:
    """What a child that failed said last (its stderr, else its stdout), or its exit status."""
    lines = (r.stderr or r.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {r.returncode}"
