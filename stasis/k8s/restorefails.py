"""How often each checkpoint failed its `runc restore` on this node (issue 28): one small JSON
file per checkpoint, root's, in the daemon's state directory (not in the database: it is what
decides whether a label's newest work is given up on, and a rebuilt database must not forget
it, nor a corrupt one hide it).

A restore that fails on a good checkpoint (a port or a file it needs is taken or gone, a mount
missing) fails the container's create, which the kubelet retries; after `k8s_restore_attempts`
failures of one checkpoint, it is given up on this node and the label's previous checkpoint is
tried. Removing a checkpoint's file (`forget`, or by hand: the path is in every message) gives
it its attempts again.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from stasis.atomicfile import write_atomically
from stasis.store import is_checkpoint_id

DIRECTORY = "k8s-restore-failures"
_MAX_BYTES = 64 << 10  # a record is ~300 bytes; never read more than this
_ERROR_CHARS = 500


@dataclass(frozen=True)
class Failures:
    checkpoint: str
    attempts: int
    error: str  # the last failure's, in one line
    log: str  # where the last failure's restore log was kept ("" = nowhere)


class RestoreFailures:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, checkpoint: str) -> Path:
        if not is_checkpoint_id(checkpoint):  # never a path of someone's choosing
            raise ValueError(f"not a checkpoint id: {checkpoint!r}")
        return self.directory / f"{checkpoint}.json"

    def get(self, checkpoint: str) -> Failures:
        try:
            with open(self.path(checkpoint), "rb") as f:
                data = json.loads(f.read(_MAX_BYTES))
            return Failures(
                checkpoint,
                int(data["attempts"]),
                str(data.get("error", "")),
                str(data.get("log", "")),
            )
        except FileNotFoundError:
            return Failures(checkpoint, 0, "", "")
        except (OSError, ValueError, KeyError, TypeError) as e:
            # Unreadable: counted as one failure (not as none, not as given up).
            return Failures(checkpoint, 1, f"its record cannot be read: {e}", "")

    def failed(self, checkpoint: str, error: str, log: str) -> Failures:
        """One more failed restore of `checkpoint`: its record, counted."""
        now = self.get(checkpoint)
        done = Failures(checkpoint, now.attempts + 1, " ".join(error.split())[:_ERROR_CHARS], log)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomically(
            self.path(checkpoint),
            json.dumps(
                {
                    "attempts": done.attempts,
                    "error": done.error,
                    "log": done.log,
                    "at": datetime.now(UTC).isoformat(timespec="seconds"),
                }
            ).encode(),
            durable=False,
        )
        return done

    def forget(self, checkpoint: str) -> None:
        with contextlib.suppress(FileNotFoundError, ValueError):
            self.path(checkpoint).unlink()

    def prune(self, exists: Callable[[str], bool]) -> None:
        """Drop the records of checkpoints that are gone (deleted, retired)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            checkpoint = name.removesuffix(".json")
            if name.endswith(".json") and is_checkpoint_id(checkpoint) and not exists(checkpoint):
                self.forget(checkpoint)


def message(
    label: str,
    checkpoint: str,
    error: str,
    attempts: int,
    limit: int,
    kept_log: str,
    record: str,
    node: str,
) -> str:
    """What a failed restore of a good checkpoint tells the pod's owner (its create's error,
    its event): what failed, that nothing was lost, and what happens and can be done next."""
    where = f"; restore log on node {node}: {kept_log}" if kept_log else ""
    if limit <= 0:
        then = "it is tried again at every create"
    elif attempts < limit:
        then = (
            f"after {limit} failed attempts on this node the label's previous checkpoint "
            "is tried"
        )
    else:
        then = (
            f"it is given up on this node now (remove {record} to try it again): the next "
            "create tries the label's previous checkpoint"
        )
    counted = (
        f"attempt {attempts} of {limit or 'unbounded'} on node {node}"
        if attempts
        else f"not counted on node {node} (the stasis daemon did not answer)"
    )
    return (
        f"label {label}: restore of checkpoint {checkpoint} failed ({error}){where}; "
        f"{counted}. The container is "
        "not started fresh and the checkpoint is kept: its create fails and is retried "
        f"(the cause may be a port, file or mount it needs that is taken or missing); "
        f"{then}"
        + (
            "; STASIS_FRESH=1 on the container starts it fresh when none of the "
            "label's checkpoints can be restored"
            if limit > 0
            else ""
        )
    )
