"""A job's node-local files: what it keeps under /tmp, /var/tmp, /dev/shm, /run/user/<uid>, its
$TMPDIR and its $XDG_RUNTIME_DIR, which another node (or this one, after the job removed them
on its way out) does not have. CRIU reopens every file by path and fails half-way on one that is
missing ("Can't open file tmp/hsperfdata_root/2 on restore"); these files travel inside the
checkpoint instead, in one file of its images directory (`ARCHIVE_NAME`), hashed, signed and
encrypted with the images by the store.

    find        the tree's node-local files: regular files it has open or mapped, FIFOs it has
                open, the paths of unix sockets it has bound, its working directories; with
                sizes, for the limit
    too_large   the one line refusing a dump over `node_local_limit`, largest files named
    pack        write them (their directories, owners, modes, mtimes and contents) into the
                images directory, read through /proc/PID/fd/N and /proc/PID/map_files
    travelling  the paths a checkpoint carries, from its manifest (`MANIFEST_KEY`)
    recreate    before CRIU restores: what is missing is created again, a file of the job's own
                that differs is replaced (the rule below), anything else refuses in one line

What travels: files the job's user owns (all of them for root's jobs), regular and not deleted
(CRIU keeps deleted ones itself, as ghost files), on a local filesystem (FUSE is skipped: its
server is the user's, and root would wait on it). The job's log (the tree root's stdout and
stderr) never travels: a restore re-points it.

Root writes inside directories users control, so nothing here follows a link: directories are
walked component by component with openat(O_NOFOLLOW|O_DIRECTORY), files created with
O_CREAT|O_EXCL|O_NOFOLLOW and their owner, mode and times set on the open descriptor; a symbolic
link anywhere on a path refuses the restore. Contents are read through the job's own descriptors
and mappings, never by path.

The rule for a file that exists on the restoring node:

    same size, mode, owner and mtime    kept as it is
    differs, the job had it open for    replaced by the checkpoint's copy when it is a regular
    writing (or mapped it shared and    file the job's user owns, with one link, that no live
    writable)                           process has open or mapped; else the restore refuses,
                                        naming it
    differs, the job only read it or    left alone: the restore's file facts decide (engine/
    only appended to it                 nodefacts.py: a changed input refuses, a log goes on)
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stasis.engine import privatetmp, proctree
from stasis.fdio import create_new, descend, write_all

ARCHIVE_NAME = "stasis-node-local.img"
# In a checkpoint's manifest (`extra`, signed): the paths that travel, so that a restore's file
# facts know before anything is fetched which missing files it recreates.
MANIFEST_KEY = "node_local"

_MAGIC = b"STASIS-NODE-LOCAL-1\n"
_TRAILER = len(_MAGIC) + 8
_MAX_INDEX_BYTES = 16 << 20
_MAX_ENTRIES = 100_000
_MAX_PATH = 4096
_MAX_ENVIRON = 1 << 20
_CHUNK = 1 << 20

FIXED_ROOTS = ("/tmp", "/var/tmp", "/dev/shm")
# Where no $TMPDIR may point: the system's own files, or home directories (shared between the
# nodes of a site), would "travel" (and be compared, and perhaps replaced) as if they were the
# job's scratch files.
_SYSTEM = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc",
    "/boot",
    "/proc",
    "/sys",
    "/dev",
    "/home",
    "/root",
)
# Top-level directories whose whole tree is not scratch space (below them, it may be).
_NOT_SCRATCH = frozenset(
    ("/var", "/run", "/opt", "/srv", "/mnt", "/media", "/snap", "/nix", "/run/user")
)
_FUSE_PREFIX = "fuse"
_O_ACCMODE = 0o3

Kind = Literal["dir", "file", "fifo", "socket"]


class NodeLocalError(Exception):
    """A node-local file cannot be carried or recreated; the message is one line."""


@dataclass
class Found:
    """One node-local path of the tree: where to read it (`source`, a /proc link to the job's
    own descriptor or mapping), what it was. A "dir" is a process's working directory."""

    path: str
    kind: Kind
    source: str
    dev: int
    ino: int
    uid: int
    gid: int
    mode: int
    size_bytes: int
    mtime_ns: int
    written: bool = False  # open for writing, or mapped shared and writable

    @classmethod
    def of(
        cls,
        path: str,
        kind: Kind,
        source: str,
        st: os.stat_result,
        size_bytes: int = 0,
        mtime_ns: int = 0,
        written: bool = False,
    ) -> Found:
        """`path` as `source`'s stat result `st` says it is."""
        return cls(
            path,
            kind,
            source,
            st.st_dev,
            st.st_ino,
            st.st_uid,
            st.st_gid,
            stat.S_IMODE(st.st_mode),
            size_bytes,
            mtime_ns,
            written,
        )


