"""`srun` steps of an opted-in job: the ones that stay on the job's node run inside its tree.

The launcher puts `<lib_dir>/bin` (holding our `srun`, which runs `main()`) first on the
workload's PATH. A batch script's `srun ...` then comes here, inside the job's PID and IPC
namespaces, and:

  - a step that stays on this node (one node, its tasks within the job's CPUs here, no MPI
    plugin, only options understood below) is run by us: its tasks are our children, so they
    are part of the checkpointed tree, resume with it, and a step that ended before a
    checkpoint is never run again (the restored script goes on after it);
  - any other step is handed to Slurm's own srun (exec'd by absolute path), with one line in
    the job's output saying why. Its tasks run outside the tree, so while it runs a checkpoint
    would capture a client talking to a step that is gone after the restore:
    `real_srun_running()` finds such steps and the callers refuse the checkpoint.

Step ids are the order of `srun` calls in the job (0, 1, ...: both kinds count), kept with a
record per step (argv, where it ran, exit code) in a SysV segment of the job's own IPC
namespace: CRIU checkpoints it with the job, so a restored job numbers its later steps as the
first run did. `srun --stasis-steps` prints the records (JSON lines) from inside the job. The
node daemon reads them from outside and records each of our steps in Slurm as well, for sacct
(stasis.slurm.mirrors).

What we run mimics srun: each task gets the environment srun gives (SLURM_STEP_ID, SLURM_PROCID,
SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS ...), the batch step's stdout/stderr (or -o/-e files,
%j %s %t ... expanded), `-l` labels, `--kill-on-bad-exit`, signals forwarded, and srun's exit
code: the highest of the tasks' (128+N for a task killed by signal N), and `-t` (counted in run
time: not the time the job spent checkpointed and requeued). Resource options that Slurm would
enforce per step (--mem, --cpu-bind, --exclusive, ...) are accepted and not enforced: the job's
own limits apply. Steps running at once are not queued for CPUs.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

# Set by the launcher in the workload's environment: the job whose tree this is, and Slurm's
# own srun.
STEPS_VAR = "STASIS_SLURM_STEPS"
REAL_SRUN_VAR = "STASIS_REAL_SRUN"
# `STASIS_SRUN=slurm srun ...` hands a step to Slurm's srun on purpose.
OPT_OUT_VAR = "STASIS_SRUN"
# Set in the tasks we start: a nested srun sees it is inside one of our steps.
OUR_STEP_VAR = "STASIS_STEP_ID"
SRUN_NAME = "srun"
LIST_OPTION = "--stasis-steps"

NONE, REQUIRED, OPTIONAL = 0, 1, 2
# long name -> (short letter or "", argument). Anything else goes to Slurm's srun.
OPTIONS: dict[str, tuple[str, int]] = {
    "ntasks": ("n", REQUIRED),
    "cpus-per-task": ("c", REQUIRED),
    "nodes": ("N", REQUIRED),
    "ntasks-per-node": ("", REQUIRED),
    "nodelist": ("w", REQUIRED),
    "exclude": ("x", REQUIRED),
    "label": ("l", NONE),
    "output": ("o", REQUIRED),
    "error": ("e", REQUIRED),
    "input": ("i", REQUIRED),
    "open-mode": ("", REQUIRED),
    "job-name": ("J", REQUIRED),
    "export": ("", REQUIRED),
    "chdir": ("D", REQUIRED),
    "kill-on-bad-exit": ("K", OPTIONAL),
    "mpi": ("", REQUIRED),
    "jobid": ("", REQUIRED),
    "overcommit": ("O", NONE),
    "time": ("t", REQUIRED),
    "unbuffered": ("u", NONE),
    # Accepted, not enforced (see the module docstring).
    "mem": ("", REQUIRED),
    "mem-per-cpu": ("", REQUIRED),
    "mem-bind": ("", REQUIRED),
    "cpu-bind": ("", REQUIRED),
    "hint": ("", REQUIRED),
    "distribution": ("m", REQUIRED),
    "exclusive": ("", OPTIONAL),
    "overlap": ("", NONE),
    "exact": ("", NONE),
    "whole": ("", NONE),
    "oversubscribe": ("s", NONE),
    "quiet": ("Q", NONE),
    "verbose": ("v", NONE),
    "disable-status": ("X", NONE),
}
_SHORT = {short: name for name, (short, _) in OPTIONS.items() if short}
# srun's own `-q` is --qos; it takes an argument we do not want: not listed, so handed off.


class Handoff(Exception):
    """This step goes to Slurm's srun; `reason` says why (one line for the job's output).
    `quiet`: bad usage that Slurm's srun reports better than we would."""

    def __init__(self, reason: str, quiet: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.quiet = quiet


@dataclass
class Step:
    """One srun call as parsed: the options we act on, and the command."""

    command: list[str]
    options: dict[str, str] = field(default_factory=dict)  # long name -> value ("" for flags)


def parse(args: list[str]) -> Step:
    """srun's command line as getopt_long reads it (options stop at the first word that is not
    one, or at `--`); raises Handoff for an option we do not handle or bad usage."""
    options: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if name not in OPTIONS:
                raise Handoff(f"option --{name} is not handled by stasis")
            kind = OPTIONS[name][1]
            if kind == NONE and eq:
                raise Handoff(f"option --{name} takes no value", quiet=True)
            if kind == REQUIRED and not eq:
                i += 1
                if i >= len(args):
                    raise Handoff(f"option --{name} needs a value", quiet=True)
                value = args[i]
            options[name] = value
            i += 1
            continue
        if arg.startswith("-") and len(arg) > 1:
            j = 1
            while j < len(arg):
                letter = arg[j]
                if letter not in _SHORT:
                    raise Handoff(f"option -{letter} is not handled by stasis")
                name = _SHORT[letter]
                kind = OPTIONS[name][1]
                rest = arg[j + 1:]
                if kind == NONE:
                    options[name] = ""
                    j += 1
                    continue
                if kind == OPTIONAL:
                    options[name] = rest
                elif rest:
                    options[name] = rest
                else:
                    i += 1
                    if i >= len(args):
                        raise Handoff(f"option -{letter} needs a value", quiet=True)
                    options[name] = args[i]
                break
            i += 1
            continue
        break
    command = args[i:]
    if not command:
        raise Handoff("no command", quiet=True)
    return Step(command, options)


# -- what the step asks of the node ------------------------------------------------------------

@dataclass
class Plan:
    """A step we run here: its tasks, their environment, where their output goes."""

    command: list[str]
    ntasks: int
    cpus_per_task: int | None
    label: bool = False
    output: str | None = None
    error: str | None = None
    input: str | None = None
    append: bool = False
    name: str = ""
    export: str = "ALL"
    chdir: str | None = None
    kill_on_bad_exit: bool = False
    time_limit_s: float | None = None


def _count(value: str, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise Handoff(f"{what} {value!r} is not a number", quiet=True) from None
    if n < 1:
        raise Handoff(f"{what} {value!r} must be at least 1", quiet=True)
    return n


def _node_range(value: str) -> tuple[int, int]:
    low, _, high = value.partition("-")
    first = _count(low, "--nodes")
    return first, _count(high, "--nodes") if high else first


def _names(hostlist: str) -> list[str] | None:
    """Plain comma-separated host names; None for a hostlist expression (n[1-3]) or a file."""
    if any(c in hostlist for c in "[]/"):
        return None
    return [n for n in hostlist.split(",") if n]


def plan(step: Step, env: dict[str, str], mpi_default: str | None = None) -> Plan:
    """Whether `step` stays on this node, and how to run it; raises Handoff otherwise.

    `mpi_default` is Slurm's MpiDefault (asked of scontrol when None and the step names no
    --mpi)."""
    o = step.options
    node = env.get("SLURMD_NODENAME", "")
    job = env.get("SLURM_JOB_ID", "")
    if o.get("jobid") is not None and o["jobid"] != job:
        raise Handoff(f"the step runs in another job ({o['jobid']})")
    job_nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
    ntasks = (_count(o["ntasks"], "--ntasks") if "ntasks" in o else
              _count(o["ntasks-per-node"], "--ntasks-per-node") if "ntasks-per-node" in o else
              _count(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or "1", "SLURM_NTASKS"))
    if "ntasks-per-node" in o and ntasks > _count(o["ntasks-per-node"], "--ntasks-per-node"):
        raise Handoff(f"{ntasks} tasks at {o['ntasks-per-node']} per node")
    if "nodes" in o:
        low, high = _node_range(o["nodes"])
        if low > 1 or (high > 1 and job_nodes > 1):
            raise Handoff(f"the step asks for {o['nodes']} nodes")
        nodes = 1
    else:
        nodes = min(job_nodes, ntasks)
    if "nodelist" in o:
        names = _names(o["nodelist"])
        if names != [node]:
            raise Handoff(f"the step names nodes {o['nodelist']}")
    elif nodes > 1 and "ntasks" not in o:
        raise Handoff(f"the job has {job_nodes} nodes and the step asks for no single one")
    elif nodes > 1:
        raise Handoff(f"{ntasks} tasks over the job's {job_nodes} nodes")
    if "exclude" in o:
        names = _names(o["exclude"])
        if names is None or node in names:
            raise Handoff(f"the step excludes nodes {o['exclude']}")
    cpt_text = o.get("cpus-per-task") or env.get("SRUN_CPUS_PER_TASK")
    cpus_per_task = _count(cpt_text, "--cpus-per-task") if cpt_text else None
    cpus_here = env.get("SLURM_CPUS_ON_NODE", "")
    if cpus_here.isdigit() and "overcommit" not in o:
        wanted = ntasks * (cpus_per_task or 1)
        if wanted > int(cpus_here):
            raise Handoff(f"{ntasks} task(s) x {cpus_per_task or 1} CPU(s) is more than the "
                          f"job's {cpus_here} CPU(s) on this node")
    mpi = o.get("mpi") or env.get("SLURM_MPI_TYPE")
    if mpi is None:
        mpi = mpi_default if mpi_default is not None else _mpi_default()
    if mpi != "none":
        raise Handoff(f"MPI plugin {mpi}")
    mode = o.get("open-mode", "truncate")
    if mode not in ("append", "truncate", "a", "t"):
        raise Handoff(f"--open-mode {mode!r}", quiet=True)
    inp = o.get("input")
    if inp is not None and inp != "none" and (inp == "all" or inp.isdigit()):
        raise Handoff(f"--input {inp}")
    # As srun: SLURM_EXPORT_ENV (which sbatch --export=... leaves in the batch environment) is
    # the default of --export.
    export = o.get("export") or env.get("SLURM_EXPORT_ENV") or "ALL"
    kill = o.get("kill-on-bad-exit")
    limit = time_limit_s(o["time"]) if "time" in o else None
    return Plan(
        command=step.command, ntasks=ntasks, cpus_per_task=cpus_per_task,
        label="label" in o, output=o.get("output"), error=o.get("error"), input=inp,
        append=mode.startswith("a"), name=o.get("job-name", ""), export=export,
        chdir=o.get("chdir"), kill_on_bad_exit=kill is not None and kill != "0",
        time_limit_s=limit)


def time_limit_s(text: str) -> float | None:
    """Slurm's time formats (minutes, m:s, h:m:s, d-h, d-h:m, d-h:m:s) in seconds; None for no
    limit (0, -1, INFINITE, UNLIMITED)."""
    if text.upper() in ("INFINITE", "UNLIMITED", "-1", "0"):
        return None
    days, dash, rest = text.partition("-")
    if not dash:
        days, rest = "0", text
    parts = rest.split(":")
    if not (days.isdigit() and 1 <= len(parts) <= 3 and all(x.isdigit() for x in parts)):
        raise Handoff(f"--time {text!r} is not a time", quiet=True)
    values = [int(x) for x in parts]
    if dash:  # d-h, d-h:m, d-h:m:s
        values += [0] * (3 - len(values))
        h, m, sec = values
    elif len(values) == 1:  # minutes
        h, m, sec = 0, values[0], 0
    elif len(values) == 2:  # minutes:seconds
        h, m, sec = 0, values[0], values[1]
    else:
        h, m, sec = values
    total = ((int(days) * 24 + h) * 60 + m) * 60 + sec
    return float(total) if total > 0 else None


def _mpi_default() -> str:
    """Slurm's MpiDefault: a step that would get an MPI plugin from it is not ours to run."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise Handoff(f"cannot ask Slurm for its MpiDefault ({e})") from None
    m = re.search(r"^MpiDefault\s*=\s*(\S+)", out, re.M)
    # Slurm 24.11 prints MpiDefault=none as "(null)".
    return m.group(1) if m and m.group(1) != "(null)" else "none"


# -- the step's records, in the job's IPC namespace --------------------------------------------

_KEY = 0x53544550  # "STEP"; the IPC namespace is the job's own, so no other job sees it
_SIZE = 1 << 18
_MAGIC = 0x5354_5331
_HEADER = 16  # magic, next step id, bytes of records used, records dropped (u32 each)
_IPC_CREAT, _IPC_NOWAIT = 0o1000, 0o4000
_SHM_RDONLY = 0o10000
_LOCK_WAIT_S = 5


class _Sembuf(ctypes.Structure):
    _fields_ = [("sem_num", ctypes.c_ushort), ("sem_op", ctypes.c_short),
                ("sem_flg", ctypes.c_short)]


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
    libc.process_vm_readv.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                                      ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong)
    return libc


class Book:
    """The job's step counter and records: a SysV segment plus a semaphore as its lock.

    The records are JSON lines: {"step", "where" (stasis|slurm), "argv", "name", "reason"} when
    a step starts, {"step", "exit", "signal"} when one of ours ends (signal: what killed the task
    that gave the exit code, 0 for none). The node daemon reads them from outside
    (`read_records`): stasis.slurm.mirrors records each step in Slurm."""

    def __init__(self) -> None:
        libc = _shm_libc()
        libc.semtimedop.argtypes = (ctypes.c_int, ctypes.POINTER(_Sembuf), ctypes.c_size_t,
                                    ctypes.POINTER(_Timespec))
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
        ops = (_Sembuf * 2)(_Sembuf(0, 0, 0), _Sembuf(0, 1, 0))  # wait for 0, then take it: one atomic op
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

    def start(self, record: dict[str, object]) -> int:
        """A new step: its id, with `record` kept under it."""
        return self._locked(lambda step: json.dumps({"step": step, **record}), new_step=True)

    def end(self, step: int, exit_code: int, sig: int = 0) -> None:
        self._locked(lambda _: json.dumps({"step": step, "exit": exit_code, "signal": sig}),
                     new_step=False)

    def records(self) -> list[dict[str, object]]:
        """Each step, in order, with its exit code folded in ("exit" absent: still running,
        or handed to Slurm's srun)."""
        return fold(_used(self.libc, self.shm))


class BookRefused(Exception):
    """A segment under the book's key that is not a book this reader may trust (another owner,
    a header claiming more than the segment holds): its records are not read."""


class _IpcPerm(ctypes.Structure):
    # struct ipc_perm as the kernel's IPC_STAT fills it on 64-bit Linux (x86_64: a 16-bit mode
    # and padding; aarch64's 32-bit mode covers the same 4 bytes).
    _fields_ = [("key", ctypes.c_int), ("uid", ctypes.c_uint32), ("gid", ctypes.c_uint32),
                ("cuid", ctypes.c_uint32), ("cgid", ctypes.c_uint32),
                ("mode", ctypes.c_uint16), ("pad1", ctypes.c_uint16),
                ("seq", ctypes.c_uint16), ("pad2", ctypes.c_uint16),
                ("unused1", ctypes.c_ulong), ("unused2", ctypes.c_ulong)]


class _ShmidDs(ctypes.Structure):
    _fields_ = [("shm_perm", _IpcPerm), ("shm_segsz", ctypes.c_size_t),
                ("shm_atime", ctypes.c_long), ("shm_dtime", ctypes.c_long),
                ("shm_ctime", ctypes.c_long), ("shm_cpid", ctypes.c_int),
                ("shm_lpid", ctypes.c_int), ("shm_nattch", ctypes.c_ulong),
                ("unused4", ctypes.c_ulong), ("unused5", ctypes.c_ulong)]


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


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
    return SegmentStat(uid=int(ds.shm_perm.uid), cuid=int(ds.shm_perm.cuid),
                       size_bytes=int(ds.shm_segsz))


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
    local = _Iovec(ctypes.cast(buf, ctypes.c_void_p), size)
    remote = _Iovec(address, size)
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
        raise BookRefused(f"its header claims {used} bytes of records, the segment holds "
                          f"{len(data) - _HEADER}")
    return data[_HEADER:_HEADER + used]


def _used(libc: ctypes.CDLL, shm: int) -> bytes:
    size = segment_stat(libc, shm).size_bytes
    return parse_book(_segment_bytes(libc, shm, min(size, _SIZE)))


def fold(data: bytes) -> list[dict[str, object]]:
    """The records of a book, a step each, in order, its end folded in ("exit" absent: still
    running, or handed to Slurm's srun). A line cut short (read while written) is skipped, and
    so is any line that is not a record: the book is written by the job's user."""
    steps: dict[int, dict[str, object]] = {}
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested without end
            continue
        if not isinstance(rec, dict):
            continue
        n = rec.get("step")
        if type(n) is not int or not 0 <= n < 1 << 31:
            continue
        if "exit" in rec and n in steps:
            steps[n]["exit"] = rec["exit"]
            steps[n]["signal"] = rec.get("signal", 0)
        elif "exit" not in rec:
            steps[n] = rec
    return [steps[n] for n in sorted(steps)]


def read_records(owner: int | None = None) -> list[dict[str, object]]:
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
        raise BookRefused(f"its segment is owned by uid {st.uid} and was created by uid "
                          f"{st.cuid}, not by the job's user (uid {owner})")
    return fold(parse_book(_segment_bytes(libc, shm, min(st.size_bytes, _SIZE))))


# -- Slurm's own srun ---------------------------------------------------------------------------

def find_real_srun(path: str, ours: str) -> str | None:
    """Slurm's srun on `path`, skipping the directory `ours` (and any other srun of ours)."""
    skip = os.path.realpath(ours) if ours else ""
    for d in path.split(os.pathsep):
        if not d or (skip and os.path.realpath(d) == skip):
            continue
        candidate = os.path.join(d, SRUN_NAME)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate) and \
                not _is_ours(candidate):
            return candidate
    return None


def _is_ours(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"stasis.slurm.steps" in f.read(512)
    except OSError:
        return False


_CMDLINE_MAX = 4096


def real_srun_running(pid: int) -> list[str]:
    """The command lines of Slurm's own srun processes among the descendants of `pid`: steps
    whose tasks run outside the tree, so a checkpoint now would restore a dead client."""
    from stasis.engine import proctree

    found = []
    for p in proctree.tree(pid)[1:]:
        try:
            exe = os.readlink(f"/proc/{p}/exe")
            with open(f"/proc/{p}/cmdline", "rb") as f:
                # The daemon reads it too: a job's command line may be megabytes long, the
                # refusal shows 120 characters of it.
                cmdline = f.read(_CMDLINE_MAX)
        except OSError:
            continue
        if os.path.basename(exe.removesuffix(" (deleted)")) != SRUN_NAME:
            continue
        command = " ".join(c.decode(errors="replace") for c in cmdline.split(b"\0") if c)
        if command not in found:  # srun forks a helper with the same command line
            found.append(command)
    return found


def refusal(commands: list[str]) -> str:
    """Why a checkpoint is refused while Slurm's srun runs `commands` (one line)."""
    shown = "; ".join(c if len(c) <= 120 else c[:117] + "..." for c in commands[:3])
    more = f" (+{len(commands) - 3} more)" if len(commands) > 3 else ""
    return (f"a step runs outside stasis ({shown}{more}): a checkpoint now could not restore it; "
            "try again when the step has ended")


# -- running a step here ------------------------------------------------------------------------

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2, signal.SIGCONT, signal.SIGALRM)
_PR_SET_PDEATHSIG = 1
# After the tasks exited, what they left on a label pipe is read for at most this long.
_DRAIN_S = 0.5
# A step's run time is counted in steps of at most this: time the job spent checkpointed and
# requeued (a jump of the clock when it is restored) is not run time.
_TICK_S = 1.0
# After the time limit's SIGTERM, SIGKILL this much later (Slurm's default KillWait).
_KILL_WAIT_S = 30.0


def expand(pattern: str, env: dict[str, str], step: int, task: int) -> str:
    """srun's filename patterns: %j %J %s %t %n %N %u %x %A %a %%, with an optional width."""
    job = env.get("SLURM_JOB_ID", "")
    values = {
        "j": job, "J": f"{job}.{step}", "s": str(step), "t": str(task), "n": "0",
        "N": env.get("SLURMD_NODENAME", ""), "u": env.get("SLURM_JOB_USER", env.get("USER", "")),
        "x": env.get("SLURM_JOB_NAME", ""), "A": env.get("SLURM_ARRAY_JOB_ID", job),
        "a": env.get("SLURM_ARRAY_TASK_ID", "4294967294"),
    }

    def one(m: re.Match[str]) -> str:
        if m.group(2) == "%":
            return "%"
        value = values[m.group(2)]
        width = m.group(1)
        return value.zfill(int(width)) if width and value.isdigit() else value

    return re.sub(r"%(\d*)([%jJstnNuxAa])", one, pattern)


def task_env(p: Plan, env: dict[str, str], step: int) -> dict[str, str]:
    """What every task of the step gets (SLURM_PROCID and co. are added per task)."""
    export = [e for e in p.export.split(",") if e]
    if not export or "ALL" in export:
        out = dict(env)
    else:
        # NONE or a list without ALL: only the job's SLURM_* variables and those named (no
        # PATH either, unless named: as srun, and then a bare command name is not found).
        out = {k: v for k, v in env.items() if k.startswith("SLURM")}
    for item in export:
        name, eq, value = item.partition("=")
        if name in ("ALL", "NONE"):
            continue
        if eq:
            out[name] = value
        elif name in env:
            out[name] = env[name]
    node = env.get("SLURMD_NODENAME", "")
    n = str(p.ntasks)
    out.update({
        "SLURM_STEP_ID": str(step), "SLURM_STEPID": str(step), OUR_STEP_VAR: str(step),
        "SLURM_NTASKS": n, "SLURM_NPROCS": n, "SLURM_STEP_NUM_TASKS": n,
        "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
        "SLURM_STEP_NODELIST": node, "SLURM_NODELIST": node,
        "SLURM_STEP_TASKS_PER_NODE": n, "SLURM_TASKS_PER_NODE": n,
        "SLURM_GTIDS": ",".join(str(i) for i in range(p.ntasks)),
    })
    if p.cpus_per_task is not None:
        out["SLURM_CPUS_PER_TASK"] = str(p.cpus_per_task)
    if p.chdir:
        out["PWD"] = p.chdir
    return out


def _status_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        names = {int(signal.SIGKILL): "Killed", int(signal.SIGTERM): "Terminated"}
        return names.get(sig) or signal.strsignal(sig) or f"signal {sig}"
    return f"Exited with exit code {os.waitstatus_to_exitcode(status)}"


class Runner:
    """Runs one step's tasks as our children and waits for them, the way srun would."""

    def __init__(self, p: Plan, env: dict[str, str], step: int,
                 err: int = 2) -> None:
        self.p = p
        self.env = env
        self.step = step
        self.err = err  # where srun's own messages go
        self.node = env.get("SLURMD_NODENAME", "") or "localhost"
        self.tasks: dict[int, int] = {}  # pid -> task
        self.status: dict[int, int] = {}  # task -> wait status
        self.pipes: dict[int, tuple[int, int]] = {}  # read fd -> (task, fd written to)
        self.partial: dict[int, bytes] = {}
        self.opened: dict[str, int] = {}
        self.signal = 0  # what killed the task that gave the exit code (0: it exited)

    def say(self, text: str) -> None:
        os.write(self.err, f"srun: {text}\n".encode())

    def _open_out(self, pattern: str | None, task: int, default: int) -> int:
        if pattern is None:
            return default
        if pattern == "none":
            pattern = "/dev/null"
        path = expand(pattern, self.env, self.step, task)
        if self.p.chdir and not os.path.isabs(path):
            path = os.path.join(self.p.chdir, path)
        if path not in self.opened:
            # O_APPEND also when truncating: CRIU then does not hold the file to its size.
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
            if not self.p.append:
                flags |= os.O_TRUNC
            self.opened[path] = os.open(path, flags, 0o644)
        return self.opened[path]

    def _open_in(self, task: int) -> int:
        pattern = self.p.input
        if pattern is None:
            return 0
        path = "/dev/null" if pattern == "none" else expand(pattern, self.env, self.step, task)
        if self.p.chdir and not os.path.isabs(path):
            path = os.path.join(self.p.chdir, path)
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def _spawn(self, task: int, base: dict[str, str]) -> None:
        out = self._open_out(self.p.output, task, 1)
        err = self._open_out(self.p.error, task, out if self.p.output is not None else 2)
        inp = self._open_in(task)
        fds = [inp, out, err]
        if self.p.label:
            for i, dest in ((1, out), (2, err)):
                r, w = os.pipe2(os.O_CLOEXEC)
                self.pipes[r] = (task, dest)
                fds[i] = w
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._child(task, base, fds, parent)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # it did so itself, or is gone already
        self.tasks[pid] = task
        if self.p.label:
            os.close(fds[1])
            os.close(fds[2])
        if inp != 0:
            os.close(inp)

    def _child(self, task: int, base: dict[str, str], fds: list[int], parent: int) -> None:
        try:
            os.setpgid(0, 0)  # its own group: our forwarded signals reach what it starts
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:
                os._exit(137)
            signal.set_wakeup_fd(-1)
            for sig in (*_FORWARDED, signal.SIGCHLD, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            for target, fd in enumerate(fds):
                if fd != target:
                    os.dup2(fd, target)
                else:
                    os.set_inheritable(fd, True)
            os.closerange(3, 65536)
            if self.p.chdir:
                os.chdir(self.p.chdir)
            env = {**base, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task),
                   "SLURM_TASK_PID": str(os.getpid())}
            _exec(self.p.command, env)
        except OSError as e:
            os.write(2, f"srun: error: execve(): {self.p.command[0]}: {e.strerror}\n".encode())
        except BaseException:
            pass
        os._exit(2)

    def run(self) -> int:
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        for sig in (*_FORWARDED, signal.SIGCHLD):
            signal.signal(sig, lambda *_: None)
        base = task_env(self.p, self.env, self.step)
        try:
            for task in range(self.p.ntasks):
                self._spawn(task, base)
        except OSError as e:
            self.say(f"error: cannot start the step's tasks: {e}")
            self._kill_all(signal.SIGKILL)
        killed = False
        drain_until: float | None = None
        ran_s, last = 0.0, time.monotonic()
        term_at: float | None = None  # run time at which the time limit's SIGTERM went
        while True:
            now = time.monotonic()
            ran_s += min(max(0.0, now - last), 2 * _TICK_S)
            last = now
            limit = self.p.time_limit_s
            if limit is not None and self.tasks:
                if term_at is None and ran_s >= limit:
                    job = self.env.get("SLURM_JOB_ID", "")
                    os.write(self.err, f"srun: error: *** STEP {job}.{self.step} ON {self.node} "
                             "CANCELLED DUE TO TIME LIMIT ***\n".encode())
                    self._kill_all(signal.SIGTERM)
                    term_at = ran_s
                elif term_at is not None and ran_s >= term_at + _KILL_WAIT_S:
                    self._kill_all(signal.SIGKILL)
            self._reap()
            if not killed and self.p.kill_on_bad_exit and any(
                    _status_code(s) != 0 for s in self.status.values()) and self.tasks:
                bad = next(t for t, s in self.status.items() if _status_code(s) != 0)
                self.say(f"error: task {bad} failed: killing the step's other tasks "
                         "(--kill-on-bad-exit)")
                self._kill_all(signal.SIGKILL)
                killed = True
            if not self.tasks:
                if not self.pipes:
                    break
                drain_until = drain_until or time.monotonic() + _DRAIN_S
                if time.monotonic() >= drain_until:
                    break
            timeout_ms = None if drain_until is None else \
                max(0, int((drain_until - time.monotonic()) * 1000))
            if limit is not None and self.tasks:
                timeout_ms = int(_TICK_S * 1000) if timeout_ms is None else \
                    min(timeout_ms, int(_TICK_S * 1000))
            poller = select.poll()
            poller.register(wake_r, select.POLLIN)
            for fd in self.pipes:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(timeout_ms):
                if fd == wake_r:
                    self._signals(wake_r)
                else:
                    self._relay(fd)
        for fd in list(self.pipes):
            self._flush(fd)
            os.close(fd)
        for fd in self.opened.values():
            os.close(fd)
        signal.set_wakeup_fd(-1)
        os.close(wake_r)
        os.close(wake_w)
        return self._result()

    def _signals(self, fd: int) -> None:
        try:
            data = os.read(fd, 512)
        except BlockingIOError:
            return
        for num in data:
            if num != signal.SIGCHLD:
                self._kill_all(signal.Signals(num))

    def _kill_all(self, sig: signal.Signals) -> None:
        for pid in self.tasks:
            try:
                os.killpg(pid, sig)
            except OSError:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass

    def _reap(self) -> None:
        while self.tasks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.tasks.clear()
                return
            if pid == 0:
                return
            task = self.tasks.pop(pid, None)
            if task is None:
                continue
            self.status[task] = status
            # As Slurm ends a step: what a task left running in its group goes with it.
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    def _relay(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            self._flush(fd)
            os.close(fd)
            del self.pipes[fd]
            return
        task, dest = self.pipes[fd]
        buf = self.partial.pop(fd, b"") + data
        *lines, rest = buf.split(b"\n")
        if rest:
            self.partial[fd] = rest
        if lines:
            prefix = f"{task}: ".encode()
            _write_all(dest, b"".join(prefix + line + b"\n" for line in lines))

    def _flush(self, fd: int) -> None:
        rest = self.partial.pop(fd, b"")
        if rest and fd in self.pipes:
            task, dest = self.pipes[fd]
            _write_all(dest, f"{task}: ".encode() + rest + b"\n")

    def _result(self) -> int:
        code = 0
        for task in sorted(self.status):
            status = self.status[task]
            c = _status_code(status)
            if c != 0:
                self.say(f"error: {self.node}: task {task}: {_describe(status)}")
            if c > code:
                self.signal = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            code = max(code, c)
        missing = self.p.ntasks - len(self.status)
        return max(code, 1) if missing else code


def _exec(argv: list[str], env: dict[str, str]) -> None:
    """execve `argv`, a bare name looked up on the task's own PATH only (as slurmstepd: none
    there, not found)."""
    name = argv[0]
    if "/" in name:
        os.execve(name, argv, env)
    error: OSError = FileNotFoundError(2, os.strerror(2))
    for d in env.get("PATH", "").split(os.pathsep):
        if not d:
            continue
        try:
            os.execve(os.path.join(d, name), argv, env)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as e:
            error = e  # e.g. not executable: said unless found further on
    raise error


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            n = os.write(fd, data)
        except InterruptedError:
            continue
        except OSError:
            return  # the output is gone: the step's tasks are what matters
        data = data[n:]


# -- srun -----------------------------------------------------------------------------------------

def in_our_tree(env: dict[str, str]) -> bool:
    """Whether this srun runs inside an opted-in job's tree (the launcher said so, and we are in
    a PID namespace) and not in the task of a step Slurm started."""
    if not env.get(STEPS_VAR) or env.get(STEPS_VAR) != env.get("SLURM_JOB_ID"):
        return False
    if "SLURM_STEP_ID" in env and env.get(OUR_STEP_VAR) != env["SLURM_STEP_ID"]:
        return False
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    m = re.search(r"^NSpid:\s*(.*)$", status, re.M)
    return m is not None and len(m.group(1).split()) > 1


def _exec_real(args: list[str], env: dict[str, str]) -> NoReturn:
    ours = str(Path(sys.argv[0]).resolve().parent) if sys.argv and sys.argv[0] else ""
    real = env.get(REAL_SRUN_VAR, "")
    if not os.access(real, os.X_OK):  # e.g. restored on a node that has it elsewhere
        real = find_real_srun(env.get("PATH", ""), ours) or ""
    if not real:
        sys.stderr.write("srun: error: Slurm's srun is not installed on this node\n")
        sys.exit(1)
    sys.stderr.flush()
    try:
        os.execve(real, [SRUN_NAME, *args], env)
    except OSError as e:
        sys.stderr.write(f"srun: error: cannot run {real}: {e.strerror}\n")
        sys.exit(1)


def _book() -> Book | None:
    try:
        return Book()
    except (OSError, AttributeError) as e:
        sys.stderr.write(f"stasis: warning: no step records in this job ({e}); step ids "
                         "count from 0 in each srun\n")
        return None


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    env = dict(os.environ)
    if not in_our_tree(env):
        _exec_real(args, env)
    if args == [LIST_OPTION]:
        book = _book()
        for rec in book.records() if book else []:
            print(json.dumps(rec))
        sys.exit(0)
    book = _book()
    try:
        if env.get(OPT_OUT_VAR) == "slurm":
            raise Handoff(f"{OPT_OUT_VAR}=slurm")
        p = plan(parse(args), env)
    except Handoff as e:
        _start(book, {"where": "slurm", "argv": args, "reason": e.reason})
        if not e.quiet:
            sys.stderr.write(f"stasis: this srun step runs outside stasis ({e.reason}): "
                             "no checkpoint can be taken while it runs\n")
        _exec_real(args, env)
    # Slurm names a step after its program unless -J says otherwise.
    step = _start(book, {"where": "stasis", "argv": args, "ntasks": p.ntasks,
                         "name": p.name or os.path.basename(p.command[0])})
    runner = Runner(p, env, step)
    code = runner.run()
    if book:
        try:
            book.end(step, code, runner.signal)
        except OSError as e:
            sys.stderr.write(f"stasis: warning: step {step} not recorded: {e}\n")
    sys.exit(code)


def _start(book: Book | None, record: dict[str, object]) -> int:
    if book is None:
        return 0
    try:
        return book.start(record)
    except OSError as e:
        sys.stderr.write(f"stasis: warning: no step record ({e}); this step's id is 0\n")
        return 0


def install_dir(lib_dir: Path) -> Path:
    """Where install puts our srun: a directory of its own, so that putting it on the
    workload's PATH adds nothing else."""
    return lib_dir / "bin"
