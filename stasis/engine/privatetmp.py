"""A job's private /tmp and /var/tmp (`stasis run --private-tmp`): what the job keeps there is
its own, travels in its checkpoint, and is gone when the job ends for good.

How: the job's supervisor (stasis/daemon/jobsupervisor.py) gives the job a mount namespace of
its own, a slave of the node's (mounts the node makes later, e.g. home directories, still reach it;
nothing the job mounts reaches the node), with a fresh tmpfs on /tmp and one on /var/tmp, each
at most `size_bytes` (the `node_local_limit` setting): the job's memory cgroup pays for it.

Why a tmpfs in the job's namespace and not a directory of the daemon's bound there: CRIU dumps
a tmpfs that only the dumped namespace mounts by itself (`tmpfs-dev-N.tar.gz.img`, an image
like any other: hashed, signed, encrypted by the store) and rebuilds it on restore in a fresh
tmpfs, on any node. No code of ours reads or writes the job's files as root, so none can be
made to follow a link the job planted: the archive is made by tar from the real tree (a link
is recorded as a link, never followed), by CRIU from images only root can write, and unpacked
into an empty tmpfs. Every other mount of the namespace is one the node has too: CRIU declares
it external (auto_ext_mnt) and binds it from the same path on restore. And the end comes for
free: the kernel frees a tmpfs with the last process of its namespace, whether the job exited,
was killed, or stopped after its checkpoint, and whatever happened to the daemon.

What CRIU needs (seen, CRIU 4.2.1): every file the job has open must be opened inside the
namespace (a descriptor opened before the unshare names a mount the namespace lacks: "Can't
lookup mount=N"); restore needs `root` ("/": the node's own tree). A restored job breaks the
first rule by necessity: its restorer opens its new output files before CRIU rebuilds its
namespace. Such files are dumped as CRIU's external files (`outside_files`), which the manifest
records and the next restore hands over by CRIU's key instead of their path.
"""

from __future__ import annotations

import ctypes
import os
import re
import stat
from collections.abc import Mapping
from typing import Any, TypedDict

from stasis.engine import proctree
from stasis.errors import UsageError

# Where the job sees its own empty directories.
MOUNTS = ("/tmp", "/var/tmp")
# The tmpfs's source name, as mount tables show it (how tests and operators find them).
SOURCE = "stasis-private-tmp"

_CLONE_NEWNS = 0x00020000
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19


def enter(size_bytes: int) -> None:
    """In the job's init, as root, before it opens any file: a mount namespace of its own with
    an empty tmpfs on each of MOUNTS. OSError if the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # Slave, not private: the node's later mounts still appear; the job's never leave.
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    options = f"size={int(size_bytes)},mode=1777".encode()
    for path in MOUNTS:
        _check(
            libc.mount(SOURCE.encode(), path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options),
            f"mount tmpfs on {path}",
        )


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"private /tmp: {what}: {os.strerror(err)}")


def own_mount_ns(pid: int) -> bool:
    """Whether the process `pid` lives in another mount namespace than the caller's."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return False  # gone, or not ours to look at: CRIU will say what is wrong


def own_devices(pid: int) -> frozenset[int]:
    """The filesystems (st_dev) mounted in `pid`'s mount namespace and nowhere in the caller's:
    a job's private tmpfs's. CRIU carries their files in the images (tmpfs-dev-N.tar.gz.img),
    so they are neither facts of the node nor node-local files to carry again, and their paths
    mean nothing on the node. Empty when the process shares the caller's namespace."""
    if not own_mount_ns(pid):
        return frozenset()
    try:
        theirs = _devices(f"/proc/{pid}/mountinfo")
        ours = _devices("/proc/self/mountinfo")
    except OSError:
        return frozenset()
    return frozenset(theirs - ours)


def _devices(mountinfo: str) -> set[int]:
    found = set()
    with open(mountinfo) as f:
        for line in f:
            major, _, minor = line.split()[2].partition(":")
            found.add(os.makedev(int(major), int(minor)))
    return found


def key(mount: str) -> str:
    return "stasis" + mount.replace("/", "-")  # /var/tmp: stasis-var-tmp


def dump_options(opts: Any, pid: int) -> dict[str, ExternalFile]:
    """CRIU's dump options for a tree in a mount namespace of its own: every mount the node
    has as well is external (bound from the node's path again on restore), shared or slave
    ones too; what only the namespace has (its private tmpfs's) CRIU dumps.

    A /tmp or /var/tmp bound from a directory of the node's (Slurm's job_container/tmpfs binds
    BasePath/<jobid>/.<jobid>) is external under a key of ours instead: its restore binds the
    restorer's own /tmp there (a requeued job's new one, on whatever node, under whatever job
    id), not the old job's directory. Returns the files dumped as external (`outside_files`)."""
    opts.auto_ext_mnt = True
    opts.ext_sharing = True
    opts.ext_masters = True
    for mount in bound_from_node(pid):
        opts.external.append(f"mnt[{mount}]:{key(mount)}")
    outside = outside_files(pid)
    opts.external.extend(sorted({f["key"] for f in outside.values()}))
    return outside


