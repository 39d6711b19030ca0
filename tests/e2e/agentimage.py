"""The agent's image for test_agent_image.py, built by scripts/build-image.sh (`make image`).

The build (the node packages, a Debian root, dpkg, packing) takes one to two minutes, mostly
waiting on the network and the disk: `start_build` starts it in the background when the
session's tests are known, and `archive` waits for it. It runs niced, in a mount namespace of
its own: debootstrap mounts /proc and /sys in the root it makes, and a mount made on the
machine while another test's job is dumped can fail that dump (tests/parallel.py, EXCLUSIVE).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 900

_build: subprocess.Popen[bytes] | None = None
_dir: Path | None = None


def start_build() -> None:
    global _build, _dir
    if _build is not None:
        return
    _dir = Path(tempfile.mkdtemp(prefix="stasis-agent-image-", dir="/var/tmp"))
    with open(_dir / "build.log", "wb") as log:
        _build = subprocess.Popen(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "nice",
                "-n",
                "10",
                "bash",
                str(CHECKOUT / "scripts" / "build-image.sh"),
                str(_dir / "agent.oci.tar"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=CHECKOUT,
            start_new_session=True,
        )


def archive() -> Path:
    """The image's OCI archive (waiting for the background build, or building it now)."""
    start_build()
    assert _build is not None and _dir is not None
    try:
        code = _build.wait(BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop()
        raise AssertionError(f"the agent's image was not built in {BUILD_TIMEOUT_S} s") from None
    log = (_dir / "build.log").read_text(errors="replace")
    assert code == 0, f"building the agent's image failed ({code}): {log[-3000:]}"
    return _dir / "agent.oci.tar"


def stop() -> None:
    """At the session's end: a build still under way killed whole, and what it made removed."""
    global _build, _dir
    if _build is not None and _build.poll() is None:
        try:
            os.killpg(_build.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _build.wait()
    if _dir is not None:
        shutil.rmtree(_dir, ignore_errors=True)
    _build = _dir = None