@dataclass
class Entry:
    """One path of an archive: a directory on the way, a file (with `size_bytes` of contents
    at `offset`), a FIFO, or a unix socket's address (only its directories are made)."""

    path: str
    kind: Kind
    uid: int
    gid: int
    mode: int
    mtime_ns: int = 0
    size_bytes: int = 0
    offset: int = 0
    written: bool = False


@dataclass
class Packed:
    """What `pack` wrote: the paths that travel and the bytes of their contents."""

    paths: list[str] = field(default_factory=list)
    size_bytes: int = 0

    def manifest_entry(self) -> dict[str, Any]:
        return {"paths": self.paths, "size_bytes": self.size_bytes}


# -- finding -----------------------------------------------------------------------------------


def roots(pid: int, uid: int) -> list[str]:
    """The node-local roots of the tree under `pid` (its owner `uid`): the fixed ones, the
    user's runtime directory, and its root process's $TMPDIR and $XDG_RUNTIME_DIR where they
    are sane absolute paths (only ever compared as prefixes: never opened)."""
    found = [*FIXED_ROOTS, f"/run/user/{uid}"]
    env = _environ(pid)
    for name in ("TMPDIR", "XDG_RUNTIME_DIR"):
        value = env.get(name)
        if value is not None and _sane_root(value) and value not in found:
            found.append(value)
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read(_MAX_ENVIRON)
    except OSError:
        return {}
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out.setdefault(key.decode(errors="replace"), value.decode(errors="replace"))
    return out


def _sane_root(path: str) -> bool:
    """Whether a $TMPDIR-like value may name node-local files: absolute, normal, and not the
    system's directories (the user's whole home, /usr...): those are not scratch space."""
    if (
        not path.startswith("/")
        or len(path) > _MAX_PATH
        or "\0" in path
        or path == "/"
        or os.path.normpath(path) != path
        or path.startswith("//")
    ):
        return False
    if path == "/dev/shm" or path.startswith("/dev/shm/"):
        return True
    if path in _NOT_SCRATCH:
        return False
    return not any(path == s or path.startswith(s + "/") for s in _SYSTEM)


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path.startswith(p + "/") for p in prefixes)


def _followed(link: str) -> tuple[str, os.stat_result] | None:
    """Where a /proc link points and what is there; None once it is gone."""
    try:
        return os.readlink(link), os.stat(link)
    except OSError:
        return None


def _kept_path(target: str, prefixes: Iterable[str]) -> bool:
    """Whether a link's target names a path under `prefixes` that is still there."""
    return target.startswith("/") and not target.endswith(" (deleted)") and _under(target, prefixes)


def find(pid: int, uid: int, prefixes: list[str] | None = None) -> list[Found]:
    """The node-local files of the tree under `pid` whose owner is `uid` (root: everyone's),
    one per path, sorted; under `prefixes` (default: `roots`)."""
    prefixes = roots(pid, uid) if prefixes is None else prefixes
    skip = proctree.outputs(pid)  # the job's log: re-pointed by a restore
    found: dict[str, Found] = {}
    for p in proctree.tree(pid):
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue  # it ended meanwhile
        sockets: dict[int, str] | None = None
        for fd in fds:
            link = f"/proc/{p}/fd/{fd}"
            followed = _followed(link)
            if followed is None:
                continue
            target, st = followed
            if (st.st_dev, st.st_ino) in skip:
                continue
            if stat.S_ISSOCK(st.st_mode):
                if sockets is None:
                    sockets = _unix_paths(p)
                path = sockets.get(st.st_ino)
                if path and _under(path, prefixes) and path not in found:
                    found[path] = Found.of(path, "socket", link, st)
                continue
            if not _kept_path(target, prefixes) or st.st_nlink == 0:
                continue
            kind: Kind
            if stat.S_ISREG(st.st_mode):
                kind = "file"
            elif stat.S_ISFIFO(st.st_mode):
                kind = "fifo"
            else:
                continue
            _add(
                found,
                Found.of(
                    target,
                    kind,
                    link,
                    st,
                    st.st_size if kind == "file" else 0,
                    st.st_mtime_ns,
                    _writable(p, fd),
                ),
            )
        _add_mappings(found, p, prefixes, skip)
        _add_cwd(found, p, prefixes)
    skipped = _skipped_devices(pid)
    # A job container's /tmp travels whole, its closed files too (engine/boundtmp.py).
    whole = privatetmp.bound_from_node(pid)
    return [
        f
        for _, f in sorted(found.items())
        if (uid == 0 or f.uid == uid) and f.dev not in skipped and not _under(f.path, whole)
    ]


