"""cgroup Slurm for the local cluster (`local-cluster up`'s default, `--no-cgroup` turns it
off): proctrack/cgroup and task/cgroup with ConstrainRAMSpace, as sites run Slurm.

Each node gets a cgroup subtree of its own: in every cgroup hierarchy of this machine a directory
`stasis-slurm-<id>/<node>` (id: from the cluster's directory), which the node's namespace holder
joins before it makes a cgroup namespace of its own; in the node's mount namespace
/sys/fs/cgroup is then mounted afresh, so that each hierarchy's root there is the node's
directory. The node's slurmd makes its `/slurm/uid_U/job_J/step_S` tree below it, as on a host of
its own: nodes (and two clusters on one machine, whose job ids both start at 1) never meet.

The one node of a one-node cluster is this machine but for its cgroups: its holder's mount
namespace is a slave copy of the machine's, taken when the node starts (where the machine's
mounts are private, as in containers and test roots, a mount made later on the machine does not
reach the node: make it in the node's namespace too, through its holder). No mount is added to
the machine's namespace: a job with a mount namespace of its own (job_container/tmpfs) copies
the machine's, and a mount that is gone, or hidden under the job's /tmp, by its restore fails it.

Slurm's cgroup plugin is the machine's: cgroup/v2 where /sys/fs/cgroup is a cgroup2 mount that
offers the memory controller, cgroup/v1 where a v1 hierarchy holds it (hybrid machines, e.g.
these, whose cgroup2 mount at /sys/fs/cgroup/unified has no controller but hugetlb: the memory
controller is bound to its v1 hierarchy and cannot move while that has cgroups).
"""

from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from stasis.errors import UsageError
from stasis.poll import poll

CGROUP_ROOT = "/sys/fs/cgroup"
# Mount options that are not a hierarchy's identity (its controllers, name=, cgroup2's flags).
_GENERIC_OPTS = {"rw", "ro"}


@dataclass(frozen=True)
class Hierarchy:
    mountpoint: str
    fstype: str  # cgroup or cgroup2
    options: str  # what identifies it: "memory", "name=systemd", "cpu", "" (cgroup2)


@dataclass(frozen=True)
class Machine:
    version: str  # "v1" or "v2": Slurm's CgroupPlugin=cgroup/<version>
    hierarchies: tuple[Hierarchy, ...]


def hierarchies(mountinfo: str | None = None) -> list[Hierarchy]:
    """The cgroup hierarchies mounted under /sys/fs/cgroup, from /proc/self/mountinfo."""
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    found: dict[str, Hierarchy] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4]
        if point != CGROUP_ROOT and not point.startswith(CGROUP_ROOT + "/"):
            continue
        opts = ",".join(o for o in tail[2].split(",") if o not in _GENERIC_OPTS)
        found[point] = Hierarchy(point, tail[0], opts)  # the last mount on a point wins
    return sorted(found.values(), key=lambda h: h.mountpoint)


def machine() -> Machine:
    """This machine's cgroup setup as Slurm would use it; UsageError where it offers no memory
    controller (ConstrainRAMSpace cannot hold)."""
    found = hierarchies()
    unified = [h for h in found if h.fstype == "cgroup2" and h.mountpoint == CGROUP_ROOT]
    if unified:
        controllers = _read(Path(CGROUP_ROOT) / "cgroup.controllers").split()
        if "memory" in controllers:
            return Machine("v2", tuple(unified))
    v1 = {o for h in found if h.fstype == "cgroup" for o in h.options.split(",")}
    if {"memory", "freezer"} <= v1:
        return Machine("v1", tuple(found))
    raise UsageError(
        "local-cluster up: cgroup Slurm (the default) needs a memory cgroup controller and "
        f"this machine offers none (neither a cgroup2 mount at {CGROUP_ROOT} with `memory` in "
        "cgroup.controllers nor cgroup v1 memory and freezer hierarchies); "
        "add --no-cgroup (proctrack/linuxproc, no memory limit)"
    )


def base_name(root: Path) -> str:
    """The cluster's cgroup directory name, the same for every `up` in one directory."""
    return "stasis-slurm-" + hashlib.sha256(str(root).encode()).hexdigest()[:12]


def node_dirs(m: Machine, base: str, node: str) -> list[Path]:
    return [Path(h.mountpoint) / base / node for h in m.hierarchies]


