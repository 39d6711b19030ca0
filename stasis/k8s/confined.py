"""Paths inside a directory tree that someone else controls (a container's root filesystem),
resolved by the kernel so that nothing in the tree can lead a root process out of it.

`ConfinedRoot(path)` holds the tree's top directory open; `open(rel, flags)` resolves `rel` with
openat2(2) and RESOLVE_IN_ROOT: `..` stops at the top, an absolute symlink (`/lib ->
/usr/lib`) means the tree's own /usr/lib, as in a chroot, but without the process ever
chrooting, and magic links (/proc/self/fd/..) and other mounts are refused. Where the kernel
has no openat2 (before 5.6), the same is done by opening one component at a time with
O_NOFOLLOW, which refuses any symlink on the way instead of following it.

The last component of a path is never followed by the callers: they split a path into its
parent (resolved here) and one name, and act on the name with the *at calls and
AT_SYMLINK_NOFOLLOW / O_NOFOLLOW.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from types import TracebackType

from stasis.fdio import descend

__all__ = ["ConfinedRoot", "EscapeError", "keep_only_file_capabilities", "link_fd", "split"]

_SYS_OPENAT2 = 437  # the same number on every architecture (added after the tables merged)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
_IN_ROOT = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_AT_EMPTY_PATH = 0x1000
NAME_MAX = 255
PATH_MAX = 4096


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.linkat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
_libc.linkat.restype = ctypes.c_int
# None until the first call says whether this kernel has openat2; tests set it to False to
# exercise the component walk.
have_openat2: bool | None = None


class EscapeError(OSError):
    """A path that would leave the tree, or that the component walk will not follow."""


def split(name: str) -> tuple[str, ...]:
    """`name` (a path relative to the tree, as a tar entry names it) as its components;
    ValueError for absolute paths, `..`, NUL bytes and over-long names. `./a//b/` is (a, b)."""
    if "\x00" in name:
        raise ValueError("a NUL byte in the name")
    if len(name.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise ValueError(f"a name longer than {PATH_MAX} bytes")
    if name.startswith("/"):
        raise ValueError("an absolute path")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    for p in parts:
        if p == "..":
            raise ValueError("a '..' component")
        if len(p.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise ValueError(f"a component longer than {NAME_MAX} bytes")
    return parts


def _openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    global have_openat2
    how = _OpenHow(flags=flags | os.O_CLOEXEC, mode=0, resolve=resolve)
    raw = os.fsencode(path)
    while True:
        # Every argument typed: syscall(2) is variadic, and the kernel reads whole longs.
        fd = int(
            _libc.syscall(
                ctypes.c_long(_SYS_OPENAT2),
                ctypes.c_long(dirfd),
                ctypes.c_char_p(raw),
                ctypes.byref(how),
                ctypes.c_size_t(ctypes.sizeof(how)),
            )
        )
        if fd >= 0:
            have_openat2 = True
            return fd
        err = ctypes.get_errno()
        if err == errno.EAGAIN:
            continue  # a rename raced the lookup: the kernel asks to try again
        if err == errno.ENOSYS and have_openat2 is None:
            have_openat2 = False
        if err == errno.EXDEV:
            raise EscapeError(err, f"{path!r} leads out of the tree (another mount)")
        if err == errno.ELOOP and resolve & RESOLVE_NO_MAGICLINKS:
            raise EscapeError(err, f"{path!r} goes through too many or magic links")
        raise OSError(err, os.strerror(err), path)


class ConfinedRoot:
    """An open directory, and paths below it resolved without leaving it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        # The root's own path is the node's (a containerd snapshot), not the tenant's.
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ConfinedRoot:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def open(self, parts: tuple[str, ...], flags: int) -> int:
        """An fd for `parts` below the root. Symlinks on the way resolve inside the tree;
        with O_NOFOLLOW in `flags` the last component is not followed (a symlink there: ELOOP,
        or the link itself with O_PATH)."""
        if not parts:
            return os.open(".", flags | os.O_CLOEXEC, dir_fd=self.fd)
        if have_openat2 is not False:
            try:
                return _openat2(self.fd, "/".join(parts), flags, _IN_ROOT)
            except OSError as e:
                if e.errno != errno.ENOSYS:
                    raise
        return self._walk(parts, flags)

    def _walk(self, parts: tuple[str, ...], flags: int) -> int:
        """Without openat2: one component at a time, each opened with O_NOFOLLOW (the last
        too: a symlink anywhere is refused instead of followed), never into another mount."""
        top = os.fstat(self.fd).st_dev

        def step(fd: int, i: int) -> int:
            p = parts[i]
            last = i == len(parts) - 1
            how = (flags if last else os.O_RDONLY | os.O_DIRECTORY) | os.O_NOFOLLOW
            try:
                nxt = os.open(p, how | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
                    os.stat(p, dir_fd=fd, follow_symlinks=False).st_mode
                ):
                    raise EscapeError(
                        errno.ELOOP,
                        f"{p!r} is a symlink (this kernel has "
                        "no openat2 to follow it inside the tree)",
                    ) from e
                raise
            if os.fstat(nxt).st_dev != top:
                os.close(nxt)
                raise EscapeError(errno.EXDEV, f"{p!r} is another mount")
            return nxt

        return descend(os.dup(self.fd), range(len(parts)), step)

    def parent(self, parts: tuple[str, ...], make: bool = False) -> int:
        """An fd of the directory holding `parts[-1]`; with `make`, missing directories on the
        way are created (0755, root's, as tar does), each inside the tree."""
        flags = os.O_RDONLY | os.O_DIRECTORY
        try:
            return self.open(parts[:-1], flags)
        except FileNotFoundError:
            if not make:
                raise

        def step(fd: int, i: int) -> int:
            try:
                return self.open(parts[:i], flags)
            except FileNotFoundError:
                try:
                    os.mkdir(parts[i - 1], 0o755, dir_fd=fd)
                except FileExistsError:
                    pass  # a dangling symlink: the open below says so
                return self.open(parts[:i], flags)

        return descend(self.open((), flags), range(1, len(parts)), step)


