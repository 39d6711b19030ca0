"""A checkpoint restored where it can do nothing: what `stasis verify` runs.

`verify_images` starts `python -m stasis.engine.sandbox` (a fresh single-threaded process: a
threaded daemon cannot unshare a mount namespace) at nice 19 and idle I/O priority. It:

  - unshares its own mount namespace, makes every mount in it private (nothing propagates back
    to the node) and mounts an empty tmpfs over /tmp, /var/tmp, /dev/shm and /run: node-local
    files recreated for the restore, ghost files CRIU recreates there and unix sockets bound
    there never touch the node's; the restore finds what a node that never ran the job has;
  - unshares its own network namespace (only `lo`, up): no route out, and the restored sockets
    are the namespace's; established TCP connections come back closed (CRIU `tcp_close`), and
    CRIU takes no network lock (SKIP: no iptables or nft rule, here or on the node);
  - restores the images with CRIU into the job's own PID namespace (jobs are PID-namespace
    inits) with `leave_stopped`: CRIU stops every task before it returns to the job's code, so
    not one instruction of the job runs;
  - compares the tree that came back with the one the images record (pstree.img: every
    process, by its pid inside the job's namespace), then SIGKILLs it (the namespace's init:
    the kernel kills the rest) and reaps it. With the process gone, its namespaces and their
    tmpfs mounts go too.

The images and CRIU's log directory are handed over as open directories (the tmpfs over /tmp
hides their paths). What a restore would write on the node outside those directories is
avoided or stated: CRIU reopens the job's files without O_TRUNC or O_CREAT, with the owner's
rights; the job's output log is re-pointed at a file in the private /tmp; a checkpoint holding
a link-remapped file (a deleted file still linked elsewhere: CRIU removes that link once
restored) is not restored here at all, its verdict says why. File locks are taken on the job's
files for the moments the stopped tree lives (a job still running and holding them makes the
verify fail, not wait: CRIU takes them without blocking). Ghost files (deleted files the job
held open, recreated at their old path and removed by CRIU before the tree is stopped) outside
the private directories appear on the node for the duration of the restore.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import platform
import secrets
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stasis import faults, wire
from stasis.engine import privatepts, privatetmp, proctree, protobuf

# The node-local directories a sandbox gets its own empty tmpfs over (issue 29's list).
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
# Bytes of a sandbox's answer, at most (one JSON line).
_ANSWER_MAX = 1 << 16
# Processes a pstree image may list before it is taken for garbage.
_PSTREE_MAX_BYTES = 64 << 20

# files.img: FileEntry{usk=16}; UnixSkEntry{name=11, name_dir=14}
_FILE_USK, _USK_NAME, _USK_NAME_DIR = 16, 11, 14
# Entries of a unix socket's directory a sandbox mirrors by bind mounts, at most.
_SHADOW_MAX_ENTRIES = 4096
_MS_BIND = 0x1000
_CLONE_NEWPID = 0x20000000
_PR_SET_PDEATHSIG = 1
_MS_NOEXEC = 8
_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 0x4000, 1 << 18
_MS_SLAVE, _MS_SHARED = 1 << 19, 1 << 20
_PR_SET_CHILD_SUBREAPER = 36
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
_IOPRIO_CLASS_IDLE = 3
# States of a restored task that runs nothing: stopped (or traced), or a zombie it recorded.
_STOPPED = ("T", "t", "Z")
_STOP_WAIT_S = 2.0
# pstree.img: PstreeEntry{pid=1, ppid=2, pgid=3, sid=4, threads=5}
_PSTREE_PID = 1
# remap-fpath.img: RemapFilePathEntry{orig_id=1, remap_id=2, remap_type=3}; LINKED is 0, and
# images of old CRIUs mark a ghost by this bit of remap_id instead of a type.
_REMAP_ORIG_ID, _REMAP_TYPE, _REMAP_ID, _REMAP_GHOST_BIT = 1, 3, 2, 1 << 31
# files.img: FileEntry{reg=3}; RegFileEntry{id=1, name=6}
_FILE_REG, _REG_ID, _REG_NAME = 3, 1, 6


@dataclass(frozen=True)
class SandboxVerdict:
    ok: bool
    reason: str  # "" when ok
    processes: int  # that came back (ok) or that the images record
    duration_s: float  # the restore's (CRIU's part)


def verify_images(
    criu: str,
    images: Path,
    log_dir: Path,
    log_name: str,
    *,
    uid: int,
    gid: int,
    groups: list[int],
    image_log: str | None,
    expect: wire.RestoreFacts | None,
    checkpoint: str,
    criu_version: str | None,
    timeout_s: float,
    own_mounts: bool = False,
    external_files: Mapping[str, privatetmp.ExternalFile] | None = None,
    travelling: Sequence[str] = (),
) -> SandboxVerdict:
    """Restore the images in `images` in a sandbox (see the module's docstring), as the tree
    of owner `uid`, check it and remove it (`own_mounts`: the images hold the tree's own mount
    namespace, a job's private /tmp: engine/privatetmp.py, and `external_files` the files its
    dump declared external there; `travelling`: the node-local files
    the checkpoint carries, engine/nodelocal.py, recreated only in the sandbox). Never raises for what the checkpoint does wrong:
    the verdict says it; OSError only when the sandbox itself cannot be started."""
    spec = {
        "faults": sorted(faults.armed()),
        "criu": criu,
        "log_name": log_name,
        "uid": uid,
        "gid": gid,
        "groups": groups,
        "image_log": image_log,
        "expect": expect,
        "checkpoint": checkpoint,
        "criu_version": criu_version,
        "own_mounts": own_mounts,
        "external_files": dict(external_files or {}),
        "travelling": list(travelling),
    }
    images_fd = os.open(images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    log_fd = os.open(log_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    spec.update(images_fd=images_fd, log_fd=log_fd)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stasis.engine.sandbox"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            pass_fds=(images_fd, log_fd),
            start_new_session=True,
        )
    finally:
        os.close(images_fd)
        os.close(log_fd)
    try:
        out, _ = proc.communicate(json.dumps(spec).encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_sandbox(proc)
        return SandboxVerdict(
            False, f"the sandboxed restore did not finish within " f"{timeout_s:g} s", 0, timeout_s
        )
    finally:
        if proc.poll() is None:
            _kill_sandbox(proc)
    try:
        answer = json.loads(out[:_ANSWER_MAX].decode().splitlines()[0])
        return SandboxVerdict(
            bool(answer["ok"]),
            str(answer["reason"]),
            int(answer["processes"]),
            float(answer["duration_s"]),
        )
    except (ValueError, IndexError, KeyError, TypeError):
        return SandboxVerdict(
            False,
            f"the sandbox ended without a verdict (exit status " f"{proc.returncode})",
            0,
            0.0,
        )


def _kill_sandbox(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the sandbox and everything under it (CRIU, a half-restored or stopped tree),
    again until nothing is left: a stopped tree would otherwise keep its namespaces forever."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        pids = [p for p in proctree.tree(proc.pid) if proctree.alive(p, None)]
        if not pids:
            break
        for pid in reversed(pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    proc.wait()


# -- in the sandbox process -------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _lower_priority() -> None:
    os.nice(19)
    number = _IOPRIO_SET.get(platform.machine())
    if number is not None:
        # ioprio_set(IOPRIO_WHO_PROCESS, self, IOPRIO_PRIO_VALUE(IDLE, 0)); CRIU inherits it.
        _libc.syscall(number, 1, 0, _IOPRIO_CLASS_IDLE << 13)


def _enter_namespaces(own_mounts: bool) -> None:
    """In the sandbox's PID-namespace init, already in its own mount and network namespaces.
    `own_mounts`: the images hold the job's own mount namespace, whose mounts the node has too
    are bound from the same paths on restore (engine/privatetmp.py)."""
    # Nothing mounted here may reach the node, and nothing of the node's mounts changes:
    # private, or (a job's own mount namespace to restore) slaves of the node's, which CRIU
    # copies the job's mounts' propagation from, and which propagate nothing back.
    _check(
        _libc.mount(
            b"none", b"/", None, _MS_REC | (_MS_SLAVE if own_mounts else _MS_PRIVATE), None
        ),
        "mount --make-rprivate /",
    )
    nested = _nested_mount_points() if own_mounts else []
    # CRIU and the comparison read /proc: this PID namespace's.
    _check(
        _libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None),
        "mount proc on /proc",
    )
    # The job's terminals get their numbers back whatever the node's /dev/pts holds, and the
    # sandbox's are gone with it (engine/privatepts.py).
    privatepts.enter(new_namespace=False)
    for d in PRIVATE_DIRS:
        if not os.path.isdir(d) or os.path.islink(d):
            continue
        mode = b"mode=0755" if d == "/run" else b"mode=1777"
        _check(
            _libc.mount(b"tmpfs", d.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, mode),
            f"mount tmpfs on {d}",
        )
        if own_mounts:
            # A peer group of this namespace alone, for the job's mounts below it to copy.
            _check(
                _libc.mount(b"none", d.encode(), None, _MS_SHARED, None), f"mount --make-shared {d}"
            )
    # The job's namespace has the node's mounts below them too, which CRIU binds from the same
    # paths: an empty directory (or file) at each, in the private tmpfs, not their content.
    for point, is_dir in nested:
        if is_dir:
            os.makedirs(point, mode=0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(point), mode=0o755, exist_ok=True)
            os.close(os.open(point, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    # Listening sockets bound to 127.0.0.1 come back; there is no other interface to reach.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, _SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | _IFF_UP, b""))


def _nested_mount_points() -> list[tuple[str, bool]]:
    """The node's mount points below the private directories (path, whether a directory),
    parents first."""
    points = {}
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            point = line.split()[4].decode(errors="surrogateescape")
            point = point.replace("\\040", " ").replace("\\011", "\t")
            if any(point.startswith(d + "/") for d in PRIVATE_DIRS) and os.path.lexists(point):
                points[point] = os.path.isdir(point) and not os.path.islink(point)
    return sorted(points.items(), key=lambda p: (p[0].count("/"), p[0]))


def _entries(data: bytes) -> list[bytes]:
    """The messages of a CRIU image: past its 8-byte magic, each after a 32-bit size."""
    at, out = 8, []
    while at + 4 <= len(data):
        size = int.from_bytes(data[at : at + 4], "little")
        at += 4
        if at + size > len(data):
            raise ValueError("an entry runs past the end")
        out.append(data[at : at + size])
        at += size
    return out


def recorded_pids(images: Path) -> set[int]:
    """The pids (inside the job's PID namespace) of every process the images record."""
    with open(images / "pstree.img", "rb") as f:
        data = f.read(_PSTREE_MAX_BYTES)
    pids = set()
    for entry in _entries(data):
        pid = [v for n, v in protobuf.fields(entry) if n == _PSTREE_PID and isinstance(v, int)]
        if not pid:
            raise ValueError("a process without a pid")
        pids.add(pid[-1])
    if not pids:
        raise ValueError("no process")
    return pids


def linked_remaps(images: Path) -> int:
    """How many files the images hold as link remaps (a deleted file's extra hard link that
    CRIU made at dump time and removes once it restored it)."""
    try:
        with open(images / "remap-fpath.img", "rb") as f:
            data = f.read(_PSTREE_MAX_BYTES)
    except FileNotFoundError:
        return 0
    count = 0
    for entry in _entries(data):
        fields = dict((n, v) for n, v in protobuf.fields(entry) if isinstance(v, int))
        kind = fields.get(_REMAP_TYPE)
        if kind == 0 or (kind is None and not fields.get(_REMAP_ID, 0) & _REMAP_GHOST_BIT):
            count += 1
    return count


def bound_unix_paths(images: Path) -> set[str]:
    """The file-system addresses of the unix sockets the images record (bound, listening or
    deleted since; abstract ones belong to the network namespace and are left out)."""
    paths: set[str] = set()
    for name, is_file_entry in (("files.img", True), ("unixsk.img", False)):
        try:
            with open(images / name, "rb") as f:
                data = f.read(_PSTREE_MAX_BYTES)
        except FileNotFoundError:
            continue
        for entry in _entries(data):
            sockets = (
                [v for n, v in protobuf.fields(entry) if n == _FILE_USK and isinstance(v, bytes)]
                if is_file_entry
                else [entry]
            )
            for usk in sockets:
                fields = protobuf.fields(usk)
                raw = next((v for n, v in fields if n == _USK_NAME and isinstance(v, bytes)), b"")
                if not raw or raw.startswith(b"\0"):
                    continue
                raw = raw.split(b"\0", 1)[0]  # the kernel's address may end in a NUL
                where = next(
                    (v for n, v in fields if n == _USK_NAME_DIR and isinstance(v, bytes)), b"/"
                )
                path = os.path.normpath(
                    os.path.join(
                        "/",
                        where.decode(errors="surrogateescape"),
                        raw.decode(errors="surrogateescape"),
                    )
                )
                paths.add(path)
    return paths


def ghost_paths(images: Path) -> set[str]:
    """The paths of the deleted files the job held open or mapped that the images carry as
    ghosts: a restore recreates each beside its old path for a moment (NAME.cr.ID.ghost)."""
    return set(ghost_files(images).values())


def ghost_files(images: Path) -> dict[str, str]:
    """The names a restore of `images` gives its ghosts while it restores (CRIU's
    `PATH.cr.ID.ghost`, ID its remap id in hex), each with the PATH of the deleted file it
    stands for. CRIU removes them before the tree resumes, or when it fails by itself."""
    try:
        with open(images / "remap-fpath.img", "rb") as f:
            remaps = _entries(f.read(_PSTREE_MAX_BYTES))
    except FileNotFoundError:
        return {}
    ghosts: dict[int, int] = {}  # the file's id: the ghost's
    for entry in remaps:
        fields = dict((n, v) for n, v in protobuf.fields(entry) if isinstance(v, int))
        kind, remap_id = fields.get(_REMAP_TYPE), fields.get(_REMAP_ID, 0)
        if kind == 1 or (kind is None and remap_id & _REMAP_GHOST_BIT):
            ghosts[fields.get(_REMAP_ORIG_ID, -1)] = remap_id & ~_REMAP_GHOST_BIT
    if not ghosts:
        return {}
    with open(images / "files.img", "rb") as f:
        files = _entries(f.read(_PSTREE_MAX_BYTES))
    names = {}
    for entry in files:
        for reg in (
            v for n, v in protobuf.fields(entry) if n == _FILE_REG and isinstance(v, bytes)
        ):
            parts = protobuf.fields(reg)
            ids = [v for n, v in parts if n == _REG_ID and isinstance(v, int)]
            name = next((v for n, v in parts if n == _REG_NAME and isinstance(v, bytes)), b"")
            if ids and ids[0] in ghosts and name:
                path = os.path.normpath(os.path.join("/", name.decode(errors="surrogateescape")))
                names[f"{path}.cr.{ghosts[ids[0]]:x}.ghost"] = path
    return names


def _private(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in PRIVATE_DIRS)


def _shadow_plan(paths: Iterable[str]) -> dict[str, set[str]]:
    """Which directories to shadow (`_shadow`), each with the names to leave out of it: the
    unix socket addresses and node-local files of the job (`paths`) outside the private
    directories. Where a path's directory is missing, its nearest existing ancestor is
    shadowed, so that what the restore makes on the way is made in the sandbox."""
    plan: dict[str, set[str]] = {}
    for path in paths:
        if _private(path):
            continue
        parent = os.path.dirname(path)
        if os.path.isdir(parent):
            plan.setdefault(parent, set()).add(os.path.basename(path))
            continue
        while parent != "/" and not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if parent == "/":
            raise _NotVerifiable(
                f"not verified: {path} would be made in a directory the node "
                "lacks, below / itself, which a sandbox does not shadow"
            )
        plan.setdefault(parent, set())
    return plan


def _shadow(by_dir: dict[str, set[str]]) -> None:
    """CRIU restores a bound unix socket by removing whatever is at its address and binding
    anew: outside the private tmpfs, that would take a running job's listening socket off the
    node (seen); it recreates a deleted file the job held (a ghost) beside its old path for the
    restore; and the node-local files a checkpoint carries are recreated (or replaced) at
    their paths before CRIU runs. So, in this mount namespace only, each such directory becomes
    a tmpfs holding bind mounts of everything else the directory holds (the job's other files
    reopen as themselves, nothing is copied) and nothing at those paths: what the restore makes
    there the node never sees."""
    for directory in sorted(by_dir, key=len):  # parents first: a child is shadowed inside
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # not there: CRIU says so, nothing of the node is in the way
        try:
            st = os.fstat(fd)
            entries = [e for e in os.listdir(fd) if e not in by_dir[directory]]
            if len(entries) > _SHADOW_MAX_ENTRIES:
                raise _NotVerifiable(
                    f"not verified: its directory {directory} holds "
                    f"{len(entries)} entries, more than a sandbox mirrors "
                    f"({_SHADOW_MAX_ENTRIES})"
                )
            options = f"mode={st.st_mode & 0o7777:o},uid={st.st_uid},gid={st.st_gid}"
            _check(
                _libc.mount(
                    b"tmpfs", directory.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode()
                ),
                f"mount tmpfs on {directory}",
            )
            for name in entries:
                _mirror(fd, directory, name)
        finally:
            os.close(fd)


def _mirror(dir_fd: int, directory: str, name: str) -> None:
    """Entry `name` of the original directory (open as `dir_fd`) into its tmpfs shadow."""
    target = os.path.join(directory, name)
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=dir_fd), target)
        return
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(target, 0o700)
    else:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    source = f"/proc/self/fd/{dir_fd}/{name}".encode()
    _check(_libc.mount(source, target.encode(), None, _MS_BIND | _MS_REC, None), f"bind {target}")


