"""Jobs this node requeued held because it could not tell whether they had a checkpoint (the
store unreachable, the node daemon down: stasis.slurm.taskinit), released again once it can.

`taskinit` (root, in the job's batch task) writes `<state_dir>/slurm-held/<job>` before it asks
Slurm for the hold: the job id, why, and what has to answer again (`store` or `daemon`). The
daemon's Slurm integration looks at that directory every few seconds (nothing to do when it is
empty) and, for each entry whose cause is over (the store lists the job's label again; the daemon
is up, since it runs this), releases the job, which starts again and resumes from its checkpoint.

Only what this node held is released, from its own root-owned directory: a user who writes
"stasis: held" into their job's Comment gets nothing released (an admin's hold stays an admin's
hold). A job no longer pending held (released by hand, cancelled, ended) loses its entry. A node
that dies with jobs it held leaves them held: `scontrol release` them by hand (their Comment says
so).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from stasis.atomicfile import write_atomically
from stasis.errors import SlurmJobNotFoundError, StasisError
from stasis.slurm import scontrol

log = logging.getLogger("stasis.slurm")

Cause = Literal["store", "daemon"]
RECHECK_S = 5.0  # how often the daemon looks (a directory listing while nothing is held)
_MAX_ENTRY = 4096
_ENDED = (
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
)


def note(held_dir: Path, job_id: str, cause: Cause, label: str, uid: int, restarts: int) -> None:
    """Written (atomically) before the job is requeued held, in its run number `restarts`: a
    daemon that finds it releases the job once `cause` is over."""
    scontrol.validate_slurm_job_id(job_id)
    held_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomically(
        held_dir / job_id,
        json.dumps(
            {"job": job_id, "cause": cause, "label": label, "uid": uid, "restarts": restarts}
        ).encode(),
        durable=False,
    )


def forget(held_dir: Path, job_id: str) -> None:
    (held_dir / job_id).unlink(missing_ok=True)


def _read(path: Path) -> dict[str, object] | None:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(_MAX_ENTRY))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def release_over(held_dir: Path, store_answers: Callable[[str, int], bool]) -> list[str]:
    """Release the jobs held here whose cause is over; the jobs released.
    `store_answers(label, uid)`: whether the store lists that label's checkpoints again."""
    try:
        names = sorted(n for n in os.listdir(held_dir) if not n.startswith("."))
    except FileNotFoundError:
        return []
    released = []
    for name in names:
        entry = _read(held_dir / name)
        if entry is None or entry.get("job") != name:
            forget(held_dir, name)
            continue
        try:
            info = scontrol.job_info(name)
        except SlurmJobNotFoundError:
            forget(held_dir, name)
            continue
        except StasisError as e:
            log.warning("Slurm job %s held by this node: cannot read its state: %s", name, e)
            continue
        noted = entry.get("restarts")
        if not isinstance(noted, int) or info.restarts > noted + 1:
            forget(held_dir, name)  # held in an earlier run, ran again since
            continue
        if info.restarts <= noted and info.state not in _ENDED:
            continue  # the requeue asked has not happened yet
        if info.state in _ENDED or info.state in ("RUNNING", "SUSPENDED"):
            forget(held_dir, name)  # cancelled, or released by hand and running again
            continue
        if info.state != "PENDING":
            continue  # on its way to the hold (COMPLETING, REQUEUE_HOLD, ...)
        # JobHeldAdmin, JobHeldUser, job_requeued_in_held_state (requeuehold)
        if "held" not in info.reason.lower():
            forget(held_dir, name)  # released by hand, waiting for a node
            continue
        if entry.get("cause") == "store":
            label, uid = entry.get("label"), entry.get("uid")
            if not (isinstance(label, str) and isinstance(uid, int) and store_answers(label, uid)):
                continue
        try:
            scontrol.set_comment(name, "")
            scontrol.release(name)
        except StasisError as e:
            log.warning("Slurm job %s held by this node: cannot release it: %s", name, e)
            continue
        forget(held_dir, name)
        log.info("Slurm job %s released: what it was held for is over", name)
        released.append(name)
    return released
