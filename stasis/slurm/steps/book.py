"""The job's step book: a SysV segment of the job's own IPC namespace holding the step counter
and a record per step, written by our srun inside the job (`Book`) and read by the node daemon
from outside it (`read_records`). The daemon is root and the segment is the job user's: it is
copied out bounded by its real size and parsed only as a copy (`parse_book`, `fold`)."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Required, TypedDict, TypeGuard

from stasis.fdio import Iovec

_KEY = 0x53544550  # "STEP"; the IPC namespace is the job's own, so no other job sees it
_SIZE = 1 << 18
_MAGIC = 0x5354_5331
_HEADER = 16  # magic, next step id, bytes of records used, records dropped (u32 each)
_IPC_CREAT, _IPC_NOWAIT = 0o1000, 0o4000
_SHM_RDONLY = 0o10000
_LOCK_WAIT_S = 5
_STEPS_MAX = 1 << 31  # a step id fits Slurm's (u32, less its special values)
_EXIT_MAX = 255
_SIGNAL_MAX = 64

Where = Literal["stasis", "slurm"]  # who runs the step: us, in the job's tree, or Slurm's srun


class _StepFacts(TypedDict, total=False):
    name: str  # ours: Slurm's name for it (-J, else its program's)
    ntasks: int  # ours
    reason: str  # Slurm's: why it was handed to Slurm's srun


class StepStart(_StepFacts):
    """What our srun records as a step starts (under its step id)."""

    where: Where
    argv: list[str]  # srun's arguments


class StepRecord(_StepFacts, total=False):
    """A step as a book tells it (`fold`), its end folded in. Only `step` is sure to be there:
    the book is the job user's to write, so a value of another type than this says is left out,
    and exit and signal are bounded to what a task can have."""

    step: Required[int]
    where: Where
    argv: list[str]
    exit: int  # srun's exit code; absent: still running, or handed to Slurm's srun
    signal: int  # what killed the task that gave the exit code, 0 for none


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_record(line: bytes) -> StepRecord | None:
    """One line of a book as a record (its start or its end); None for a line that is none:
    cut short (read while written), not JSON, not an object, or without a step id in range."""
    try:
        raw: Any = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested without end
        return None
    if not isinstance(raw, dict):
        return None
    step = raw.get("step")
    if not _is_int(step) or not 0 <= step < _STEPS_MAX:
        return None
    rec = StepRecord(step=step)
    where = raw.get("where")
    if where == "stasis" or where == "slurm":
        rec["where"] = where
    argv = raw.get("argv")
    if isinstance(argv, list) and all(isinstance(a, str) for a in argv):
        rec["argv"] = argv
    ntasks = raw.get("ntasks")
    if _is_int(ntasks):
        rec["ntasks"] = max(1, ntasks)
    name, reason = raw.get("name"), raw.get("reason")
    if isinstance(name, str):
        rec["name"] = name
    if isinstance(reason, str):
        rec["reason"] = reason
    if "exit" in raw:  # an end: whatever its code says, the step ended
        code, sig = raw["exit"], raw.get("signal", 0)
        rec["exit"] = max(0, min(code, _EXIT_MAX)) if _is_int(code) else 1
        rec["signal"] = max(0, min(sig, _SIGNAL_MAX)) if _is_int(sig) else 0
    return rec


class _Sembuf(ctypes.Structure):
    _fields_ = [
        ("sem_num", ctypes.c_ushort),
        ("sem_op", ctypes.c_short),
        ("sem_flg", ctypes.c_short),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _shm_libc() -> ctypes.CDLL:
    """libc, with shmat and shmdt typed for 64-bit addresses."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
    libc.shmdt.argtypes = (ctypes.c_void_p,)
    libc.shmctl.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = (
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    )
    return libc