class ExternalFile(TypedDict):
    """A file a tree holds open outside its own mount namespace, as its dump declared it."""

    key: str  # CRIU's: file[MNT_ID:INODE], both hex
    # Its st_mode at the dump: CRIU refuses the file handed over on restore with another.
    mode: int


def outside_files(pid: int) -> dict[str, ExternalFile]:
    """The output files (stdout, stderr) the tree rooted at `pid` holds open on a mount its own
    namespace lacks, by path: CRIU's key for each as an external file, and its mode.

    A restored tree has them: its restorer opened its new output files (inherit_fd) in its own
    namespace before CRIU rebuilt the tree's, and CRIU cannot dump such a descriptor by path
    ("Can't lookup mount=N"). Declared external, the dump records the key instead of the path,
    and the next restore hands the output over under that key (`hand_over`). Empty for a tree
    in the caller's namespace, or one that opened every file in its own."""
    if not own_mount_ns(pid):
        return {}
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            theirs = {line.split(" ", 1)[0] for line in f}
    except OSError:
        return {}
    found: dict[str, ExternalFile] = {}
    for task in proctree.tree(pid):
        # Only the outputs (stdout, stderr), which a restorer hands over: any other file from
        # outside (one passed in over a socket) still fails the dump, job running, rather than
        # making a checkpoint no restore could open.
        for fd in ("1", "2"):
            try:
                mnt_id = _fdinfo(fd, "mnt_id", task)
                if mnt_id is None or mnt_id in theirs:
                    continue
                st = os.stat(f"/proc/{task}/fd/{fd}")
                path = os.readlink(f"/proc/{task}/fd/{fd}")
            except (OSError, ValueError):
                continue
            # Regular files only, which a restorer can hand over (inherit_fd): a device CRIU
            # reopens itself by path; pipes, sockets and the like have no mount to look up.
            if (
                stat.S_ISREG(st.st_mode)
                and path.startswith("/")
                and not path.endswith(" (deleted)")
            ):
                key = f"file[{int(mnt_id):x}:{st.st_ino:x}]"
                found[path] = ExternalFile(key=key, mode=st.st_mode)
    return found


EXTERNAL_FILES_KEY = "external_files"
_EXTERNAL_FILE = re.compile(r"file\[[0-9a-f]{1,8}:[0-9a-f]{1,16}\]")


def external_files(extra: Mapping[str, Any]) -> dict[str, ExternalFile]:
    """What a checkpoint's manifest `extra` records of `outside_files`; only keys of CRIU's
    form, only regular files' modes."""
    found = extra.get(EXTERNAL_FILES_KEY)
    if not isinstance(found, dict):
        return {}
    out: dict[str, ExternalFile] = {}
    for path, entry in found.items():
        if not isinstance(entry, dict):
            continue
        key, mode = entry.get("key"), entry.get("mode")
        if isinstance(key, str) and _EXTERNAL_FILE.fullmatch(key) and isinstance(mode, int):
            if stat.S_ISREG(mode):
                out[str(path)] = ExternalFile(key=key, mode=mode)
    return out


def hand_over(path: str, fd: int, external: Mapping[str, ExternalFile], uid: int) -> str:
    """CRIU's inherit_fd key for `fd`, the file now in place of the one its images hold at
    `path`: its external key when the dump declared it one (`outside_files`), else its path
    without the leading '/'. An external one must have the mode it had (CRIU checks): the job's
    output file, its owner's (`uid`; 0: anyone's), is given it (permission bits only)."""
    found = external.get(path)
    if found is None:
        return path.lstrip("/")
    st = os.fstat(fd)
    want = stat.S_IMODE(found["mode"]) & 0o777
    if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != want:
        if uid == 0 or st.st_uid == uid:
            os.fchmod(fd, want)
    return found["key"]


def restore_options(opts: Any) -> None:
    """CRIU's restore options for images that hold the tree's own mount namespace."""
    opts.auto_ext_mnt = True
    opts.ext_sharing = True
    opts.ext_masters = True
    opts.root = "/"
    for mount in MOUNTS:  # a key the images do not use is ignored
        opts.ext_mnt.add(key=key(mount), val=mount)