def _add(found: dict[str, Found], entry: Found) -> None:
    seen = found.get(entry.path)
    if seen is None:
        found[entry.path] = entry
    elif entry.written and not seen.written:
        seen.written = True


def _add_cwd(found: dict[str, Found], pid: int, prefixes: list[str]) -> None:
    """A working directory under a node-local root: CRIU needs it there to restore."""
    followed = _followed(f"/proc/{pid}/cwd")
    if followed is None:
        return
    target, st = followed
    if _kept_path(target, prefixes) and stat.S_ISDIR(st.st_mode):
        found.setdefault(target, Found.of(target, "dir", "", st))


def _add_mappings(
    found: dict[str, Found], pid: int, prefixes: list[str], skip: set[tuple[int, int]]
) -> None:
    perms: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=2)
                if len(parts) >= 2:
                    perms[parts[0]] = parts[1]
        names = os.listdir(f"/proc/{pid}/map_files")
    except OSError:
        return
    for name in names:
        link = f"/proc/{pid}/map_files/{name}"
        followed = _followed(link)
        if followed is None:
            continue
        target, st = followed
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_nlink == 0
            or not _kept_path(target, prefixes)
            or (st.st_dev, st.st_ino) in skip
        ):
            continue
        p = perms.get(name, "")
        _add(
            found,
            Found.of(
                target,
                "file",
                link,
                st,
                st.st_size,
                st.st_mtime_ns,
                written=p[1:2] == "w" and p[3:4] == "s",
            ),
        )


def _writable(pid: int, fd: str) -> bool:
    try:
        for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "flags":
                return int(value.strip(), 8) & _O_ACCMODE != 0
    except (OSError, ValueError):
        pass
    return False


def _unix_paths(pid: int) -> dict[int, str]:
    """Socket inode -> the path it is bound to, in `pid`'s network namespace."""
    out: dict[int, str] = {}
    try:
        with open(f"/proc/{pid}/net/unix") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                # Num RefCount Protocol Flags Type St Inode [Path]; '@': abstract, no file.
                if len(parts) >= 8 and parts[7].startswith("/"):
                    out[int(parts[6])] = parts[7]
    except (OSError, ValueError):
        pass
    return out


def _skipped_devices(pid: int) -> set[int]:
    """Devices whose files do not travel this way: FUSE mounts (their files are the user's
    server's to answer, root would wait on it) and a private /tmp's tmpfs (CRIU carries it
    with the job's mount namespace: engine/privatetmp.py)."""
    out = set()
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fstype, _, rest = right.partition(" ")
                if fstype.startswith(_FUSE_PREFIX) or rest.split(" ", 1)[0] == privatetmp.SOURCE:
                    major, _, minor = left.split()[2].partition(":")
                    out.add(os.makedev(int(major), int(minor)))
    except (OSError, ValueError, IndexError):
        pass
    return out


def total_bytes(found: Iterable[Found]) -> int:
    return sum(f.size_bytes for f in found if f.kind == "file")


def too_large(found: list[Found], limit: int) -> str | None:
    """Why the tree's node-local files cannot travel (over `limit` bytes), or None."""
    total = total_bytes(found)
    if total <= limit:
        return None
    largest = sorted((f for f in found if f.kind == "file"), key=lambda f: -f.size_bytes)[:3]
    # The job's own names, said on one line whatever they hold.
    named = ", ".join(
        f"{''.join(c if c.isprintable() else '?' for c in f.path)} ({_size(f.size_bytes)})"
        for f in largest
    )
    return (
        f"its node-local files hold {_size(total)}, over node_local_limit "
        f"({_size(limit)}), largest {named}; move them out of /tmp, /var/tmp, /dev/shm and "
        "$TMPDIR (to a directory every node shares), or raise node_local_limit"
    )


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


# -- packing -----------------------------------------------------------------------------------