class Book:
    """The job's step counter and records: a SysV segment plus a semaphore as its lock.

    The records are JSON lines: a StepStart under its "step" when a step starts, {"step",
    "exit", "signal"} when one of ours ends (signal: what killed the task that gave the exit
    code, 0 for none). The node daemon reads them from outside (`read_records`, as
    StepRecords): stasis.slurm.mirrors records each step in Slurm."""

    def __init__(self) -> None:
        libc = _shm_libc()
        libc.semtimedop.argtypes = (
            ctypes.c_int,
            ctypes.POINTER(_Sembuf),
            ctypes.c_size_t,
            ctypes.POINTER(_Timespec),
        )
        self.libc = libc
        self.shm = self._check(libc.shmget(_KEY, _SIZE, _IPC_CREAT | 0o600), "shmget")
        self.sem = self._check(libc.semget(_KEY, 1, _IPC_CREAT | 0o600), "semget")

    @staticmethod
    def _check(result: int, what: str) -> int:
        if result < 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")
        return result

    def _locked(self, line: Callable[[int], str], new_step: bool) -> int:
        """Under the lock: the current step id (the next one when `new_step`, then counted),
        and `line(step)` appended to the records."""
        ops = (_Sembuf * 2)(
            _Sembuf(0, 0, 0), _Sembuf(0, 1, 0)
        )  # wait for 0, then take it: one atomic op
        wait = _Timespec(_LOCK_WAIT_S, 0)
        # A holder killed mid-update leaves the lock taken: after a while we go ahead anyway.
        self.libc.semtimedop(self.sem, ops, 2, ctypes.byref(wait))
        try:
            address = self._attach()
        except OSError:
            self._unlock()
            raise
        try:
            head = (ctypes.c_uint32 * 4).from_address(address)
            if head[0] != _MAGIC:
                head[0], head[1], head[2], head[3] = _MAGIC, 0, 0, 0
            step = int(head[1])
            if new_step:
                head[1] = step + 1
            text = (line(step) + "\n").encode()
            used = int(head[2])
            if _HEADER + used + len(text) <= _SIZE:
                ctypes.memmove(address + _HEADER + used, text, len(text))
                head[2] = used + len(text)
            else:
                head[3] += 1  # full: the step still counts, its record is dropped
            return step
        finally:
            self.libc.shmdt(address)
            self._unlock()

    def _attach(self) -> int:
        address = self.libc.shmat(self.shm, None, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"shmat: {os.strerror(ctypes.get_errno())}")
        return int(address)

    def _unlock(self) -> None:
        ops = (_Sembuf * 1)(_Sembuf(0, -1, _IPC_NOWAIT))
        self.libc.semtimedop(self.sem, ops, 1, None)

    def start(self, record: StepStart) -> int:
        """A new step: its id, with `record` kept under it."""
        return self._locked(lambda step: json.dumps({"step": step, **record}), new_step=True)

    def end(self, step: int, exit_code: int, sig: int = 0) -> None:
        self._locked(
            lambda _: json.dumps({"step": step, "exit": exit_code, "signal": sig}), new_step=False
        )

    def records(self) -> list[StepRecord]:
        """Each step, in order, with its exit code folded in ("exit" absent: still running,
        or handed to Slurm's srun)."""
        return fold(_used(self.libc, self.shm))


class BookRefused(Exception):
    """A segment under the book's key that is not a book this reader may trust (another owner,
    a header claiming more than the segment holds): its records are not read."""


class _IpcPerm(ctypes.Structure):
    # struct ipc_perm as the kernel's IPC_STAT fills it on 64-bit Linux (x86_64: a 16-bit mode
    # and padding; aarch64's 32-bit mode covers the same 4 bytes).
    _fields_ = [
        ("key", ctypes.c_int),
        ("uid", ctypes.c_uint32),
        ("gid", ctypes.c_uint32),
        ("cuid", ctypes.c_uint32),
        ("cgid", ctypes.c_uint32),
        ("mode", ctypes.c_uint16),
        ("pad1", ctypes.c_uint16),
        ("seq", ctypes.c_uint16),
        ("pad2", ctypes.c_uint16),
        ("unused1", ctypes.c_ulong),
        ("unused2", ctypes.c_ulong),
    ]


class _ShmidDs(ctypes.Structure):
    _fields_ = [
        ("shm_perm", _IpcPerm),
        ("shm_segsz", ctypes.c_size_t),
        ("shm_atime", ctypes.c_long),
        ("shm_dtime", ctypes.c_long),
        ("shm_ctime", ctypes.c_long),
        ("shm_cpid", ctypes.c_int),
        ("shm_lpid", ctypes.c_int),
        ("shm_nattch", ctypes.c_ulong),
        ("unused4", ctypes.c_ulong),
        ("unused5", ctypes.c_ulong),
    ]


_IPC_STAT = 2
# What IPC_STAT may write, with room to spare: a struct that were larger than ours would
# overwrite this buffer, never the daemon's memory beyond it.
_STAT_BUFFER = 512


@dataclass(frozen=True)
class SegmentStat:
    uid: int  # owner
    cuid: int  # creator
    size_bytes: int  # what it was created with (shm_segsz)


def segment_stat(libc: ctypes.CDLL, shm: int) -> SegmentStat:
    """IPC_STAT of segment `shm` of this thread's IPC namespace."""
    buf = ctypes.create_string_buffer(_STAT_BUFFER)
    if libc.shmctl(shm, _IPC_STAT, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"shmctl(IPC_STAT): {os.strerror(err)}")
    ds = _ShmidDs.from_buffer(buf)
    return SegmentStat(
        uid=int(ds.shm_perm.uid), cuid=int(ds.shm_perm.cuid), size_bytes=int(ds.shm_segsz)
    )


