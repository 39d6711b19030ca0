"""How the harnesses run the machine's tools (munged, slurmctld, sacctmgr, ip, ...): one way,
with one-line failures, and the ports their services listen on."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess

from stasis.errors import SlurmError, StasisError, UsageError

TIMEOUT_S = 60
SLURM_MISSING = "run `make install` (scripts/install-slurm.sh)"
# The test session that started a harness (tests/leftovers.py): the daemons a harness starts with
# an environment of their own carry it on, so that one left running is found at the session's
# end, even as a new process (Slurm 24.11's reconfigure re-executes slurmctld and slurmd).
SESSION_MARK = "STASIS_TEST_SESSION"


def session_mark() -> dict[str, str]:
    """The mark of the test session running this harness, if any, for a daemon's environment."""
    mark = os.environ.get(SESSION_MARK)
    return {SESSION_MARK: mark} if mark else {}


def run(
    cmd: list[str],
    *,
    missing: str = "run `make install`",
    env: dict[str, str] | None = None,
    input_text: str | None = None,
    check: bool = True,
    error: type[StasisError] = StasisError,
) -> subprocess.CompletedProcess[str]:
    """`cmd` run to its end (at most TIMEOUT_S). A tool not installed is a UsageError that says
    `missing` (what installs it); one that does not answer, or fails when `check`, is `error`."""
    try:
        result = subprocess.run(
            cmd, env=env, input=input_text, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except FileNotFoundError as e:
        raise UsageError(f"{cmd[0]} is not installed; {missing}") from e
    except subprocess.TimeoutExpired as e:
        raise error(f"{' '.join(cmd)} did not answer in {TIMEOUT_S} s") from e
    if check and result.returncode != 0:
        raise error(f"{' '.join(cmd)} failed: {(result.stderr + result.stdout).strip()}")
    return result


def slurm(
    cmd: list[str],
    env: dict[str, str] | None = None,
    check: bool = True,
    input_text: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """A Slurm or munge tool, run as `run` does; its failures are SlurmErrors."""
    return run(
        cmd, missing=SLURM_MISSING, env=env, input_text=input_text, check=check, error=SlurmError
    )


_TAKEN: set[int] = set()


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range: one the kernel handed out
    for port 0 is free again the moment it is closed, and the next service or connection that
    asks for port 0 (a test's S3 server, a client) may get it before slurmctld binds it (seen:
    slurmctld "Address already in use", slurmd talking to someone else's server)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = secrets.randbelow(low - 10000) + 10000
        if port in _TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _TAKEN.add(port)
        return port
    raise StasisError(f"no free port found between 10000 and {low}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return low if low > 11000 else 32768