class _NotVerifiable(Exception):
    pass


def _namespace_pid(pid: int) -> tuple[int, str] | None:
    """(pid inside its innermost PID namespace, state letter) of a process, None if gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return int(fields["NSpid"].split()[-1]), fields["State"].strip()[:1]


def _compare(root: int, expected: set[int]) -> str:
    """ "" when the tree under `root` is the one recorded (every process back, stopped)."""
    # CRIU queues SIGSTOP to each task while it still holds it under ptrace (stopped just past
    # its sigreturn), then detaches: the task takes the stop on its way back to user space,
    # before any instruction of the job, but /proc may show it running for that moment.
    deadline = time.monotonic() + _STOP_WAIT_S
    while True:
        found: dict[int, str] = {}
        for pid in proctree.tree(root):
            seen = _namespace_pid(pid)
            if seen is not None:
                found[seen[0]] = seen[1]
        if all(state in _STOPPED for state in found.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    missing = sorted(expected - set(found))
    extra = sorted(set(found) - expected)
    running = sorted(p for p, state in found.items() if state not in _STOPPED)
    if missing:
        return (
            f"{len(missing)} of the {len(expected)} processes the checkpoint records did "
            f"not come back (pids {', '.join(map(str, missing[:5]))} in the job's "
            "namespace)"
        )
    if extra:
        return f"the restore made processes the checkpoint does not record (pids {extra[:5]})"
    if running:
        return f"restored processes were not stopped (pids {running[:5]})"
    return ""


def _end_tree(root: int | None) -> None:
    """SIGKILL and reap everything under this process, until nothing is left."""
    if root is not None:
        try:
            os.kill(root, signal.SIGKILL)  # the job's PID-namespace init: the kernel kills all
        except ProcessLookupError:
            pass
    proctree.kill_descendants()
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _sandboxed(spec: dict[str, Any]) -> dict[str, Any]:
    from stasis.engine.criu import CRIU, Owner
    from stasis.engine.restoring import restore_tree
    from stasis.errors import StasisError

    images = Path(f"/proc/self/fd/{spec['images_fd']}")
    log_dir = Path(f"/proc/self/fd/{spec['log_fd']}")
    try:
        expected = recorded_pids(images)
        remaps = linked_remaps(images)
        sockets = bound_unix_paths(images)
        ghosts = ghost_paths(images)
    except (OSError, ValueError) as e:
        return {
            "ok": False,
            "reason": f"its process tree image is unreadable: {e}",
            "processes": 0,
            "duration_s": 0.0,
        }
    if remaps:
        return {
            "ok": False,
            "processes": len(expected),
            "duration_s": 0.0,
            "reason": f"not verified: it holds {remaps} link-remapped file(s) (deleted files "
            "still linked elsewhere), whose links a restore removes from the "
            "node: verifying would spend them",
        }
    _check(_libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    _enter_namespaces(bool(spec.get("own_mounts")))
    try:
        _shadow(_shadow_plan([*sockets, *ghosts, *spec.get("travelling", ())]))
    except _NotVerifiable as e:
        return {"ok": False, "reason": str(e), "processes": len(expected), "duration_s": 0.0}
    outputs = []
    if spec["image_log"]:
        # The job's output goes to a file of the private /tmp, not to its log on the node.
        outputs.append((spec["image_log"], f"/tmp/.stasis-verify-{secrets.token_hex(4)}.log"))
    owner = Owner(spec["uid"], spec["gid"], spec["groups"])
    root = None
    try:
        try:
            result = restore_tree(
                CRIU(spec["criu"], log_dir),
                images,
                owner,
                outputs,
                spec["log_name"],
                expect=spec["expect"],
                checkpoint=spec["checkpoint"],
                criu_version=spec["criu_version"],
                sandboxed=True,
                own_mounts=bool(spec.get("own_mounts")),
                external_files=spec.get("external_files"),
            )
        except StasisError as e:
            return {"ok": False, "reason": str(e), "processes": len(expected), "duration_s": 0.0}
        except OSError as e:
            return {
                "ok": False,
                "reason": f"the restore failed: {e}",
                "processes": len(expected),
                "duration_s": 0.0,
            }
        root = result.pid
        if "fault_fd" in spec:
            # The outer process is SIGKILLed now (as a verify that timed out is): this init
            # follows by PDEATHSIG, and the kernel takes the whole PID namespace with it.
            os.write(spec["fault_fd"], b"x")
            time.sleep(60)
        problem = _compare(root, expected)
        return {
            "ok": not problem,
            "reason": problem,
            "processes": len(expected),
            "duration_s": round(result.duration_s, 4),
        }
    finally:
        _end_tree(root)


def main() -> None:
    """The sandbox: this process unshares the namespaces and waits; its child, the init of a
    PID namespace of its own, does the work. Everything the restore makes (CRIU, the job's
    tree in its own nested PID namespace) lives in that namespace, so the kernel kills all of
    it when its init ends, however it ends: killed by a fault, or by the parent's death
    (PDEATHSIG) when the daemon gives up on a verify that hangs."""
    os.umask(0o077)
    spec = json.loads(sys.stdin.buffer.read())
    faults.arm(spec.get("faults") or ())
    _lower_priority()
    _check(
        _libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID), "unshare(mount, network, pid)"
    )
    fault = os.pipe() if "verify.sandbox.restored" in faults.armed() else None
    if fault is not None:
        spec["fault_fd"] = fault[1]
    child = os.fork()
    if child == 0:
        try:
            _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
            answer = _sandboxed(spec)
        except Exception as e:  # the caller must get a verdict, whatever happened
            _end_tree(None)
            answer = {
                "ok": False,
                "reason": f"the sandbox failed: {type(e).__name__}: {e}",
                "processes": 0,
                "duration_s": 0.0,
            }
        try:
            os.write(1, (json.dumps(answer) + "\n").encode())
        except OSError:
            pass  # the daemon stopped waiting: everything here ends with this process anyway
        os._exit(0)
    if fault is not None and os.read(fault[0], 1):
        faults.point("verify.sandbox.restored")
    os.waitpid(child, 0)


if __name__ == "__main__":
    main()
