"""What a restore depends on besides the images: gathered when a tree is dumped, recorded in its
checkpoint's manifest (`restore_facts`, the shape of stasis.wire.RestoreFacts), and compared
with the restoring node before CRIU runs (`require`), or on request (`stasis check
--checkpoint ID`, `compare`).

    node        this node's side: architecture, CPU model and flags, kernel, CRIU, stasis
    open_files  the regular files a tree has open: path, size, mtime, mode, how it is open
    compare     recorded facts against this node: one finding per fact, ok / note / refuses
    require     refuse before a restore, in one line naming every difference that refuses

What refuses and what is only noted follows what CRIU does with a difference, and what the job
would meet after a restore that CRIU let through:

    architecture differs                 refuses  CRIU restores a process on its own
                                                  architecture only (registers, syscalls)
    CPU lacks an instruction-set flag    refuses  CRIU checks only the FPU/xsave state by default
    the dumping CPU had (avx2, avx512f)           (--cpu-cap=fpu), but a program chose its code
                                                  paths (glibc's string functions, numpy, BLAS)
                                                  from CPUID when it started: it would die of
                                                  SIGILL later, half-way through its work
    CPU lacks another flag               note     flags describing the machine or the kernel
    (hypervisor, pti, constant_tsc)               (virtualization, mitigations, timers, perf
                                                  hints such as erms/fsrm): no instruction
                                                  faults; they come and go with kernels
    CPU model differs                    note
    CRIU here older than the dumping one refuses  its images may hold entries an older CRIU
                                                  cannot read
    CRIU newer, kernel, stasis differ    note     CRIU reads older images; a kernel feature the
                                                  job used and this kernel lacks fails CRIU by name
    the user is missing here, or its     refuses  the job would come back as a uid that is
    name is another uid here                      nobody's, or someone else's
    an open file is missing, or no       refuses  CRIU reopens every file by path and fails
    longer a regular file                         half-way through ("No such file")
    its size differs                     refuses  CRIU: "File ... has bad size"; except a file
                                         (note)   open write-only with O_APPEND only (a log),
                                                  whose size CRIU does not check
    its mode differs                     refuses  CRIU: "File ... has bad mode"
    same size, another mtime             refuses  for a file the job only read: CRIU would
                                                  reopen it and the job would go on reading
                                                  other contents than it had read (an input
                                                  rewritten in place)
                                         note     for a file the job had open for writing: the
                                                  job itself may have written it after a
                                                  --leave-running dump, and carries on writing

A node-local file the checkpoint carries (under /tmp, /dev/shm, $TMPDIR...: engine/nodelocal.py)
is a note when it is missing (the restore makes it first) or when the job wrote it and it differs
(the checkpoint's copy replaces it, unless another process has it open: that refuses then).

There is no --force. Each refusal is a restore that CRIU would fail half-way (architecture,
CRIU version, a file's size or mode) or that would hand the job a world other than the one it
was dumped in (another user, an instruction it uses gone, an input rewritten): the fix is on the
node (put the file back, run it where the CPU has the flags), and the checkpoint waits for it.
Differences that are safe are notes and never block.

The x86 flags that refuse are those naming instructions or registers a program uses in user
mode, by /proc/cpuinfo's names: the instruction-level set CRIU's own `--cpu-cap=ins` check
knows, with the extensions that came since (AVX-512 families, AMX, VNNI...). CPU flags are read
from /proc/cpuinfo (what the kernel enabled, common to every CPU of the node), not CPUID: an
extension the kernel switched off cannot be used either. On other architectures every flag
(arm64's Features) is a user-visible hardware capability, so every missing one refuses.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import stat
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Literal

from stasis import __version__, wire
from stasis.engine import privatetmp, proctree
from stasis.engine.criu import CRIU, Owner
from stasis.errors import IncompatibleNodeError

# x86 flags (as /proc/cpuinfo spells them) that name instructions or state a program may use in
# user mode: a program that found one at its start may execute it at any time after.
X86_INSTRUCTION_FLAGS = frozenset(
    """
    fpu tsc cx8 sep cmov clflush mmx fxsr sse sse2 syscall mmxext rdtscp lm 3dnowext 3dnow
    pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand
    lahf_lm abm sse4a misalignsse 3dnowprefetch xop lwp fma4 tbm mwaitx
    fsgsbase bmi1 hle avx2 bmi2 rtm mpx avx512f avx512dq rdseed adx avx512ifma clflushopt clwb
    avx512pf avx512er avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1
    avx512vbmi pku ospke waitpkg avx512_vbmi2 shstk gfni vaes vpclmulqdq avx512_vnni
    avx512_bitalg avx512_vpopcntdq rdpid cldemote movdiri movdir64b enqcmd
    avx512_4vnniw avx512_4fmaps avx512_vp2intersect serialize tsxldtrk amx_bf16 avx512_fp16
    amx_tile amx_int8 avx_vnni avx512_bf16 cmpccxadd amx_fp16 avx_ifma avx_vnni_int8
    avx_ne_convert amx_complex avx_vnni_int16 prefetchiti sha512 sm3 sm4 user_shstk
    clzero rdpru
