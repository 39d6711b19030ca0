"""Credentials in a process tree beyond its owner's: what a dump of a user's tree refuses.

CRIU records every thread's credentials (uids, gids, groups, capabilities) in the images and a
restore, run as root, gives them back as recorded. A user who checkpoints their job while a
setuid program of it runs (caught mid-run: `passwd`, `sudo`, a site's setuid helper) would get
a root process back from their own checkpoint. So a dump of a tree whose owner is not root
refuses any thread that holds more than the owner does:

  - a real, effective, saved or filesystem uid other than the owner's;
  - a real, effective, saved or filesystem gid, or a supplementary group, that is not one of
    the owner's groups (as the system lists them; `newgrp` into one of them is fine);
  - permitted, effective or ambient capabilities (a user's processes have none) in the initial
    user namespace, or in a user namespace the owner does not own. Capabilities inside a user
    namespace the owner created are confined to it, and are theirs. The bounding set is left
    alone: it is full for ordinary processes.

Read from /proc/<pid>/task/<tid>/status (uids and gids as this process's user namespace sees
them) and the thread's user namespace (NS_GET_PARENT, NS_GET_OWNER_UID).
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from stasis.engine import proctree, protobuf

# <linux/nsfs.h>
_NS_GET_PARENT = 0xB702
_NS_GET_OWNER_UID = 0xB704
# A status file is about 1.5 KiB; what lies past this is not read.
_STATUS_MAX = 1 << 16
_KINDS = ("real", "effective", "saved", "fs")
_SHOWN = 3  # processes named in one line, at most


@dataclass(frozen=True)
class Credentials:
    """One thread's credentials, as /proc shows them to this process."""

    uids: tuple[int, ...]  # real, effective, saved, fs
    gids: tuple[int, ...]
    groups: tuple[int, ...]
    cap_permitted: int
    cap_effective: int
    cap_ambient: int
    zombie: bool = False  # ended, not yet reaped: it runs nothing, and CRIU gives it no creds


def parse_status(text: bytes) -> Credentials:
    """The credentials in a /proc status file (ValueError when they are not all there)."""
    fields: dict[bytes, bytes] = {}
    for line in text.split(b"\n"):
        key, colon, value = line.partition(b":")
        if colon and key not in fields:
            fields[key] = value.strip()

    def ids(key: bytes, at_least: int) -> tuple[int, ...]:
        values = tuple(int(v) for v in fields[key].split())
        if len(values) < at_least or any(v < 0 or v > 0xFFFFFFFF for v in values):
            raise ValueError(f"bad {key.decode(errors='replace')} line")
        return values

    def caps(key: bytes) -> int:
        return int(fields.get(key, b"0"), 16)

    try:
        return Credentials(
            uids=ids(b"Uid", 4)[:4],
            gids=ids(b"Gid", 4)[:4],
            groups=ids(b"Groups", 0),
            cap_permitted=caps(b"CapPrm"),
            cap_effective=caps(b"CapEff"),
            cap_ambient=caps(b"CapAmb"),
            zombie=fields.get(b"State", b"")[:1] in (b"Z", b"X"),
        )
    except KeyError as e:
        raise ValueError(f"no {e.args[0].decode(errors='replace')} line") from None