def pack(found: list[Found], prefixes: list[str], images: Path, limit: int) -> Packed:
    """Write the archive of `found` (under `prefixes`) into `images` (nothing when there is
    nothing to carry).
    NodeLocalError when the contents grew over `limit` meanwhile, or a file cannot be read."""
    if not found:
        return Packed()
    entries: list[Entry] = []
    dirs: dict[str, Entry] = {}
    for f in found:
        for d in _parents(f.path) + ([f.path] if f.kind == "dir" else []):
            if d not in dirs:
                dirs[d] = _dir_entry(d)
    entries.extend(dirs[d] for d in sorted(dirs, key=lambda d: (d.count("/"), d)))
    fd = os.open(
        images / ARCHIVE_NAME,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
        0o600,
    )
    packed = Packed()
    try:
        offset = 0
        for f in found:
            if f.kind == "dir":
                continue  # made with the others above
            entry = Entry(f.path, f.kind, f.uid, f.gid, f.mode, f.mtime_ns, written=f.written)
            if f.kind == "file":
                entry.offset = offset
                entry.size_bytes = _copy(f, fd, limit - offset)
                offset += entry.size_bytes
            entries.append(entry)
            packed.paths.append(f.path)
        index = json.dumps({"roots": prefixes, "entries": [e.__dict__ for e in entries]}).encode()
        write_all(fd, index)
        write_all(fd, len(index).to_bytes(8, "big") + _MAGIC)
        os.fsync(fd)
        packed.size_bytes = offset
    finally:
        os.close(fd)
    return packed


def _parents(path: str) -> list[str]:
    parts = path.split("/")[1:-1]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _dir_entry(path: str) -> Entry:
    st = _lstat_walk(path)
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise NodeLocalError(f"{path} is no longer a directory (a symbolic link, or gone)")
    return Entry(path, "dir", st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))


