"""A container's writable layer: what it wrote into its own filesystem, captured with its
checkpoint (a tar of the overlay's upper directory, whiteouts and opaque directories included)
and put back into the new container's root before CRIU restores it.

The new root is the tenant's: its image chose every symlink, file and directory in it, and the
layer's bytes came from the tenant's container. So root never chroots into it, never imports
or executes anything from it, and never follows a link in it that could lead out:

- capturing walks the upper directory with directory fds and O_NOFOLLOW (the container is
  frozen meanwhile);
- putting back runs in a child (`python -I -m stasis.k8s.rootfs apply ROOT < diff.tar`: a
  crash or a hang costs this one restore, and the child keeps only the capabilities that
  writing files as their owners needs), which never chroots: every path is resolved by the
  kernel inside the root (`confined.ConfinedRoot`, openat2 RESOLVE_IN_ROOT: a symlink such as
  `/lib -> /usr/lib` resolves inside the container, as in a chroot), the last component is
  never followed, hard links are made to what was opened inside the root, deletions walk with
  directory fds. The whole layer is read and checked before anything is written: a device
  node, a path with `..` or absolute, a hard link out, an over-long name or a truncated tar
  is refused in one line and the root is left as the image made it.

Kept as they were: owners, modes (setuid and setgid bits included: they are the container's
own files, inside its root, as its image could have shipped them) and modification times.
Not kept: extended attributes other than overlay's opaque mark (security.capability too).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from stasis.errors import ContainerError, ContainerRootDamagedError
from stasis.fdio import create_new, write_all
from stasis.k8s import child, confined
from stasis.k8s.confined import ConfinedRoot

DIFF_NAME = "rootfs-diff.tar"
_OPAQUE_XATTR = "trusted.overlay.opaque"
_OPAQUE_PAX = "STASIS.overlay.opaque"

# Bounds on a layer, whatever it claims: a layer is at most this many entries, each name at
# most PATH_MAX, each file's bytes inside the tar's real size (checked before writing).
MAX_ENTRIES = 1_000_000
MAX_DEPTH = 256  # directories open at once while capturing; levels of a name
_CHUNK = 1 << 20
_MAX_ID = (1 << 32) - 2  # (uid_t)-1 means "unchanged" to chown
_MAX_TIME_S = 1 << 40
_REFUSED_EXIT, _FAILED_EXIT = 3, 4
_DO_INSTEAD = (
    "start the container without this checkpoint (another label) or restore an " "older one"
)


class Refused(Exception):
    """The layer holds something that is not put into a container's root; nothing written."""


class PartlyWritten(ContainerRootDamagedError):
    """Putting the layer back failed after it had begun (a write the root did not allow, no
    space, a timeout): the root holds part of it, so another checkpoint's layer put on top
    would not give that checkpoint's filesystem either; the root is best made afresh."""


def upper_dir(rootfs: Path) -> Path | None:
    """The upper directory of the overlay mounted at `rootfs`, None when it is not an overlay."""
    target = str(rootfs)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found: Path | None = None
    for line in lines:
        fields = line.split(" ")
        if len(fields) < 10 or _unescape(fields[4]) != target:
            continue
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3]
        found = None  # the last mount at that point is the one seen
        if fstype == "overlay":
            for opt in options.split(","):
                if opt.startswith("upperdir="):
                    found = Path(_unescape(opt.removeprefix("upperdir=")))
    return found


def _unescape(text: str) -> str:
    return (
        text.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
    )


# -- capture ------------------------------------------------------------------------------


def capture(rootfs: Path, out: Path) -> int:
    """Write the writable layer of the container rooted at `rootfs` to `out`; its size.

    ContainerError when the root is not an overlay (its writable layer cannot be told apart)."""
    upper = upper_dir(rootfs)
    if upper is None:
        raise ContainerError(
            f"the root of the container ({rootfs}) is not an overlay mount: its "
            "writable layer cannot be captured (use the overlayfs snapshotter)"
        )
    try:
        top = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
                _capture_dir(tar, top)
        finally:
            os.close(top)
    except (OSError, ValueError, tarfile.TarError) as e:
        raise ContainerError(f"cannot capture the writable layer of the container: {e}") from e
    return out.stat().st_size