def read(pid: int, tid: int) -> Credentials | None:
    """Thread `tid` of `pid`'s credentials (None: it is gone)."""
    try:
        fd = os.open(f"/proc/{pid}/task/{tid}/status", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        text = os.read(fd, _STATUS_MAX)
    except ProcessLookupError:
        return None
    finally:
        os.close(fd)
    return parse_status(text)


def _caps_confined(pid: int, tid: int, owner: int) -> bool:
    """Whether thread `tid`'s capabilities hold only inside a user namespace that `owner` owns
    (one that is not ours, whose ancestor just below ours was created by `owner`)."""
    ours = os.stat("/proc/self/ns/user")
    try:
        fd = os.open(f"/proc/{pid}/task/{tid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino):
            return False
        for _ in range(64):  # the kernel nests user namespaces 32 deep at most
            try:
                parent = fcntl.ioctl(fd, _NS_GET_PARENT)
            except OSError:
                return False  # not below ours
            pst = os.fstat(parent)
            if (pst.st_dev, pst.st_ino) == (ours.st_dev, ours.st_ino):
                os.close(parent)
                buf = bytearray(4)
                fcntl.ioctl(fd, _NS_GET_OWNER_UID, buf, True)
                return int.from_bytes(buf, sys.byteorder) == owner
            os.close(fd)
            fd = parent
        return False
    finally:
        os.close(fd)


def excess(
    cred: Credentials, uid: int, groups: Iterable[int], caps_confined: bool = False
) -> list[str]:
    """What `cred` holds beyond an owner with `uid` and `groups` (their primary one included),
    each said in a few words; empty: nothing."""
    allowed = set(groups)
    found = []
    by_value: dict[int, list[str]] = {}
    for kind, value in zip(_KINDS, cred.uids):
        if value != uid:
            by_value.setdefault(value, []).append(kind)
    found += [f"{_and(kinds)} uid {value} ({_user(value)})" for value, kinds in by_value.items()]
    by_value = {}
    for kind, value in zip(_KINDS, cred.gids):
        if value not in allowed:
            by_value.setdefault(value, []).append(kind)
    found += [f"{_and(kinds)} gid {value} ({_group(value)})" for value, kinds in by_value.items()]
    extra = [g for g in cred.groups if g not in allowed]
    if extra:
        found.append(
            "supplementary group"
            + ("s " if len(extra) > 1 else " ")
            + ", ".join(f"{g} ({_group(g)})" for g in extra[:4])
            + (f" and {len(extra) - 4} more" if len(extra) > 4 else "")
        )
    if not caps_confined:
        by_value = {}
        for name, value in (
            ("permitted", cred.cap_permitted),
            ("effective", cred.cap_effective),
            ("ambient", cred.cap_ambient),
        ):
            if value:
                by_value.setdefault(value, []).append(name)
        found += [f"{_and(names)} capabilities {value:#x}" for value, names in by_value.items()]
    return found


@dataclass(frozen=True)
class Excess:
    pid: int
    command: str
    holds: list[str]

    def describe(self) -> str:
        return f"pid {self.pid} ({self.command}) holds {', '.join(self.holds)}"


def tree_excess(root: int, uid: int, groups: Iterable[int]) -> list[Excess]:
    """The processes of the tree under `root` with a thread whose credentials exceed an owner
    with `uid` and `groups` (the first such thread of each is said)."""
    allowed = list(groups)
    found = []
    for pid in proctree.tree(root):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue  # gone
        for tid in tids:
            cred = read(pid, tid)
            if cred is None or cred.zombie:
                continue
            caps = cred.cap_permitted | cred.cap_effective | cred.cap_ambient
            confined = bool(caps) and _caps_confined(pid, tid, uid)
            holds = excess(cred, uid, allowed, confined)
            if holds:
                found.append(Excess(pid, _command(pid), holds))
                break
    return found


def refusal(found: list[Excess], user: str, uid: int) -> str:
    """One line: which processes hold what beyond their owner, why a dump is refused, and what
    to do instead."""
    shown = "; ".join(e.describe() for e in found[:_SHOWN])
    more = f" (and {len(found) - _SHOWN} more processes)" if len(found) > _SHOWN else ""
    return (
        f"{shown}{more}: more than its owner {user} (uid {uid}) has (a setuid program "
        "caught mid-run?), and a restore would give it back; checkpoint again once that "
        "program has ended"
    )


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _user(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no user"


def _group(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return "no group"


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            name = f.read(64).strip()
    except OSError:
        return "?"
    return "".join(c if c.isprintable() else "?" for c in name.decode(errors="replace"))


# -- what a checkpoint's images would give back --------------------------------------------------

# core-<tid>.img: CRIU's two magics, then one length-prefixed core_entry (images/core.proto):
# core_entry.thread_core (5) -> thread_core_entry.creds (10) -> creds_entry (images/creds.proto).
_CORE_IMAGE_MAX = 1 << 20  # a core image is a few KiB
_THREAD_CORE, _CREDS = 5, 10
_CRED_IDS = {
    1: ("real", "uid"),
    3: ("effective", "uid"),
    5: ("saved", "uid"),
    7: ("fs", "uid"),
    2: ("real", "gid"),
    4: ("effective", "gid"),
    6: ("saved", "gid"),
    8: ("fs", "gid"),
}
_CAP_PRM, _CAP_EFF, _GROUPS, _CAP_AMB = 10, 11, 14, 19


def image_credentials(data: bytes) -> Credentials | None:
    """The credentials a core image records for its thread (None: it records none, as for a
    zombie). ValueError for bytes that are no core image."""
    if len(data) < 12:
        raise ValueError("shorter than a core image")
    size = int.from_bytes(data[8:12], "little")
    if 12 + size > len(data):
        raise ValueError("its entry runs past the end")
    thread = [v for n, v in protobuf.fields(data[12 : 12 + size]) if n == _THREAD_CORE]
    creds = (
        [v for n, v in protobuf.fields(thread[-1]) if n == _CREDS]
        if thread and isinstance(thread[-1], bytes)
        else []
    )
    if not creds or not isinstance(creds[-1], bytes):
        return None
    fields = protobuf.fields(creds[-1])
    ids = {n: v for n, v in fields if n in _CRED_IDS and isinstance(v, int)}
    if len(ids) != len(_CRED_IDS):
        raise ValueError("its credentials lack a uid or gid")

    def caps(number: int) -> int:
        return sum(word << (32 * i) for i, word in enumerate(protobuf.repeated(fields, number)))

    return Credentials(
        uids=(ids[1], ids[3], ids[5], ids[7]),
        gids=(ids[2], ids[4], ids[6], ids[8]),
        groups=tuple(protobuf.repeated(fields, _GROUPS)),
        cap_permitted=caps(_CAP_PRM),
        cap_effective=caps(_CAP_EFF),
        cap_ambient=caps(_CAP_AMB),
    )


def images_excess(images: Path, uid: int, groups: Iterable[int]) -> list[str]:
    """What the threads a checkpoint's images record hold beyond an owner with `uid` and
    `groups`, one "thread <tid> holds ..." each: what a restore would give back. Capabilities
    count whatever user namespace they were held in (the images do not say it here)."""
    allowed = list(groups)
    found = []
    for path in sorted(images.glob("core-*.img")):
        with open(path, "rb") as f:
            data = f.read(_CORE_IMAGE_MAX)
        cred = image_credentials(data)
        if cred is None:
            continue
        holds = excess(cred, uid, allowed)
        if holds:
            found.append(f"thread {path.stem.removeprefix('core-')} holds {', '.join(holds)}")
    return found


__all__ = [
    "Credentials",
    "Excess",
    "excess",
    "image_credentials",
    "images_excess",
    "parse_status",
    "read",
    "refusal",
    "tree_excess",
]