def _mapping_bytes(address: int) -> int:
    """The length of this process's mapping that starts at `address` (0: none). /proc/self/maps
    is the kernel's word for what shmat mapped: the segment a racing job may have swapped
    between IPC_STAT and shmat cannot make it larger."""
    with open("/proc/self/maps", "rb") as f:
        for line in f:
            start, _, rest = line.partition(b"-")
            try:
                if int(start, 16) == address:
                    return int(rest.split(b" ", 1)[0], 16) - address
            except ValueError:
                continue
    return 0


def _copy_out(libc: ctypes.CDLL, address: int, size: int) -> bytes:
    """`size` bytes at `address` in this process, copied by the kernel (process_vm_readv on
    ourselves): a page that cannot be read (past the end of the mapping, a hugetlb segment
    without pages left) ends the copy with EFAULT instead of killing the process with
    SIGSEGV or SIGBUS. Returns what could be read."""
    buf = ctypes.create_string_buffer(size)
    local = Iovec(ctypes.cast(buf, ctypes.c_void_p), size)
    remote = Iovec(address, size)
    n = libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if n < 0:
        err = ctypes.get_errno()
        if err == errno.EFAULT:
            return b""
        raise OSError(err, f"process_vm_readv: {os.strerror(err)}")
    return buf.raw[:n]


def _segment_bytes(libc: ctypes.CDLL, shm: int, limit: int) -> bytes:
    """At most `limit` bytes of segment `shm`, never more than its mapping holds, read without
    touching the mapping from Python (see `_copy_out`)."""
    address = libc.shmat(shm, None, _SHM_RDONLY)
    if address is None or address == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), f"shmat: {os.strerror(ctypes.get_errno())}")
    try:
        return _copy_out(libc, int(address), min(limit, _mapping_bytes(int(address))))
    finally:
        libc.shmdt(address)


def parse_book(data: bytes) -> bytes:
    """The records part of a book's bytes (header first): b"" for a segment that is no book
    (another magic: not written yet); BookRefused for a header that claims more records than
    the bytes hold."""
    if len(data) < _HEADER:
        raise BookRefused(f"a segment of {len(data)} bytes, shorter than a book's header")
    magic, _next, used, _dropped = struct.unpack_from("=4I", data)
    if magic != _MAGIC:
        return b""
    if used > len(data) - _HEADER:
        raise BookRefused(
            f"its header claims {used} bytes of records, the segment holds "
            f"{len(data) - _HEADER}"
        )
    return data[_HEADER : _HEADER + used]


def _used(libc: ctypes.CDLL, shm: int) -> bytes:
    size = segment_stat(libc, shm).size_bytes
    return parse_book(_segment_bytes(libc, shm, min(size, _SIZE)))


def fold(data: bytes) -> list[StepRecord]:
    """The records of a book, a step each, in order, its end folded in ("exit" absent: still
    running, or handed to Slurm's srun). A line that is no record (`parse_record`) is skipped:
    the book is written by the job's user."""
    steps: dict[int, StepRecord] = {}
    for line in data.splitlines():
        rec = parse_record(line)
        if rec is None:
            continue
        n = rec["step"]
        if "exit" not in rec:
            steps[n] = rec
        elif n in steps:
            steps[n]["exit"] = rec["exit"]
            steps[n]["signal"] = rec.get("signal", 0)
    return [steps[n] for n in sorted(steps)]


def read_records(owner: int | None = None) -> list[StepRecord]:
    """The book of the IPC namespace this thread is in, read without its lock and without
    creating it (none yet: no step): for a reader outside the job (the node daemon).

    Everything in it is the job user's: a segment not owned by `owner` (a uid; None: anyone),
    or created by another user than them or root (CRIU, restoring it), is refused
    (BookRefused), and so is a header claiming more than the segment holds; at most its real
    size (and a book's) is copied out, and only the copy is parsed."""
    libc = _shm_libc()
    shm = libc.shmget(_KEY, 0, 0)
    if shm < 0:
        if ctypes.get_errno() == errno.ENOENT:
            return []
        raise OSError(ctypes.get_errno(), f"shmget: {os.strerror(ctypes.get_errno())}")
    st = segment_stat(libc, shm)
    # A restored job's book was created by CRIU (root), which gave it back its owner.
    if owner is not None and (st.uid != owner or st.cuid not in (owner, 0)):
        raise BookRefused(
            f"its segment is owned by uid {st.uid} and was created by uid "
            f"{st.cuid}, not by the job's user (uid {owner})"
        )
    return fold(parse_book(_segment_bytes(libc, shm, min(st.size_bytes, _SIZE))))
