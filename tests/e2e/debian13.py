"""A Debian 13 root (Slurm 24.11) for test_slurm_debian13.py, built by debian_root.sh.

Building it (debootstrap, apt, pip) takes minutes that are mostly waiting on the network and
the disk: `start_build` starts it in the background when the session's tests are known, and
`root` waits for it. Kept in /var/tmp between runs; a changed checkout renews only its venv.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).with_name("debian_root.sh")
CHECKOUT = Path(__file__).resolve().parents[2]
ROOT = Path(os.environ.get("STASIS_TEST_DEBIAN13_ROOT", "/var/tmp/stasis-test-trixie"))
LOG = ROOT.with_name(ROOT.name + ".build.log")
BUILD_TIMEOUT_S = 1200

_build: subprocess.Popen[bytes] | None = None


def start_build() -> None:
    global _build
    if _build is None:
        with open(LOG, "wb") as log:
            # Niced: the other tests run meanwhile, some of them timing a grace period.
            # One build of the root at a time: two test sessions on a machine (a developer's
            # and a helper's) once had one remove the venv the other was installing into.
            _build = subprocess.Popen(
                [
                    "flock",
                    str(ROOT.with_name(ROOT.name + ".lock")),
                    "nice",
                    "-n",
                    "10",
                    "bash",
                    str(SCRIPT),
                    "build",
                    str(ROOT),
                    str(CHECKOUT),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )


def root() -> Path:
    """The built root (waiting for the background build, or building it now)."""
    start_build()
    assert _build is not None
    try:
        code = _build.wait(BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _build.kill()
        raise AssertionError(
            f"the Debian 13 root was not built in {BUILD_TIMEOUT_S} s: " f"{_tail()}"
        ) from None
    if code != 0:
        raise AssertionError(f"building the Debian 13 root failed ({code}): {_tail()}")
    return ROOT


def enter(root: Path, cmd: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`cmd` (a shell command line) run as root inside `root`."""
    return subprocess.run(
        ["bash", str(SCRIPT), "enter", str(root), cmd],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def _tail() -> str:
    try:
        return "\n".join(LOG.read_text(errors="replace").splitlines()[-20:])
    except OSError as e:
        return f"(no log: {e})"