""".split()
)

# Files of the kernel's, not the job's: their sizes and times say nothing of what it read.
_PSEUDO = ("/proc/", "/sys/")
_O_ACCMODE = 0o3
_O_WRONLY = 0o1
_O_APPEND = 0o2000


@dataclass(frozen=True)
class Node:
    """This node, as a restore depends on it."""

    arch: str
    cpu_model: str
    cpu_flags: tuple[str, ...]
    kernel: str
    criu_version: str
    stasis_version: str


@dataclass(frozen=True)
class FileState:
    """A path as a restore would find it now (stat follows symlinks, as CRIU's open does)."""

    path: str
    error: str | None = None  # why it cannot be stat'ed ("No such file or directory")
    regular: bool = False
    size_bytes: int = 0
    mtime_ns: int = 0
    mode: int = 0


@cache
def cpu() -> tuple[str, tuple[str, ...]]:
    """This node's CPU model and the flags every one of its CPUs has (/proc/cpuinfo)."""
    model = ""
    common: set[str] | None = None
    for block in Path("/proc/cpuinfo").read_text().split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
        flags = fields.get("flags", fields.get("Features"))
        if flags is None:
            continue
        model = (
            model
            or fields.get("model name")
            or " ".join(fields[k] for k in ("CPU implementer", "CPU part") if k in fields)
        )
        mine = set(flags.split())
        common = mine if common is None else common & mine
    return model, tuple(sorted(common or ()))


def node(criu_version: str) -> Node:
    """This node's facts; `criu_version` as CRIU reports it ("4.2.1")."""
    model, flags = cpu()
    uname = os.uname()
    return Node(
        arch=uname.machine,
        cpu_model=model,
        cpu_flags=flags,
        kernel=uname.release,
        criu_version=criu_version,
        stasis_version=__version__,
    )


def criu_version(criu: CRIU) -> str:
    return ".".join(str(p) for p in criu.version())


def record(here: Node, user: str, uid: int, files: list[wire.OpenFile] | None) -> wire.RestoreFacts:
    """What the manifest of a checkpoint dumped here, of `user`'s tree, records."""
    return wire.RestoreFacts(
        arch=here.arch,
        cpu_model=here.cpu_model,
        cpu_flags=list(here.cpu_flags),
        kernel=here.kernel,
        criu_version=here.criu_version,
        stasis_version=here.stasis_version,
        user=user,
        uid=uid,
        files=files,
    )


def open_files(pid: int) -> list[wire.OpenFile]:
    """The regular files the tree under `pid` has open, one entry per path, sorted.

    Left out: what the tree's root has as stdout and stderr (the job's log, a Slurm job's
    output: a restore re-points those at files of its own), deleted files (CRIU keeps their
    contents in the images), files under /proc and /sys, files on the tree's own mounts (a
    private /tmp: in the images too), and anything that is not a regular file."""
    outputs = proctree.outputs(pid)
    # A private /tmp's files travel in the images with its tmpfs (engine/privatetmp.py), a job
    # container's /tmp whole beside them (engine/boundtmp.py).
    own = privatetmp.own_devices(pid)
    whole = tuple(m + "/" for m in privatetmp.bound_from_node(pid))
    found: dict[str, wire.OpenFile] = {}
    for p in proctree.tree(pid):
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue  # it ended meanwhile
        for fd in fds:
            entry = _open_file(p, fd, outputs, own)
            if entry is None or entry["path"].startswith(whole):
                continue
            seen = found.get(entry["path"])
            if seen is not None and seen["access"] != entry["access"]:
                # Open several ways: it is written to, and not only appended to.
                entry["access"] = "write"
            found[entry["path"]] = entry
    return [found[path] for path in sorted(found)]


def _open_file(
    pid: int, fd: str, skip: set[tuple[int, int]], own: frozenset[int] = frozenset()
) -> wire.OpenFile | None:
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        st = os.stat(f"/proc/{pid}/fd/{fd}")
        flags = _fd_flags(pid, fd)
    except (OSError, ValueError):
        return None  # closed meanwhile
    if (
        not stat.S_ISREG(st.st_mode)
        or st.st_nlink == 0
        or not target.startswith("/")
        or target.endswith(" (deleted)")
        or target.startswith(_PSEUDO)
        or (st.st_dev, st.st_ino) in skip
        or st.st_dev in own
    ):
        return None
    access: Literal["read", "write", "append"]
    if flags & _O_ACCMODE == 0:
        access = "read"
    elif flags & _O_ACCMODE == _O_WRONLY and flags & _O_APPEND:
        access = "append"
    else:
        access = "write"
    return wire.OpenFile(
        path=target,
        size_bytes=st.st_size,
        mtime_ns=st.st_mtime_ns,
        mode=stat.S_IMODE(st.st_mode),
        access=access,
    )


def _fd_flags(pid: int, fd: str) -> int:
    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "flags":
            return int(value.strip(), 8)
    raise ValueError("no flags in fdinfo")


class OpenFilesAtDump:
    """A dump's notify handler (DumpOptions.notify): lists the tree's open files at CRIU's
    post-dump, while CRIU still holds the tree frozen, so that sizes and times are those its
    images record, whether the tree is then stopped or left running."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.files: list[wire.OpenFile] | None = None

    def __call__(self, script: str, _pid: int) -> bool:
        if script == "post-dump":
            try:
                self.files = open_files(self.pid)
            except Exception:  # noqa: BLE001 - a failed answer would abort the dump itself
                self.files = None  # recorded as unknown: a restore then says it did not compare
        return True


# -- the restoring node's side ---------------------------------------------------------------


def stat_files(paths: Iterable[str]) -> dict[str, FileState]:
    """Each path as this process finds it now (with its own rights)."""
    return {path: _stat(path) for path in paths}


def _stat(path: str) -> FileState:
    try:
        st = os.stat(path)
    except OSError as e:
        return FileState(path, error=e.strerror or str(e))
    return FileState(
        path,
        regular=stat.S_ISREG(st.st_mode),
        size_bytes=st.st_size,
        mtime_ns=st.st_mtime_ns,
        mode=stat.S_IMODE(st.st_mode),
    )


@contextmanager
def owner_rights(owner: Owner) -> Iterator[None]:
    """Act with `owner`'s rights (their groups too) until the block ends: what a restore
    reopens, it reopens with them. Changes the whole process's credentials: only for
    single-threaded callers (a job's supervisor, a Slurm task's helper)."""
    if owner.uid == 0:
        yield
        return
    saved = os.getgroups()
    os.setgroups(list(owner.groups))
    os.setegid(owner.gid)
    os.seteuid(owner.uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(saved)


# Run as the owner by `stat_files_as`: the same as `_stat`, without importing stasis (a child
# of the daemon, with -I: nothing of the caller's environment reaches it).
_STAT_AS = r"""
import json, os, stat, sys
out = {}
for path in json.load(sys.stdin):
    try:
        st = os.stat(path)
    except OSError as e:
        out[path] = {"error": e.strerror or str(e)}
        continue
    out[path] = {"regular": stat.S_ISREG(st.st_mode), "size_bytes": st.st_size,
                 "mtime_ns": st.st_mtime_ns, "mode": stat.S_IMODE(st.st_mode)}
json.dump(out, sys.stdout)
"""


def stat_files_as(owner: Owner, paths: Sequence[str]) -> dict[str, FileState]:
    """`stat_files` with `owner`'s rights, from a multi-threaded process (the daemon): in a
    child that runs as them. A path they may not reach says so ("Permission denied") and tells
    them nothing else of what is there."""
    if owner.uid == 0 or not paths:
        return stat_files(paths)
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _STAT_AS],
            input=json.dumps(list(paths)),
            capture_output=True,
            text=True,
            timeout=60,
            user=owner.uid,
            group=owner.gid,
            extra_groups=list(owner.groups),
            cwd="/",
        )
        states = json.loads(done.stdout)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        why = f"cannot look at it as uid {owner.uid}: {e}"
        return {path: FileState(path, error=why) for path in paths}
    return {
        path: FileState(path, **states[path])
        if path in states
        else FileState(path, error="not looked at")
        for path in paths
    }


# -- comparing -------------------------------------------------------------------------------


def _finding(
    what: str, recorded: str, here: str, verdict: wire.Verdict = "ok", why: str = ""
) -> wire.CompatFact:
    return wire.CompatFact(what=what, recorded=recorded, here=here, verdict=verdict, why=why)


def _noted(what: str, recorded: str, here: str, why: str) -> wire.CompatFact:
    """The same here: ok; another: a note saying `why` (nothing a restore fails on)."""
    if recorded == here:
        return _finding(what, recorded, here)
    return _finding(what, recorded, here, "note", why)


def _version(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        return None


def compare(
    recorded: wire.RestoreFacts,
    here: Node,
    files: Mapping[str, FileState] | None,
    skip: Iterable[str] = (),
    travels: Iterable[str] = (),
) -> list[wire.CompatFact]:
    """Every recorded fact against this node. `files`: the recorded files' paths as a restore
    would find them (`stat_files`, with the owner's rights); None leaves files out. `skip`:
    paths a restore re-points rather than reopens (the job's log). `travels`: node-local files
    the checkpoint carries (engine/nodelocal.py): missing, a restore makes them first; one the
    job wrote that differs, the checkpoint's copy replaces."""
    out = [_arch(recorded, here), *_cpu(recorded, here), _criu(recorded, here)]
    out.append(
        _noted(
            "kernel",
            recorded["kernel"],
            here.kernel,
            f"another kernel ({here.kernel}; dumped on {recorded['kernel']}): CRIU "
            "copes, and names any kernel feature the job used that this one lacks",
        )
    )
    out.append(
        _noted(
            "stasis",
            recorded["stasis_version"],
            here.stasis_version,
            f"another stasis version ({here.stasis_version}; dumped by "
            f"{recorded['stasis_version']})",
        )
    )
    out.append(_user(recorded))
    if files is not None:
        skipped, carried = set(skip), set(travels)
        for entry in recorded["files"] or ():
            if entry["path"] not in skipped:
                now = files.get(entry["path"], FileState(entry["path"], "not looked at"))
                made = _carried(entry, now) if entry["path"] in carried else None
                out.append(made or _file(entry, now, recorded["user"]))
    if recorded["files"] is None:
        out.append(
            _finding(
                "open files",
                "not recorded",
                "",
                "note",
                "the dump could not list the job's open files: they are not "
                "compared (CRIU still checks their sizes)",
            )
        )
    return out


def _arch(recorded: wire.RestoreFacts, here: Node) -> wire.CompatFact:
    if recorded["arch"] == here.arch:
        return _finding("architecture", recorded["arch"], here.arch)
    return _finding(
        "architecture",
        recorded["arch"],
        here.arch,
        "refuses",
        f"this node is {here.arch}, the checkpoint was dumped on {recorded['arch']}: "
        f"CRIU restores a process only on the architecture it ran on",
    )


def _cpu(recorded: wire.RestoreFacts, here: Node) -> list[wire.CompatFact]:
    missing = sorted(set(recorded["cpu_flags"]) - set(here.cpu_flags))
    if recorded["arch"] in ("x86_64", "i686", "i386"):
        isa = [f for f in missing if f in X86_INSTRUCTION_FLAGS]
        other = [f for f in missing if f not in X86_INSTRUCTION_FLAGS]
    else:
        isa, other = missing, []
    n_rec, n_here = f"{len(recorded['cpu_flags'])} flags", f"{len(here.cpu_flags)} flags"
    out = []
    them = "it" if len(isa) == 1 else "them"
    if isa:
        out.append(
            _finding(
                "CPU flags",
                n_rec,
                f"{n_here}, lacking {', '.join(isa)}",
                "refuses",
                f"this CPU lacks {', '.join(isa)} (the dumping node's had {them}: the job may use "
                f"{them} and would die of SIGILL); restore it on a node whose CPU has {them}",
            )
        )
    else:
        out.append(_finding("CPU flags", n_rec, n_here))
    if other:
        out.append(
            _finding(
                "CPU flags (machine)",
                ", ".join(other),
                "missing",
                "note",
                f"this CPU lacks {', '.join(other)}: flags of the machine or the kernel "
                "(virtualization, mitigations, timers, performance hints), not instructions a "
                "program runs",
            )
        )
    if recorded["cpu_model"] != here.cpu_model:
        out.append(
            _finding(
                "CPU model",
                recorded["cpu_model"],
                here.cpu_model,
                "note",
                "another CPU model: what matters is its flags",
            )
        )
    return out


def _criu(recorded: wire.RestoreFacts, here: Node) -> wire.CompatFact:
    was, now = recorded["criu_version"], here.criu_version
    if was == now:
        return _finding("CRIU", was, now)
    older = _version(now), _version(was)
    if older[0] is not None and older[1] is not None and older[0] < older[1]:
        return _finding(
            "CRIU",
            was,
            now,
            "refuses",
            f"CRIU {now} here is older than CRIU {was}, which dumped it (its images "
            f"may hold what an older CRIU cannot read): install CRIU {was} or newer",
        )
    return _finding("CRIU", was, now, "note", f"another CRIU ({now}; dumped with {was})")


def _user(recorded: wire.RestoreFacts) -> wire.CompatFact:
    name, uid = recorded["user"], recorded["uid"]
    was = f"{name} (uid {uid})"
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        try:
            other = pwd.getpwuid(uid).pw_name
        except KeyError:
            other = None
        held = f", and uid {uid} is {other}'s" if other else ""
        return _finding(
            "user",
            was,
            "missing",
            "refuses",
            f"user {name} does not exist on this node{held}: the job would run "
            f"as a uid that is not {name}'s; create {name} with uid {uid}",
        )
    if entry.pw_uid != uid:
        return _finding(
            "user",
            was,
            f"{name} (uid {entry.pw_uid})",
            "refuses",
            f"user {name} is uid {entry.pw_uid} on this node, was uid {uid}: the "
            f"job would come back as uid {uid}, which is not {name} here",
        )
    return _finding("user", was, was)


def _when(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _describe(size: int, mode: int, mtime_ns: int) -> str:
    return f"{size} bytes, mode {mode:04o}, modified {_when(mtime_ns)}"


def _file(entry: wire.OpenFile, now: FileState, user: str) -> wire.CompatFact:
    path = entry["path"]
    fact = f"file {path}"
    was = _describe(entry["size_bytes"], entry["mode"], entry["mtime_ns"])
    if now.error == os.strerror(errno.EACCES):
        return _finding(
            fact,
            was,
            now.error,
            "refuses",
            f"{path}: {now.error} (a restore reopens the job's files with the "
            f"rights of its owner, {user}, who may not open it now)",
        )
    if now.error is not None:
        return _finding(
            fact,
            was,
            now.error,
            "refuses",
            f"{path} cannot be opened here ({now.error}); the job had it open: put " "it back",
        )
    if not now.regular:
        return _finding(
            fact,
            was,
            "not a regular file",
            "refuses",
            f"{path} is no longer a regular file; the job had it open: put it back",
        )
    here = _describe(now.size_bytes, now.mode, now.mtime_ns)
    if now.size_bytes != entry["size_bytes"]:
        if entry["access"] == "append":
            return _finding(
                fact,
                was,
                here,
                "note",
                f"{path} is {now.size_bytes} bytes, was {entry['size_bytes']} when "
                "dumped; the job only appends to it, and goes on appending",
            )
        return _finding(
            fact,
            was,
            here,
            "refuses",
            f"{path} is {now.size_bytes} bytes, was {entry['size_bytes']} when "
            "dumped (CRIU refuses to reopen a file whose size changed): put it back "
            "as it was",
        )
    if now.mode != entry["mode"]:
        return _finding(
            fact,
            was,
            here,
            "refuses",
            f"{path} has mode {now.mode:04o}, was {entry['mode']:04o} when dumped "
            f"(CRIU refuses it): chmod it back to {entry['mode']:04o}",
        )
    if now.mtime_ns != entry["mtime_ns"]:
        if entry["access"] == "read":
            return _finding(
                fact,
                was,
                here,
                "refuses",
                f"{path} was modified since the dump ({_when(now.mtime_ns)}, was "
                f"{_when(entry['mtime_ns'])}; same size): the job, which read it, "
                "would go on reading other contents; put the dumped version back "
                "(same contents? `touch -d` it to its old time)",
            )
        return _finding(
            fact,
            was,
            here,
            "note",
            f"{path} was modified since the dump (same size): the job had it open "
            "for writing and may have written it itself after a --leave-running "
            "dump",
        )
    return _finding(fact, was, here)


def _carried(entry: wire.OpenFile, now: FileState) -> wire.CompatFact | None:
    """A node-local file the checkpoint carries: what its restore does with it, or None where
    the usual comparison decides (it is there and the job only read it, or appends to it)."""
    path = entry["path"]
    fact = f"file {path}"
    was = _describe(entry["size_bytes"], entry["mode"], entry["mtime_ns"])
    if now.error == os.strerror(errno.ENOENT):
        return _finding(
            fact,
            was,
            "missing, in the checkpoint",
            "note",
            f"{path} is not on this node: the restore recreates it from the "
            "checkpoint (a node-local file of the job's)",
        )
    if (
        now.error is None
        and entry["access"] == "write"
        and (now.size_bytes, now.mode, now.mtime_ns)
        != (entry["size_bytes"], entry["mode"], entry["mtime_ns"])
    ):
        return _finding(
            fact,
            was,
            _describe(now.size_bytes, now.mode, now.mtime_ns),
            "note",
            f"{path} differs from the checkpoint's copy, which replaces it (the "
            "job's own node-local file; refused if another process has it open)",
        )
    return None


def refusal(checkpoint_id: str, findings: Iterable[wire.CompatFact]) -> str | None:
    """The one line refusing a restore of `checkpoint_id` here, or None when nothing refuses."""
    whys = [f["why"] for f in findings if f["verdict"] == "refuses"]
    if not whys:
        return None
    return (
        f"cannot restore checkpoint {checkpoint_id} on this node: "
        + "; ".join(whys)
        + f"; nothing was restored (`stasis check --checkpoint {checkpoint_id}` compares "
        "every fact)"
    )


def require(
    checkpoint_id: str,
    recorded: wire.RestoreFacts,
    criu: CRIU,
    owner: Owner,
    skip: Iterable[str] = (),
    known_criu_version: str | None = None,
    travels: Iterable[str] = (),
) -> list[wire.CompatFact]:
    """Compare before a restore, the files with `owner`'s rights (single-threaded callers):
    IncompatibleNodeError naming every difference that refuses, else the findings (notes).
    `known_criu_version`: `criu`'s, when the caller knows it (asking CRIU takes 5-20 ms)."""
    here = node(known_criu_version or criu_version(criu))
    paths = [f["path"] for f in recorded["files"] or ()]
    with owner_rights(owner):
        files = stat_files(paths)
    findings = compare(recorded, here, files, skip, travels)
    refused = refusal(checkpoint_id, findings)
    if refused is not None:
        raise IncompatibleNodeError(refused)
    return findings


def notes(findings: Iterable[wire.CompatFact]) -> list[str]:
    """The findings that are notes, as lines for a restore's answer."""
    return [f["why"] for f in findings if f["verdict"] == "note"]
