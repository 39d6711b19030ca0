"""What passes between the daemon and a job's supervisor (stasis.daemon.jobsupervisor), declared
once for both sides.

    daemon -> supervisor   its stdin: JOB_DIR, then one line of JSON, the Spec (it holds the
                           job's --env values: through the pipe, never into a file); for a
                           gated restore, later, "ok" when the restored tree may resume
    supervisor -> daemon   its stdout: one line of JSON, the answer (Ran, Restored or Failed)
    supervisor -> JOB_DIR  pid.json (PidFile) before it answers; exit.json (ExitFile) when the
                           job ends; memory.json (MemoryFile) when a lazy restore's memory is
                           all back; killed.json (KilledFile, the daemon writes it too) before a
                           job is killed for memory it could not have

`job.json` beside them is the daemon's (its JobRow, supervisor.write_job_file).

Typed dicts, like stasis.wire: a spare supervisor imports this before its job arrives. The files
keep their format across upgrades: a supervisor started by an older daemon writes them as it
always did, and the daemon started after it reads them to follow and adopt its job
(tracking.adopt_orphans); nothing finds a supervisor by its command line. The spec and the
answer pass only between a daemon and the supervisors it started, of its own version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, NotRequired, TypedDict, final

from stasis.atomicfile import write_atomically
from stasis.engine.privatetmp import ExternalFile
from stasis.wire import RestoreFacts, WireError

PID_FILE = "pid.json"
EXIT_FILE = "exit.json"
MEMORY_FILE = "memory.json"
KILLED_FILE = "killed.json"


# -- the spec -----------------------------------------------------------------------------------


class JobOwner(TypedDict):
    """Whose the job is and where its output goes, for a run and a restore alike."""

    uid: int
    gid: int
    groups: list[int]
    log: str  # the job's log, opened (or created) with the owner's rights
    umask: int  # the job's; the daemon's own (077) is not the job's business


class JobNetSpec(TypedDict):
    """A part of a job that spans nodes (issue 31): the namespace of its job network on this
    node that its tree lives in (stasis/daemon/jobnet.py) and the freezer cgroup of its own
    that holds the tree alone (stasis/daemon/partcgroup.py)."""

    netns: str
    cgroup: str


class RunSpec(JobOwner):
    mode: Literal["run"]
    command: list[str]
    cwd: str
    env: dict[str, str]
    init: str  # stasis-init, which execs the command
    # A mount namespace of its own with an empty tmpfs of this many bytes on /tmp and on
    # /var/tmp (engine/privatetmp.py).
    private_tmp: NotRequired[int]
    job_net: NotRequired[JobNetSpec]


class RestoreJob(JobOwner):
    """A restore's spec but for where its images come from."""

    mode: Literal["restore"]
    image_log: str  # the log's path in the images, re-pointed at `log`
    criu: str
    criu_log_dir: str
    criu_log_name: str
    # What the checkpoint recorded of the node that dumped it, compared with this one (None:
    # a checkpoint that predates them restores unchecked).
    expect: RestoreFacts | None
    checkpoint: str
    criu_version: str
    private_tmp: NotRequired[bool]  # the images hold the job's own mounts
    # Its files dumped as external, path: CRIU's key (engine/privatetmp.py).
    external_files: NotRequired[dict[str, ExternalFile]]
    # Restored in a mount namespace of the supervisor's with a new devpts (engine/privatepts.py).
    own_pts: NotRequired[bool]
    # Restored into that namespace (the images leave it out), in that cgroup.
    job_net: NotRequired[JobNetSpec]


class Images(TypedDict):
    """Where a restore's images are and how CRIU takes them."""

    images: str
    lazy: bool
    gate: bool  # resume only on the daemon's "ok" (supervisor.Gate)
    stream: NotRequired[bool]  # `images` holds an image streamer's socket (engine/streamer.py)
    page_server: NotRequired[str]  # the daemon's lazy page server's socket (daemon/lazystore.py)


class RestoreSpec(RestoreJob, Images):
    pass


Spec = RunSpec | RestoreSpec


# -- the answer ---------------------------------------------------------------------------------


@final
class Ran(TypedDict):
    pid: int  # the job's init, in its PID namespace's parent's numbering


@final
class Restored(TypedDict):
    pid: int
    duration_s: float
    lazy: bool  # its memory is still coming (lazy-pages runs)
    fallback: str | None  # why a lazy restore was done in full instead
    notes: list[str]  # what differs from the dumping node, safely


@final
class Failed(TypedDict):
    error: WireError


# -- the files in the job's directory -----------------------------------------------------------


class PidFile(TypedDict):
    pid: int
    pid_start: int | None  # the process's start time (proctree.start_time): not a reused pid


class ExitFile(TypedDict):
    exit_code: int  # 128+N for a job killed by signal N, as a shell says it
    signal: int | None


class MemoryFile(TypedDict):
    all_memory_s: float  # from the restore's start until lazy-pages ended
    ok: bool  # whether lazy-pages ended well


class KilledFile(TypedDict):
    reason: str


def write(job_dir: Path, name: str, data: PidFile | ExitFile | MemoryFile | KilledFile) -> None:
    """One of the files, whole or not at all (a reader never sees half of one). Not synced to
    the disk: pid.json is written while the restore's answer waits, and after a node's crash
    there is no job left to follow."""
    write_atomically(job_dir / name, json.dumps(data).encode(), durable=False)


def note_killed(job_dir: Path, reason: str) -> None:
    """Why the job is about to be killed: written before the kill, because its supervisor
    records the end as soon as the tree dies, and an end without it reads as a plain exit."""
    write(job_dir, KILLED_FILE, KilledFile(reason=reason))


def read_pid(job_dir: Path) -> PidFile | None:
    """The tree a job's supervisor wrote before answering; None if it did not (or it is not
    one)."""
    try:
        data = json.loads((job_dir / PID_FILE).read_text())
        pid, start = data["pid"], data.get("pid_start")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(pid, int) or pid <= 1 or not (start is None or isinstance(start, int)):
        return None
    return PidFile(pid=pid, pid_start=start)


def read_exit(job_dir: Path) -> ExitFile | None:
    """How the job ended, as its supervisor wrote it; None for a file that is not one.
    OSError as reading raises it (FileNotFoundError: not ended, or not written)."""
    try:
        data = json.loads((job_dir / EXIT_FILE).read_text())
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    code, sig = data.get("exit_code"), data.get("signal")
    if not isinstance(code, int) or not (sig is None or isinstance(sig, int)):
        return None
    return ExitFile(exit_code=code, signal=sig)