def make_node(m: Machine, base: str, node: str) -> list[str]:
    """Make `node`'s cgroup in every hierarchy; the cgroup.procs files its holder joins."""
    procs = []
    for h, d in zip(m.hierarchies, node_dirs(m, base, node)):
        for level in (d.parent, d):
            level.mkdir(exist_ok=True)
            if "cpuset" in h.options.split(","):
                # A v1 cpuset cgroup starts with no CPU and no memory node: nothing could join.
                for name in ("cpuset.cpus", "cpuset.mems"):
                    if not _read(level / name).strip():
                        (level / name).write_text(_read(level.parent / name))
        if h.fstype == "cgroup2":
            # Delegate what the machine's root offers (the node's slurmd enables them below).
            wanted = _read(d.parent.parent / "cgroup.subtree_control").split()
            for cg in (d.parent, d):
                have = _read(cg.parent / "cgroup.subtree_control").split()
                for c in wanted:
                    if c not in have:
                        (cg.parent / "cgroup.subtree_control").write_text(f"+{c}")
        procs.append(str(d / "cgroup.procs"))
    return procs


def join_prefix(m: Machine, base: str, node: str) -> list[str]:
    """A command prefix that moves what it runs into `node`'s cgroups, before it enters the
    node's namespaces (`nsenter --cgroup` moves nothing; a process outside its cgroup
    namespace's root is seen at `/../..`, and slurmd's jobs would stay in this machine's
    cgroups of every controller Slurm does not use). From outside the namespace: cgroup v2
    lets no process inside it move one in from outside its root."""
    procs = [str(d / "cgroup.procs") for d in node_dirs(m, base, node)]
    return [
        "sh",
        "-c",
        'for f in ' + " ".join(procs) + '; do echo $$ > "$f" || exit 125; ' 'done; exec "$@"',
        "sh",
    ]


def node_mounts(m: Machine) -> list[tuple[str, str, str]]:
    """What the node's holder mounts, in order, after it entered its cgroup namespace:
    (fstype, options, target); each hierarchy's root there is the node's cgroup."""
    if m.version == "v2":
        h = m.hierarchies[0]
        return [("cgroup2", h.options, CGROUP_ROOT)]
    return [
        ("tmpfs", "mode=755", CGROUP_ROOT),
        *((h.fstype, h.options, h.mountpoint) for h in m.hierarchies),
    ]


def remove(base: str, m: Machine | None = None, timeout_s: float = 10.0) -> list[str]:
    """Remove the cluster's cgroups (deepest first), once the processes in them are gone;
    the directories that could not be removed."""
    try:
        found = list(m.hierarchies) if m else hierarchies()
    except OSError:
        return []
    tops = [Path(h.mountpoint) / base for h in found]

    def attempt() -> list[str]:
        left = []
        for top in tops:
            if not top.is_dir():
                continue
            for d, _, _ in sorted(os.walk(top), key=lambda w: -len(Path(w[0]).parts)):
                try:
                    os.rmdir(d)
                except OSError as e:
                    if e.errno != errno.ENOENT:
                        left.append(d)
        return left

    left: list[str] = []

    def done() -> bool:
        nonlocal left
        left = attempt()
        return not left

    poll(done, timeout_s, 0.2)
    return left


def cgroup_conf(m: Machine) -> str:
    """cgroup.conf beside slurm.conf. Slurm 22.05 reads CgroupPlugin (cgroup/v1, cgroup/v2 or
    autodetect). cgroup/v2 asks systemd (over dbus) for slurmd's scope unless IgnoreSystemd
    (documented from 22.05.8 on), with which CgroupAutomount enables the controllers itself:
    there is no systemd in a node's namespaces. (Not run here: these machines have no memory
    controller on cgroup v2.)"""
    lines = [
        "# Written by `stasis-dev local-cluster up` (cgroup Slurm).",
        f"CgroupPlugin=cgroup/{m.version}",
        f"CgroupAutomount={'yes' if m.version == 'v2' else 'no'}",
        f"CgroupMountpoint={CGROUP_ROOT}",
        "ConstrainCores=no",
        "ConstrainDevices=no",
        "ConstrainRAMSpace=yes",
        "AllowedRAMSpace=100",
        "ConstrainSwapSpace=no",
    ]
    if m.version == "v2":
        lines.append("IgnoreSystemd=yes")
    return "\n".join(lines) + "\n"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
