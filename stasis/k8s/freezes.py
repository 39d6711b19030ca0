"""Containers frozen by a checkpoint, written down before `runc pause`, so that a daemon killed
during one thaws them at its next start.

A checkpoint of a container pauses it (cgroup freezer) for as long as CRIU dumps it. A daemon
killed (kill -9, OOM, a node agent restarted) in between left it paused forever: runc does not
thaw it, and a frozen process does not even die of the kubelet's SIGKILL (cgroup v1). So each
pause gets a small file under `<state_dir>/k8s-freezes/` until the container runs again or is
killed; the file says whether its checkpoint was published and whether the checkpoint was the
container's stop. The daemon settles every file it finds at its start (`settle`):

    published, for a stop   SIGKILL, then thaw: it never runs past the checkpoint it stopped at
                            (the next create resumes from it)
    anything else           thaw: a leave-running checkpoint goes on as if never taken; a stop
                            whose checkpoint was not published gets the stop's SIGTERM, which
                            the runtime queued (its label keeps its earlier checkpoints)

and the staging of a checkpoint never published is discarded. A file that cannot be settled
(runc fails) stays and is tried again (`Settler`). The daemon's own dump journal
(stasis.daemon.inflight) is for SIGSTOPped process trees; these are runc's freezes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from stasis.atomicfile import write_atomically
from stasis.errors import ContainerError, StasisError
from stasis.k8s.runc import Runc, validate_abs_path, validate_container_id
from stasis.store import is_checkpoint_id

log = logging.getLogger("stasis.daemon")

DIRECTORY = "k8s-freezes"
_MAX_BYTES = 64 << 10  # an entry is a few hundred bytes; anything larger is not ours


@dataclass
class Freeze:
    container_id: str
    runc_root: str
    checkpoint: str
    stop: bool  # the container's stop: once published, it must never run on
    published: bool = False


class FreezeJournal:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()

    def prepare(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)

    def _path(self, checkpoint_id: str) -> Path:
        return self.directory / f"{checkpoint_id}.json"

    def write(self, entry: Freeze) -> None:
        """Atomically, and on disk before the step it announces (fsync: a node's crash
        takes the frozen container with it, but a daemon's kill -9 does not)."""
        with self._lock:
            try:
                self.prepare()
                write_atomically(self._path(entry.checkpoint), json.dumps(asdict(entry)).encode())
            except OSError as e:
                # Unrecorded, a freeze could outlive a daemon killed during it: none is taken.
                raise ContainerError(
                    f"checkpoint of container {entry.container_id} not taken: cannot record "
                    f"its freeze in {self.directory} ({e.strerror or e}); free space there "
                    "(the daemon's state_dir)"
                ) from None

    def end(self, checkpoint_id: str) -> None:
        with self._lock:
            self._path(checkpoint_id).unlink(missing_ok=True)

    def open_entries(self) -> list[Freeze]:
        """Every entry on disk; unreadable ones (a write cut short: the `.tmp` never replaced
        the file, so the pause it announced never happened) are dropped."""
        found = []
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []
        for name in names:
            path = self.directory / name
            if name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    data = json.loads(f.read(_MAX_BYTES))
                entry = Freeze(**data)
                validate_container_id(entry.container_id)
                validate_abs_path(entry.runc_root, "runc root")
                if not is_checkpoint_id(entry.checkpoint) or name != f"{entry.checkpoint}.json":
                    raise ValueError("not an entry of this journal")
            except (OSError, ValueError, TypeError, StasisError) as e:
                log.warning("dropping unreadable freeze record %s: %s", path, e)
                path.unlink(missing_ok=True)
                continue
            found.append(entry)
        return found


def _still_dumping(entry: Freeze) -> int | None:
    """The `runc checkpoint` the killed daemon started for `entry`, when it still runs (a
    child outlives its parent's SIGKILL): thawed under it, the container would be frozen again
    when CRIU ends (it leaves the cgroup as it found it)."""
    want = f"runc-{entry.checkpoint}-"
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read(64 << 10).split(b"\0")
        except OSError:
            continue
        if (
            b"checkpoint" in argv
            and entry.container_id.encode() in argv
            and any(want.encode() in a for a in argv)
        ):
            return int(name)
    return None


def settle(entry: Freeze, runc: Runc) -> bool:
    """Thaw (or, for a published stop, kill and thaw) the container of `entry`; True when
    nothing of it is left frozen (also when the container is gone). False while the dead
    daemon's `runc checkpoint` still runs, or runc fails: tried again later."""
    cid = entry.container_id
    dumping = _still_dumping(entry)
    if dumping is not None:
        log.warning(
            "container %s: the checkpoint %s of a killed daemon still runs (pid %d); "
            "thawed once it ends",
            cid,
            entry.checkpoint,
            dumping,
        )
        return False
    try:
        state = runc.state(cid)
    except ContainerError as e:
        if "does not exist" in str(e) or "not exist" in str(e):
            return True  # deleted since: nothing frozen is left
        log.warning("container %s: cannot read its state to thaw it: %s", cid, e)
        return False
    status = str(state.get("status"))
    if status not in ("paused", "running", "pausing"):
        return True  # stopped or created: nothing runs, nothing is frozen
    try:
        if entry.stop and entry.published:
            runc.run("kill", cid, str(int(signal.SIGKILL)), timeout_s=10)
            log.warning(
                "container %s: killed at its stop checkpoint %s, which the daemon "
                "published before it died",
                cid,
                entry.checkpoint,
            )
        if status != "running":
            runc.run("resume", cid, timeout_s=10)
            log.warning(
                "container %s: thawed; the daemon died during its checkpoint %s " "(%s)",
                cid,
                entry.checkpoint,
                "published" if entry.published else "not published",
            )
    except ContainerError as e:
        log.warning(
            "container %s: cannot settle its checkpoint %s: %s (tried again)",
            cid,
            entry.checkpoint,
            e,
        )
        return False
    return True


__all__ = ["DIRECTORY", "Freeze", "FreezeJournal", "settle"]