def _lstat_walk(path: str) -> os.stat_result | None:
    """`path`'s status, reached without following any link (None: a link on the way)."""
    try:
        fd = _walk(path, create=None)
    except (OSError, NodeLocalError):
        return None
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def _copy(f: Found, out: int, room: int) -> int:
    """Copy `f`'s contents through the job's own descriptor or mapping; its bytes."""
    try:
        src = os.open(f.source, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as e:
        raise NodeLocalError(f"cannot read {f.path}: {e.strerror}") from e
    try:
        st = os.fstat(src)
        if (st.st_dev, st.st_ino) != (f.dev, f.ino) or not stat.S_ISREG(st.st_mode):
            raise NodeLocalError(f"{f.path} changed while it was read")
        size = st.st_size
        if size > room:
            raise NodeLocalError(f"{f.path} grew to {_size(size)}: over node_local_limit")
        done = 0
        while done < size:
            data = os.pread(src, min(_CHUNK, size - done), done)
            if not data:
                raise NodeLocalError(f"{f.path} shrank while it was read")
            write_all(out, data)
            done += len(data)
        f.size_bytes = size
        return size
    finally:
        os.close(src)


def travelling(extra: Mapping[str, Any]) -> list[str]:
    """The paths a checkpoint's manifest (its signed `extra`) says travel with it."""
    entry = extra.get(MANIFEST_KEY)
    if not isinstance(entry, dict):
        return []
    paths = entry.get("paths")
    return [p for p in paths if isinstance(p, str)] if isinstance(paths, list) else []


# -- reading an archive back -------------------------------------------------------------------


def read_index(archive: Path) -> list[Entry]:
    """The entries of `archive`, checked (NodeLocalError): bounded sizes, absolute normal paths,
    every file's contents inside the archive. Written by root and hashed in a signed manifest,
    but parsed as if it were not."""
    try:
        fd = os.open(archive, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise NodeLocalError(f"cannot open {archive.name}: {e.strerror}") from e
    try:
        size = os.fstat(fd).st_size
        if size < _TRAILER:
            raise NodeLocalError(f"{archive.name} is truncated")
        tail = os.pread(fd, _TRAILER, size - _TRAILER)
        if tail[8:] != _MAGIC:
            raise NodeLocalError(f"{archive.name} is not an archive of node-local files")
        n = int.from_bytes(tail[:8], "big")
        blobs = size - _TRAILER - n
        if n > _MAX_INDEX_BYTES or blobs < 0:
            raise NodeLocalError(f"{archive.name} has a bad index size")
        raw = os.pread(fd, n, blobs)
    finally:
        os.close(fd)
    try:
        document = json.loads(raw)
        items, prefixes = document["entries"], document["roots"]
        if not isinstance(items, list) or len(items) > _MAX_ENTRIES:
            raise ValueError("entries")
        if not isinstance(prefixes, list) or not all(
            isinstance(r, str) and _allowed_root(r) for r in prefixes
        ):
            raise ValueError("roots")
        entries = [_entry(item, blobs) for item in items]
        for entry in entries:
            if entry.kind != "dir" and not _under(entry.path, prefixes):
                raise ValueError(f"{entry.path[:200]} is not under a node-local directory")
    except (ValueError, KeyError, TypeError) as e:
        raise NodeLocalError(f"{archive.name} has a malformed index ({e})") from e
    return entries


def _allowed_root(path: str) -> bool:
    return (
        path in FIXED_ROOTS
        or re.fullmatch(r"/run/user/[0-9]{1,10}", path) is not None
        or _sane_root(path)
    )


def _entry(item: Any, blobs: int) -> Entry:
    if not isinstance(item, dict):
        raise ValueError("an entry is not an object")
    e = Entry(
        path=item["path"],
        kind=item["kind"],
        uid=item["uid"],
        gid=item["gid"],
        mode=item["mode"],
        mtime_ns=item.get("mtime_ns", 0),
        size_bytes=item.get("size_bytes", 0),
        offset=item.get("offset", 0),
        written=item.get("written", False),
    )
    if (
        not isinstance(e.path, str)
        or not e.path.startswith("/")
        or e.path == "/"
        or len(e.path) > _MAX_PATH
        or "\0" in e.path
        or os.path.normpath(e.path) != e.path
        or e.path.startswith("//")
    ):
        raise ValueError(f"bad path {str(e.path)[:80]!r}")
    if e.kind not in ("dir", "file", "fifo", "socket"):
        raise ValueError(f"bad kind for {e.path}")
    for name in ("uid", "gid", "mode", "mtime_ns", "size_bytes", "offset"):
        value = getattr(e, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"bad {name} for {e.path}")
    if e.uid >= 1 << 32 or e.gid >= 1 << 32 or e.mode > 0o7777 or e.offset + e.size_bytes > blobs:
        raise ValueError(f"bad owner, mode or extent for {e.path}")
    if not isinstance(e.written, bool):
        raise ValueError(f"bad written for {e.path}")
    return e


# -- recreating --------------------------------------------------------------------------------


@dataclass
class _Plan:
    dirs: list[Entry] = field(default_factory=list)
    files: list[Entry] = field(default_factory=list)  # missing: created
    replace: list[Entry] = field(default_factory=list)  # the job's own, differing: replaced
    fifos: list[Entry] = field(default_factory=list)


class Recreation:
    """What a restore makes of a checkpoint's archive on this node (`prepare`), and `apply`."""

    def __init__(self, archive: Path, entries: list[Entry], plan: _Plan) -> None:
        self.archive = archive
        self.entries = entries
        self.plan = plan
        # Every path the checkpoint carries (nodefacts: missing ones are made, not refused).
        self.paths = [e.path for e in entries if e.kind != "dir"]

    def apply(self) -> list[str]:
        """Make it so; notes for the restore's answer. NodeLocalError (one line) if the node
        changed under it since `prepare`."""
        plan = self.plan
        try:
            made = _apply(plan, self.archive, self.entries)
        except OSError as e:
            raise NodeLocalError(
                f"cannot recreate {e.filename or 'a node-local file'}: " f"{e.strerror}"
            ) from e
        notes = []
        if made or plan.dirs:
            notes.append(
                f"recreated {made} node-local file(s) and {len(plan.dirs)} "
                "directory(ies) from the checkpoint"
            )
        notes.extend(
            f"{e.path} differed and was replaced by the checkpoint's copy (the job's "
            "own file, open by nobody)"
            for e in plan.replace
        )
        return notes


def prepare(archive: Path, job_uid: int) -> Recreation | None:
    """What of `archive` this node lacks, decided before anything is written (as root, from a
    single-threaded process): NodeLocalError, one line, for a path that a symbolic link or
    something else than what the job had stands in the way of, or a differing file that is
    not the job's own to replace (the rule in the module's docstring). None when the
    checkpoint carries nothing."""
    if not os.path.lexists(archive):
        return None
    entries = read_index(archive)
    return Recreation(archive, entries, _plan(entries, job_uid))


def recreate(archive: Path, job_uid: int) -> list[str]:
    """`prepare` and `apply` at once."""
    made = prepare(archive, job_uid)
    return made.apply() if made is not None else []


def _apply(plan: _Plan, archive: Path, entries: list[Entry]) -> int:
    for d in plan.dirs:
        os.close(_walk(d.path, create=_by_path(entries)))
    made = 0
    fd = os.open(archive, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        for e in plan.files:
            _make_file(e, fd, _by_path(entries), replace=False)
            made += 1
        for e in plan.replace:
            _make_file(e, fd, _by_path(entries), replace=True)
    finally:
        os.close(fd)
    for e in plan.fifos:
        _make_fifo(e, _by_path(entries))
    return made + len(plan.fifos)


def _by_path(entries: list[Entry]) -> dict[str, Entry]:
    return {e.path: e for e in entries if e.kind == "dir"}


def _plan(entries: list[Entry], job_uid: int) -> _Plan:
    plan = _Plan()
    dirs = _by_path(entries)
    for e in entries:
        if e.kind == "dir":
            st = _probe(e.path, dirs)
            if st is None:
                plan.dirs.append(e)
            elif not stat.S_ISDIR(st.st_mode):
                raise NodeLocalError(
                    f"{e.path} is not a directory now (the job had a "
                    "directory there): move it away"
                )
            elif st.st_uid != e.uid:
                # Made by someone else before the restore (a name in /tmp taken first): what
                # is recreated inside would be theirs to swap for something else.
                raise NodeLocalError(
                    f"{e.path} belongs to uid {st.st_uid} now, the job's "
                    f"directory there belonged to uid {e.uid}: move it away"
                )
            continue
        if e.kind == "socket":
            continue  # CRIU binds it; its directories are made above
        st = _probe(e.path, dirs)
        if st is None:
            (plan.files if e.kind == "file" else plan.fifos).append(e)
        elif e.kind == "fifo":
            if not stat.S_ISFIFO(st.st_mode):
                raise NodeLocalError(
                    f"{e.path} is not a FIFO now (the job had one there): " "move it away"
                )
        elif not _same(e, st):
            why = _why_not_replaced(e, st, job_uid)
            if why is None:
                plan.replace.append(e)
            elif why:
                raise NodeLocalError(why)
    return plan


def _same(e: Entry, st: os.stat_result) -> bool:
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_size == e.size_bytes
        and stat.S_IMODE(st.st_mode) == e.mode
        and st.st_mtime_ns == e.mtime_ns
        and st.st_uid == e.uid
        and st.st_gid == e.gid
    )


def _why_not_replaced(e: Entry, st: os.stat_result, job_uid: int) -> str | None:
    """None: the checkpoint's copy replaces the file there; "": it stays (the restore's file
    facts judge it); else the one line refusing the restore."""
    if not e.written:
        return ""  # an input or a log: nodefacts compares it as before
    mine = job_uid == 0 or (st.st_uid == job_uid and e.uid == job_uid)
    if not stat.S_ISREG(st.st_mode):
        return f"{e.path} is not a regular file now (the job had one there): move it away"
    if not mine:
        return (
            f"{e.path} differs from the checkpoint's copy and is not the job's own "
            f"(owner uid {st.st_uid}): move it away to have the checkpoint's copy restored"
        )
    if st.st_nlink != 1:
        return (
            f"{e.path} differs from the checkpoint's copy and has other links: move it "
            "away to have the checkpoint's copy restored"
        )
    user = _in_use(st.st_dev, st.st_ino)
    if user is not None:
        return (
            f"{e.path} differs from the checkpoint's copy and process {user} has it open: "
            "end that process (another copy of the job?) or move the file away"
        )
    return None


def _in_use(dev: int, ino: int) -> int | None:
    """A live process that has the file open or mapped, if any."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        for sub in ("fd", "map_files"):
            try:
                links = os.listdir(f"/proc/{name}/{sub}")
            except OSError:
                continue
            for link in links:
                try:
                    st = os.stat(f"/proc/{name}/{sub}/{link}")
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) == (dev, ino):
                    return int(name)
    return None


def _probe(path: str, dirs: Mapping[str, Entry]) -> os.stat_result | None:
    """`path` as it is now, reached without following a link: None when it (or a directory on
    the way) is missing; NodeLocalError for a link or a non-directory on the way."""
    parent, _, name = path.rpartition("/")
    try:
        fd = _walk(parent or "/", create=None)
    except FileNotFoundError:
        return None
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)
    if stat.S_ISLNK(st.st_mode):
        raise NodeLocalError(
            f"{path} is a symbolic link now (the job had a "
            f"{dirs[path].kind if path in dirs else 'file'} there): remove it"
        )
    return st


def _walk(path: str, create: Mapping[str, Entry] | None) -> int:
    """An O_DIRECTORY descriptor of `path`, reached from / one component at a time, never
    through a link (NodeLocalError naming it). `create`: make missing directories as these
    entries say (owner, mode); None: FileNotFoundError for a missing one."""

    def step(fd: int, sofar: str) -> int:
        part = sofar.rpartition("/")[2]
        try:
            return os.open(
                part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
        except FileNotFoundError:
            if create is None or sofar not in create:
                raise
            return _make_dir(fd, part, create[sofar])
        except OSError as e:
            if _is_link(fd, part):
                raise NodeLocalError(
                    f"{sofar} is a symbolic link now (the job had a " "directory there): remove it"
                ) from e
            raise NodeLocalError(
                f"{sofar} is not a directory now (the job had one "
                f"there): move it away ({e.strerror})"
            ) from e

    parts = [part for part in path.split("/")[1:] if part]
    # Each step's path so far ("/a", "/a/b"...): what `create` and the refusals name.
    paths = ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]
    return descend(os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), paths, step)


def _is_link(dirfd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _make_dir(parent: int, name: str, e: Entry) -> int:
    os.mkdir(name, 0o700, dir_fd=parent)
    # Opened without following: a link put there since mkdir fails here.
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        os.fchown(fd, e.uid, e.gid)
        os.fchmod(fd, e.mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_file(e: Entry, archive: int, dirs: Mapping[str, Entry], replace: bool) -> None:
    parent, _, name = e.path.rpartition("/")
    dfd = _walk(parent or "/", create=dirs)
    try:
        # Replaced through a new name and a rename: whatever that name is now (a link to
        # another file), only the directory entry changes.
        tmp = f".{name[:200]}.stasis-{os.urandom(6).hex()}" if replace else name
        fd = create_new(tmp, dfd)
        try:
            done = 0
            while done < e.size_bytes:
                data = os.pread(archive, min(_CHUNK, e.size_bytes - done), e.offset + done)
                if not data:
                    raise NodeLocalError(f"the checkpoint's copy of {e.path} is truncated")
                write_all(fd, data)
                done += len(data)
            os.fchown(fd, e.uid, e.gid)
            os.fchmod(fd, e.mode & 0o1777)  # never setuid or setgid
            os.utime(fd, ns=(e.mtime_ns, e.mtime_ns))
        finally:
            os.close(fd)
        if replace:
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def _make_fifo(e: Entry, dirs: Mapping[str, Entry]) -> None:
    parent, _, name = e.path.rpartition("/")
    dfd = _walk(parent or "/", create=dirs)
    try:
        os.mkfifo(name, 0o600, dir_fd=dfd)
        # O_RDWR does not wait for a peer; O_NOFOLLOW: what we made, not a link put there.
        fd = os.open(name, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                raise NodeLocalError(f"{e.path} was replaced while it was made")
            os.fchown(fd, e.uid, e.gid)
            os.fchmod(fd, e.mode & 0o1777)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


class AtDump:
    """Carries a tree's node-local files into a dump's images (`collect`), at the point the
    tree stands frozen or stopped as its images record it: at CRIU's post-dump for a dump that
    leaves it running, once CRIU left it stopped for one that stops it."""

    def __init__(self, pid: int, uid: int, images: Path, limit: int) -> None:
        self.pid = pid
        self.uid = uid
        self.images = images
        self.limit = limit
        self.packed = Packed()
        self.refused: str | None = None  # why they cannot travel (the dump is refused)

    def collect(self) -> bool:
        try:
            prefixes = roots(self.pid, self.uid)
            found = find(self.pid, self.uid, prefixes)
            why = too_large(found, self.limit)
            if why is None:
                self.packed = pack(found, prefixes, self.images, self.limit)
                return True
        except NodeLocalError as e:
            why = f"its node-local files cannot be carried: {e}"
        except OSError as e:
            why = f"its node-local files cannot be read ({e})"
        self.refused = why
        return False
