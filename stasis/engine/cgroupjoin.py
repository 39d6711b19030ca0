"""Move a process tree into the cgroups another process is in (root only).

A Slurm job's tree is restored by a helper that runs in the batch task before slurmstepd has put
the task into its step's cgroups (seen with Slurm 22.05, proctrack/cgroup and task/cgroup on
cgroup v1: the helper ran in the job's freezer cgroup and the step's memory cgroup, the task
later in the step's freezer and task_0 memory cgroups). Processes forked before that stay
behind: outside the step's memory limit, and proctrack/cgroup neither lists nor kills them. Once
the task runs the launcher, its cgroups are final; the node daemon then moves the restored tree
into them (`join`), in every hierarchy where it differs.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path

from stasis.engine import proctree


@dataclass(frozen=True)
class _Mount:
    root: str  # the cgroup the mount shows at its mountpoint
    point: str


def _mounts() -> dict[str, _Mount]:
    """Each cgroup hierarchy's mount in this mount namespace, keyed as /proc/PID/cgroup names
    it: its controllers (v1, "memory", "name=systemd", "cpu,cpuacct") or "" (v2)."""
    found: dict[str, _Mount] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            key = ""
        elif tail[0] == "cgroup":
            opts = tail[2].split(",")
            key = ",".join(
                o
                for o in opts
                if o not in ("rw", "ro", "clone_children", "noprefix", "xattr")
                and not o.startswith(("release_agent=", "cpuset_v2_mode"))
            )
        else:
            continue
        # The last mount of a hierarchy is the one on top (a node's own over the machine's).
        found[key] = _Mount(fields[3], fields[4])
    return found


def _cgroups(pid: int) -> dict[str, str]:
    """`pid`'s cgroup in each hierarchy, keyed like `_mounts`; {} when it is gone."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return {}
    result = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            result[parts[1]] = parts[2]
    return result


def _directory(mount: _Mount, path: str) -> Path | None:
    """Where the cgroup `path` is in this mount namespace; None where it is not visible (outside
    the mount's root, or outside our cgroup namespace: "/..")."""
    if path.startswith("/.."):
        return None
    root = mount.root.rstrip("/")
    if root and path != root and not path.startswith(root + "/"):
        return None
    return Path(mount.point + path[len(root) :])


def join(reference: int, top: int, rounds: int = 5) -> int:
    """Move `top` and all its descendants into `reference`'s cgroup in every hierarchy where
    theirs differs. Repeated while a round still moves something (a process forked meanwhile is
    born where its parent was). How many moves were made."""
    mounts = _mounts()
    target = _cgroups(reference)
    moved = 0
    for _ in range(rounds):
        this_round = 0
        for pid in proctree.tree(top):
            for key, path in _cgroups(pid).items():
                want = target.get(key)
                if want is None or want == path or key not in mounts:
                    continue
                where = _directory(mounts[key], want)
                if where is None:
                    continue
                try:
                    (where / "cgroup.procs").write_text(str(pid))
                except OSError as e:
                    if e.errno == errno.ESRCH:
                        continue  # it ended meanwhile
                    raise
                this_round += 1
        moved += this_round
        if not this_round:
            break
    return moved