def bound_from_node(pid: int) -> list[str]:
    """Which of MOUNTS are, in `pid`'s mount namespace, a directory of the node's bound there
    that is not what the node itself has there (Slurm's job_container/tmpfs binds
    BasePath/<jobid>/.<jobid> on /tmp): the job's own, on a filesystem the node has too. Not
    the namespace's own tmpfs's (CRIU carries those), nor the node's own /tmp seen from the
    job (a node's /var/tmp the job shares). Empty for a process in the caller's namespace."""
    if not own_mount_ns(pid):
        return []
    try:
        theirs = _tops(f"/proc/{pid}/mountinfo")
        ours = _tops("/proc/self/mountinfo")
        node_devs = _devices("/proc/self/mountinfo")
    except (OSError, ValueError, IndexError):
        return []
    found = []
    for mount in MOUNTS:
        seen = theirs.get(mount)
        if seen is None or seen[0] not in node_devs:
            continue
        if seen != _node_has(ours, mount):
            found.append(mount)
    return found


def _node_has(tops: dict[str, tuple[int, str]], path: str) -> tuple[int, str] | None:
    """What the node has at `path`: (filesystem, path within it) of the mount it lies in."""
    holder = max(
        (m for m in tops if path == m or path.startswith(m.rstrip("/") + "/")),
        key=len,
        default=None,
    )
    if holder is None:
        return None
    dev, root = tops[holder]
    rest = path[len(holder.rstrip("/")) :] if holder != path else ""
    return dev, (root.rstrip("/") + rest) or "/"


def _tops(mountinfo: str) -> dict[str, tuple[int, str]]:
    """Each mount point's topmost mount: (its filesystem, its root within it)."""
    tops: dict[str, tuple[int, str]] = {}
    with open(mountinfo) as f:
        for line in f:
            fields = line.split()
            major, _, minor = fields[2].partition(":")
            tops[fields[4]] = (os.makedev(int(major), int(minor)), fields[3])
    return tops


def under_private(path: str) -> str | None:
    """Which of MOUNTS `path` (absolute) is in, or None: there the job sees its own directory,
    not the node's."""
    norm = os.path.normpath(path)
    for mount in MOUNTS:
        if norm == mount or norm.startswith(mount + "/"):
            return mount
    return None


def require_outside(cwd: str, log: str | None) -> None:
    """UsageError when the job's working directory or log is where its private /tmp hides the
    node's: it would start in (or write to) its own empty directory instead."""
    for what, path in (("working directory", cwd), ("log", log)):
        mount = under_private(path) if path else None
        if mount is not None:
            raise UsageError(
                f"--private-tmp refused: the job's {what} {path} is under {mount}, which the "
                f"job sees as its own empty directory; give it a {what} outside {mount} "
                f"(--cwd, --log), or run it without --private-tmp"
            )


# The checkpoint's manifest says the tree had a mount namespace of its own (`extra`, signed with
# it): its restore rebuilds the mounts.
EXTRA_KEY = "own_mounts"


def recorded(extra: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's manifest `extra` says its images hold the tree's own mounts."""
    return extra.get(EXTRA_KEY) is True


def reopen_in_namespace(fds: tuple[int, ...] = (0, 1, 2)) -> None:
    """Reopen, by path, those of `fds` that were opened outside the caller's mount namespace
    (slurmstepd opens a job's stdin and output before the task joins its job container): CRIU
    cannot dump a descriptor whose mount the namespace lacks ("Can't lookup mount"). Runs with
    the job's own rights; a descriptor whose path now names another file (hidden under the
    job's private /tmp) is left as it is, and CRIU's dump says so."""
    try:
        with open("/proc/self/mountinfo") as f:
            here = {line.split(" ", 1)[0] for line in f}
    except OSError:
        return
    for fd in fds:
        try:
            mnt_id = _fdinfo(fd, "mnt_id")
            if mnt_id is None or mnt_id in here:
                continue
            path = os.readlink(f"/proc/self/fd/{fd}")
            was, now = os.fstat(fd), os.stat(path)
            if (was.st_dev, was.st_ino) != (now.st_dev, now.st_ino):
                continue
            flags = int(_fdinfo(fd, "flags") or "0", 8)
            mode = flags & os.O_ACCMODE
            # Output is appended: a file written since the dump must not fail its restore.
            extra = os.O_APPEND if mode != os.O_RDONLY and path != os.devnull else 0
            new = os.open(path, mode | extra | os.O_NOCTTY)
        except OSError:
            continue
        if new != fd:
            os.dup2(new, fd)
            os.close(new)


def _fdinfo(fd: int | str, key: str, pid: int | str = "self") -> str | None:
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == key:
                return value.strip()
    return None
