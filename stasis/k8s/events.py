"""containerd's task events, followed for the one thing runc cannot tell: how a container
ended. A container under stasis whose init exits 0, with no stop asked of it, retires its
label's checkpoints (as a Slurm job that completes does); any other end keeps them, so the
next start resumes.

Read from `ctr events` (containerd's own client; its lines are `<time> <namespace> <topic>
<json>`), restarted when it ends, in a thread of its own.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("stasis.daemon")


@dataclass(frozen=True)
class TaskExit:
    namespace: str
    container_id: str
    exit_status: int | None  # None: unknown


def parse_exit(line: str) -> TaskExit | None:
    """A /tasks/exit event of a container's init (not of an exec'd process), else None."""
    head, brace, body = line.partition("{")
    fields = head.split()
    if not brace or len(fields) < 2 or fields[-1] != "/tasks/exit":
        return None
    try:
        event = json.loads(brace + body)
    except ValueError:
        return None
    cid = event.get("container_id")
    if not isinstance(cid, str) or event.get("id", cid) != cid:
        return None
    # containerd's JSON leaves a 0 out (protobuf's omitempty), so no exit_status in a whole
    # exit record is 0; one without its exit time, or with a status that is not a number,
    # says nothing: unknown, never 0 (a 0 retires the label).
    status = event.get("exit_status", 0)
    if "exited_at" not in event or not isinstance(status, int) or isinstance(status, bool):
        status = None
    return TaskExit(namespace=fields[-2], container_id=cid, exit_status=status)


class ExitFollower:
    def __init__(self, address: str, on_exit: Callable[[TaskExit], object]) -> None:
        self.address = address
        self.on_exit = on_exit
        self._stop = threading.Event()
        self._proc: subprocess.Popen[str] | None = None
        self._thread = threading.Thread(target=self._run, name="containerd events", daemon=True)

    def start(self) -> None:
        if shutil.which("ctr") is None:
            log.warning("ctr is not installed: containers that exit 0 keep their checkpoints")
            return
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            # A node without containerd (yet): nothing to follow, and no `ctr` started for it.
            if not os.path.exists(self.address):
                self._stop.wait(5.0)
                continue
            try:
                self._proc = subprocess.Popen(
                    ["ctr", "-a", self.address, "events"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
                assert self._proc.stdout is not None
                for line in self._proc.stdout:
                    ended = parse_exit(line)
                    if ended is not None:
                        try:
                            self.on_exit(ended)
                        except Exception:
                            log.exception("handling the end of container %s", ended.container_id)
                self._proc.wait()
            except OSError as e:
                log.warning("cannot follow containerd's events at %s: %s", self.address, e)
            self._stop.wait(2.0)

    def close(self) -> None:
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