def link_fd(target_fd: int, dirfd: int, name: str) -> None:
    """A hard link `name` in `dirfd` to the file open as `target_fd` (O_PATH is enough):
    linkat(AT_EMPTY_PATH) links what was opened, never a path looked up again."""
    if _libc.linkat(target_fd, b"", dirfd, os.fsencode(name), _AT_EMPTY_PATH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), name)


# Capabilities a process writing files as their owners needs: chown, bypassing modes on the
# way (DAC_OVERRIDE, DAC_READ_SEARCH, which linkat(AT_EMPTY_PATH) also wants), chmod of others'
# files (FOWNER) and keeping setgid bits (FSETID). Not mknod, chroot, mount, ptrace...
FILE_CAPABILITIES = (0, 1, 2, 3, 4)
_PR_SET_NO_NEW_PRIVS = 38
_CAP_V3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def keep_only_file_capabilities() -> None:
    """Drop every capability of this process but FILE_CAPABILITIES, and let nothing it might
    execute gain any (no_new_privs). Only ever lowers: what it lacks it does not get."""
    keep = sum(1 << c for c in FILE_CAPABILITIES)
    header = _CapHeader(_CAP_V3, 0)
    data = (_CapData * 2)()
    if _libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    for i, d in enumerate(data):
        mask = keep if i == 0 else 0
        d.effective &= mask
        d.permitted &= mask
        d.inheritable = 0
    if _libc.capset(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset failed: {os.strerror(err)}")
    if (
        _libc.prctl(
            ctypes.c_int(_PR_SET_NO_NEW_PRIVS),
            ctypes.c_ulong(1),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        )
        != 0
    ):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