def _capture_dir(tar: tarfile.TarFile, top: int) -> None:
    """Depth first, parents before their entries, names sorted; every entry looked at through
    its directory's fd without following it (the container wrote these names)."""
    links: dict[tuple[int, int], str] = {}
    # Each directory's names sorted backwards, taken from the end.
    stack: list[tuple[int, str, list[str]]] = [
        (os.dup(top), "", sorted(os.listdir(top), reverse=True))
    ]
    try:
        while stack:
            dirfd, prefix, names = stack[-1]
            if not names:
                os.close(dirfd)
                stack.pop()
                continue
            name = names.pop()
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            info = _info(prefix + name, st)
            if stat.S_ISDIR(st.st_mode):
                if len(stack) >= MAX_DEPTH:
                    raise ValueError(f"{prefix + name} is more than {MAX_DEPTH} directories deep")
                sub = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd
                )
                try:
                    if _opaque(sub):
                        info.pax_headers = {_OPAQUE_PAX: "y"}
                    tar.addfile(info)
                    stack.append((sub, f"{prefix}{name}/", sorted(os.listdir(sub), reverse=True)))
                except BaseException:
                    os.close(sub)
                    raise
            elif stat.S_ISREG(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in links:
                    info.type, info.linkname, info.size = tarfile.LNKTYPE, links[key], 0
                    tar.addfile(info)
                    continue
                if st.st_nlink > 1:
                    links[key] = info.name
                fd = os.open(
                    name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd
                )
                with os.fdopen(fd, "rb") as f:
                    if os.fstat(f.fileno()).st_ino != st.st_ino:
                        raise ValueError(f"{info.name} changed while it was read")
                    tar.addfile(info, f)
            elif stat.S_ISLNK(st.st_mode):
                info.linkname = os.readlink(name, dir_fd=dirfd)
                tar.addfile(info)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISFIFO(st.st_mode):
                tar.addfile(info)  # a whiteout (0:0) among them; put back decides the rest
            # Sockets are not kept (tar has no type for them; nothing listens after a restore).
    finally:
        for dirfd, _, _ in stack:
            os.close(dirfd)


def _info(name: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode, info.uid, info.gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
    info.mtime = st.st_mtime
    mode = st.st_mode
    if stat.S_ISREG(mode):
        info.type, info.size = tarfile.REGTYPE, st.st_size
    elif stat.S_ISDIR(mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(mode):
        info.type = tarfile.SYMTYPE
    elif stat.S_ISFIFO(mode):
        info.type = tarfile.FIFOTYPE
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        info.type = tarfile.CHRTYPE if stat.S_ISCHR(mode) else tarfile.BLKTYPE
        info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
    return info


def _opaque(dirfd: int) -> bool:
    try:
        return os.getxattr(dirfd, _OPAQUE_XATTR) == b"y"
    except OSError:
        return False


# -- put back -----------------------------------------------------------------------------


def apply(diff: Path, rootfs: Path, timeout_s: float = 300.0) -> None:
    """Put the layer captured in `diff` into the container root `rootfs` (in a child that
    never chroots; see the module's docstring). ContainerError, one line, when it cannot."""
    what = "cannot put back the writable layer of the container"
    try:
        with diff.open("rb") as f:
            r = child.run_module("stasis.k8s.rootfs", ["apply", str(rootfs)], timeout_s, f)
    except subprocess.TimeoutExpired as e:
        raise PartlyWritten(
            f"{what}: it took more than {timeout_s:.0f} s (the root may hold "
            f"part of it); {_DO_INSTEAD}"
        ) from e
    except OSError as e:
        raise ContainerError(f"{what}: {e}") from e
    if r.returncode == 0:
        return
    line = child.last_line(r)
    if r.returncode == _REFUSED_EXIT:
        raise ContainerError(f"{what}: {line}; nothing was written; {_DO_INSTEAD}")
    raise PartlyWritten(f"{what}: {line}; {_DO_INSTEAD}")


@dataclass(frozen=True)
class Entry:
    """One checked tar entry: what to do at `parts` inside the root."""

    parts: tuple[str, ...]
    kind: str  # file, dir, symlink, hardlink, fifo, whiteout
    mode: int = 0
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    opaque: bool = False
    target: str = ""  # a symlink's contents
    link: tuple[str, ...] = ()  # a hard link's target


def check(member: tarfile.TarInfo, end: int) -> Entry | None:
    """`member` as an Entry, None for the root's own `.`; Refused (naming it and why) for what
    is never put into a root. `end`: the tar's real size, which its data must fit in."""
    shown = repr(member.name[:200])
    try:
        parts = confined.split(member.name)
    except ValueError as e:
        raise Refused(f"entry {shown} has {e}") from None
    if len(parts) > MAX_DEPTH:
        raise Refused(f"entry {shown} is more than {MAX_DEPTH} directories deep")
    if not parts:
        if member.isdir():
            return None  # the root's own entry: its owner and mode stay the image's
        raise Refused(f"entry {shown} names the root itself")
    for value, name in ((member.uid, "owner"), (member.gid, "group")):
        if not isinstance(value, int) or not 0 <= value <= _MAX_ID:
            raise Refused(f"entry {shown} has an impossible {name} {value!r}")
    if not isinstance(member.mtime, (int, float)) or not abs(member.mtime) < _MAX_TIME_S:
        raise Refused(f"entry {shown} has an impossible modification time")
    common = Entry(
        parts=parts,
        kind="",
        mode=member.mode & 0o7777,
        uid=member.uid,
        gid=member.gid,
        mtime_ns=int(member.mtime * 1_000_000_000),
    )
    if member.issparse():
        raise Refused(f"entry {shown} is a sparse file (a layer holds plain files)")
    if member.isreg():
        if member.size < 0 or member.offset_data + member.size > end:
            raise Refused(f"entry {shown} claims {member.size} bytes past the end of the tar")
        return replace(common, kind="file")
    if member.isdir():
        return replace(common, kind="dir", opaque=member.pax_headers.get(_OPAQUE_PAX) == "y")
    if member.issym():
        target = member.linkname
        if not target or "\x00" in target or len(os.fsencode(target)) > confined.PATH_MAX:
            raise Refused(f"symlink {shown} has an empty, NUL-holding or over-long target")
        # Never followed by this code; inside the container it means what it says there.
        return replace(common, kind="symlink", target=target)
    if member.islnk():
        try:
            link = confined.split(member.linkname)
        except ValueError as e:
            raise Refused(
                f"hard link {shown} -> {member.linkname[:200]!r} points out of the " f"root ({e})"
            ) from None
        if not link or link == parts:
            raise Refused(f"hard link {shown} points at the root or at itself")
        return replace(common, kind="hardlink", link=link)
    if member.ischr() and member.devmajor == 0 and member.devminor == 0:
        return replace(common, kind="whiteout")
    if member.isfifo():
        # A named pipe gives no access to anything; setuid bits on one mean nothing.
        return replace(common, kind="fifo", mode=member.mode & 0o777)
    if member.ischr() or member.isblk():
        kind = "character" if member.ischr() else "block"
        raise Refused(
            f"entry {shown} is a {kind} device node ({member.devmajor}:"
            f"{member.devminor}): a container's writable layer never gets device "
            "nodes put back (its runtime makes /dev)"
        )
    raise Refused(
        f"entry {shown} is of tar type {member.type!r}, which a writable layer " "does not hold"
    )


class Layer:
    """A tar read as a writable layer: `scan()` checks every entry without writing anything;
    `apply(root)` then reads it again and writes it."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        f.seek(0, os.SEEK_END)
        self.size = f.tell()

    def _walk(self) -> Iterator[tuple[Entry, tarfile.TarFile, tarfile.TarInfo]]:
        self.f.seek(0)
        try:
            tar = tarfile.open(
                fileobj=self.f, mode="r:", encoding="utf-8", errors="surrogateescape"
            )
        except Exception as e:  # whatever the bytes make tarfile raise: not a layer
            raise Refused(f"the layer is not a readable tar ({child.short(e)})") from None
        count = 0
        while True:
            try:
                member = tar.next()
            except Exception as e:
                raise Refused(
                    f"the layer is not a readable tar after {count} entries " f"({child.short(e)})"
                ) from None
            # Nothing keeps the members read so far: a million entries cost one at a time.
            tar.members.clear()  # type: ignore[attr-defined]  # (typeshed lacks it)
            if member is None:
                return
            count += 1
            if count > MAX_ENTRIES:
                raise Refused(f"the layer has more than {MAX_ENTRIES} entries")
            entry = check(member, self.size)
            if entry is not None:
                yield entry, tar, member

    def scan(self) -> int:
        """Every entry checked, nothing written; how many there are."""
        return sum(1 for _ in self._walk())

    def apply(self, root: ConfinedRoot) -> None:
        dirs: list[tuple[tuple[str, ...], int]] = []
        for entry, tar, member in self._walk():
            try:
                _put(root, entry, tar, member)
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"cannot write {'/'.join(entry.parts)[:200]!r} in the "
                    f"root: {e.strerror or e}",
                ) from None
            if entry.kind == "dir":
                dirs.append((entry.parts, entry.mtime_ns))
        # Last: writing their entries changed the directories' times.
        for parts, mtime_ns in dirs:
            try:
                fd = root.open(parts, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError:
                continue  # removed by a later entry
            try:
                os.utime(fd, ns=(mtime_ns, mtime_ns))
            finally:
                os.close(fd)


def _put(root: ConfinedRoot, entry: Entry, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
    name = entry.parts[-1]
    try:
        parent = root.parent(entry.parts, make=entry.kind != "whiteout")
    except (FileNotFoundError, NotADirectoryError):
        if entry.kind == "whiteout":
            return  # nothing there to delete
        raise
    try:
        try:
            st: os.stat_result | None = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if entry.kind == "whiteout":
            _remove(parent, name, st)
            return
        if entry.kind == "dir":
            if st is not None and (entry.opaque or not stat.S_ISDIR(st.st_mode)):
                _remove(parent, name, st)
                st = None
            if st is None:
                os.mkdir(name, 0o700, dir_fd=parent)
            _owner_mode_at(parent, name, os.O_DIRECTORY, entry)
            return
        if entry.kind == "hardlink":
            # Opened inside the root, the link itself if it is one: linked is what was opened.
            target = root.open(entry.link, os.O_PATH | os.O_NOFOLLOW)
            try:
                tst = os.fstat(target)
                if not (stat.S_ISREG(tst.st_mode) or stat.S_ISLNK(tst.st_mode)):
                    raise OSError(
                        errno.EPERM, "a hard link may only point at a file or a " "symlink"
                    )
                if st is not None and (st.st_dev, st.st_ino) == (tst.st_dev, tst.st_ino):
                    return  # already that file
                _remove(parent, name, st)
                confined.link_fd(target, parent, name)
            finally:
                os.close(target)
            return
        _remove(parent, name, st)
        if entry.kind == "symlink":
            os.symlink(entry.target, name, dir_fd=parent)
            os.chown(name, entry.uid, entry.gid, dir_fd=parent, follow_symlinks=False)
            os.utime(
                name, ns=(entry.mtime_ns, entry.mtime_ns), dir_fd=parent, follow_symlinks=False
            )
        elif entry.kind == "fifo":
            os.mkfifo(name, 0o600, dir_fd=parent)
            _owner_mode_at(parent, name, os.O_NONBLOCK, entry)
        else:
            # O_EXCL after the unlink: never written through a link or into another's inode.
            fd = create_new(name, parent)
            try:
                if not copy_member(tar, member, fd):
                    raise OSError(errno.EIO, "the tar ended inside the file")
                _owner_mode(fd, entry)
            finally:
                os.close(fd)
    finally:
        os.close(parent)


def copy_member(tar: tarfile.TarFile, member: tarfile.TarInfo, fd: int) -> bool:
    """Write the contents of the file `member` of `tar` to `fd`; False if the tar ends
    inside it."""
    src = tar.extractfile(member)
    left = member.size
    while left > 0 and src is not None:
        chunk = src.read(min(left, _CHUNK))
        if not chunk:
            return False
        write_all(fd, chunk)
        left -= len(chunk)
    return True


def _owner_mode_at(parent: int, name: str, flags: int, entry: Entry) -> None:
    """`_owner_mode` of what was just made at `name`, opened read-only with `flags` and never
    through a link."""
    fd = os.open(name, os.O_RDONLY | flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        _owner_mode(fd, entry)
    finally:
        os.close(fd)


def _owner_mode(fd: int, entry: Entry) -> None:
    # chown first: it clears setuid/setgid, which the chmod then sets as the layer had them.
    os.fchown(fd, entry.uid, entry.gid)
    os.fchmod(fd, entry.mode)
    os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))


def _remove(parent: int, name: str, st: os.stat_result | None) -> None:
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        # shutil's fd-based rmtree: it never follows a symlink it meets on the way down.
        shutil.rmtree(name, dir_fd=parent)
    else:
        os.unlink(name, dir_fd=parent)


# -- the child ----------------------------------------------------------------------------


def apply_here(f: BinaryIO, root: Path) -> None:
    """Check every entry of the layer `f`, then write it into `root`. Refused when it holds
    something a root does not get (nothing written); OSError when writing failed."""
    layer = Layer(f)
    layer.scan()
    with ConfinedRoot(root) as confined_root:
        layer.apply(confined_root)


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "apply":
        print("usage: python -I -m stasis.k8s.rootfs apply ROOT < diff.tar", file=sys.stderr)
        return 2
    child.confine_self()
    confined.keep_only_file_capabilities()
    stdin = os.fdopen(sys.stdin.fileno(), "rb", closefd=False)
    try:
        apply_here(stdin, Path(argv[1]))
    except Refused as e:
        print(f"refused: {e}", file=sys.stderr)
        return _REFUSED_EXIT
    except OSError as e:
        print(f"{e.strerror or e} (the root may hold part of the layer)", file=sys.stderr)
        return _FAILED_EXIT
    except Exception as e:  # a bug of ours: still one line, and only this restore fails
        print(
            f"{type(e).__name__}: {child.short(e)} (the root may hold part of the layer)",
            file=sys.stderr,
        )
        return _FAILED_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
