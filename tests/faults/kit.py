"""The fault-injection harness: a daemon SIGKILLed at a named point (stasis/faults.py), started
again, and the invariants every fault test checks afterwards (issue 28):

- nothing is frozen: no process of a job stands stopped (state T) once the daemon is back;
- nothing runs twice: at most one live job per label, and no job's tree is alive outside a row;
- no work lost: the job runs on with its state (a counter that continues), or a checkpoint it
  can be restored from is listed under its label.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stasis.engine import proctree
from tests.conftest import STASIS, Daemon, wait_for


def arm(d: Daemon, *points: str) -> None:
    """Start `d` again (or for the first time) with `points` armed: it SIGKILLs itself when it
    reaches one. No points: started disarmed."""
    if d.proc is not None and d.proc.poll() is None:
        d.stop()
    d.env["STASIS_TEST_FAULT_POINTS"] = ":".join(points)
    d.start()


def start_cli(d: Daemon, *args: str) -> subprocess.Popen[str]:
    """A `stasis` command against `d`, in the background (it outlives the daemon's death)."""
    return subprocess.Popen(
        [STASIS, *args], env=d.env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def died(d: Daemon, timeout_s: float = 60.0) -> None:
    """Wait for `d` to die at its armed point (SIGKILL); it is left stopped, ready to `arm`."""
    assert d.proc is not None
    rc = d.proc.wait(timeout=timeout_s)
    assert rc == -signal.SIGKILL, (
        f"daemon ended with {rc}, not at its fault point: "
        + (d.root / "daemon.log").read_text()[-2000:]
    )
    d.proc = None
    d.log.close()


def kill_at(d: Daemon, point: str, *args: str, timeout_s: float = 60.0) -> str:
    """Run `stasis ARGS` against `d` armed at `point`, wait for the daemon to die there, and
    start it again disarmed; what the command printed on stderr (it failed: its daemon died)."""
    arm(d, point)
    cmd = start_cli(d, *args)
    died(d, timeout_s)
    _, err = cmd.communicate(timeout=60)
    arm(d)
    return err


def stopped(pid: int) -> list[int]:
    """The processes of the tree under `pid` in state T (stopped by a signal)."""
    found = []
    for p in proctree.tree(pid):
        try:
            text = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        if text.rsplit(")", 1)[1].split()[0] in ("T", "t"):
            found.append(p)
    return found


def live_jobs(d: Daemon, label: str | None = None) -> list[dict[str, Any]]:
    return [
        j
        for j in d.json("ps")
        if j["state"] in ("restoring", "running", "restored")
        and (label is None or j["label"] == label)
    ]


def checkpoints(d: Daemon, label: str) -> list[dict[str, Any]]:
    return [c for c in d.json("checkpoints") if c["label"] == label]


def assert_nothing_frozen(pids: Sequence[int]) -> None:
    for pid in pids:
        if proctree.alive(pid, None):
            wait_for(lambda: stopped(pid) == [], 30, f"the tree of {pid} to run again")


def assert_not_lost(d: Daemon, label: str, counted: int | None = None) -> None:
    """The invariant: the label's job runs once (not twice), or it has a checkpoint to restore."""
    live = live_jobs(d, label)
    assert len(live) <= 1, f"label {label} runs {len(live)} times: {live}"
    assert_nothing_frozen([j["pid"] for j in live if j["pid"]])
    if not live:
        assert checkpoints(d, label), f"label {label}: no job runs and no checkpoint is listed"


def tree_pids_of(label_marker: str) -> list[int]:
    """Pids whose command line contains `label_marker` (to find a tree running twice)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if label_marker.encode() in cmdline:
                found.append(int(name))
    return found
