"""The supervisor of one job: `python -m stasis.daemon.jobsupervisor JOB_DIR`.

The daemon starts one supervisor per job (with `--spare`: ahead of need, reading JOB_DIR from
stdin), in a session of its own, so that a job outlives a restart of the daemon and its exit
status is never lost: the supervisor is the job's parent, waits for it and
writes `exit.json` into the job's directory (atomically), whether or not a daemon is listening.

Two modes, read from the spec: the line after JOB_DIR on stdin (as a spare; it may hold the
job's --env values, so it never goes into a file), or `spec.json` in JOB_DIR:
  run      unshare a PID namespace and fork its init: with spec "private_tmp" (the size of
           each tmpfs) a mount namespace of its own with an empty /tmp and /var/tmp
           (engine/privatetmp.py); with spec "job_net" (a part of a job across nodes) its
           job's network and a devpts of its own in a mount namespace of its own
           (engine/privatepts.py); an IPC namespace of its own (SysV shared
           memory, semaphores and queues belong to the job, so CRIU can dump and restore them),
           setsid, drop to the job's user, stdin from /dev/null, stdout/stderr appended to the
           log, then exec stasis-init in front of the command (stasis-init.c: it forwards signals
           to the whole job, reaps, and lives as long as any process of the job does, so a
           program that daemonizes stays the job).
  restore  CRIU restores the images as the supervisor's child (rst_sibling), with stdout/stderr
           re-pointed at the job's log (inherit_fd), opened with the job user's rights; CRIU opens
           the job's files, cwd, mappings and socket addresses with those rights too (Owner).
           A lazy restore from a store has its lazy pages served by the daemon on a unix socket
           (spec "page_server"), which this process connects lazy-pages to, through a link
           that kills the job should the daemon die before all memory was back (instead of
           the kernel handing it zero pages: engine/lazylink.py). Spec "hold" (a full restore
           of compressed or encrypted images, decoded on their way in): the same, with the job
           resumed only once all its memory is back.
           Before that, the spec's "expect" (the checkpoint's restore_facts) is compared with
           this node (engine/nodefacts.py): a difference that refuses answers
           IncompatibleNodeError. A restore that fails, or that the daemon refuses (its b"no",
           or its pipe closed), is killed whole, then the ghost files its CRIU made are
           removed (engine/ghosts.py).

The first line on stdout is the daemon's answer: {"pid": N, ...} or {"error": {"type", "message"}}.
Before it, the job's pid goes into `pid.json` in JOB_DIR, so that a daemon killed before it recorded
the job finds and adopts it (beside `job.json`, the record the daemon wrote there before handing us
the spec); a daemon gone by the time we answer changes nothing for the job. The spec, the answer and
the files: stasis/daemon/supervisorwire.py.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import stat
import struct
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from stasis.daemon.supervisorwire import (
    EXIT_FILE,
    MEMORY_FILE,
    PID_FILE,
    ExitFile,
    Failed,
    JobNetSpec,
    MemoryFile,
    PidFile,
    Ran,
    Restored,
    RestoreSpec,
    RunSpec,
    Spec,
    note_killed,
    write,
)
from stasis.wire import WireError

if TYPE_CHECKING:
    from stasis.engine.ghosts import Ghosts

CLONE_NEWPID = 0x20000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _answer(payload: Ran | Restored | Failed) -> None:
    try:
        sys.stdout.write(json.dumps(payload) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        # The daemon died waiting for it: the job is ours to supervise all the same (its next
        # start finds it by pid.json, and exit.json must still be written when it ends).
        pass
    # Nobody reads further: drop the pipe so the daemon's read ends, and write nothing more.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def _note_pid(job_dir: Path, pid: int) -> None:
    """The job's tree, written before the daemon is answered: a daemon killed before it
    recorded the job finds it here at its next start (and adopts it, never restores it again)."""
    from stasis.engine import proctree

    try:
        write(job_dir, PID_FILE, PidFile(pid=pid, pid_start=proctree.start_time(pid)))
    except OSError:
        pass  # a full disk: the daemon's answer still records it; only a crash would miss it


def _error(kind: str, message: str) -> None:
    _answer(Failed(error=WireError(type=kind, message=message)))


def _write_exit(job_dir: Path, status: int) -> None:
    code = os.waitstatus_to_exitcode(status)
    write(
        job_dir,
        EXIT_FILE,
        ExitFile(exit_code=code if code >= 0 else 128 - code, signal=-code if code < 0 else None),
    )


def _wait_for(job_dir: Path, pid: int, lazy_pages: int | None = None, started: float = 0.0) -> None:
    """Reap everything (we are a subreaper) until `pid` itself ends; record its status, and
    when all memory of a lazily restored job was back (its lazy-pages process ended)."""
    while True:
        try:
            got, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        if got == lazy_pages:
            write(
                job_dir,
                MEMORY_FILE,
                MemoryFile(
                    all_memory_s=round(time.monotonic() - started, 4),
                    ok=os.waitstatus_to_exitcode(status) == 0,
                ),
            )
        if got == pid:
            _write_exit(job_dir, status)
            return


def _exec_job(spec: RunSpec, status_w: int) -> None:
    """In the namespace init (a fresh child): become the job, then exec stasis-init. Never
    returns."""
    try:
        os.umask(spec["umask"])  # the daemon's own (077) is not the job's business
        job_net = spec.get("job_net")
        if job_net:
            # A part of a job that spans nodes: in its cgroup before anything runs, in its job's
            # network (partcgroup.py, jobnet.py).
            from stasis.daemon import partcgroup

            partcgroup.join(Path(job_net["cgroup"]))
            _enter_netns(job_net["netns"])
        tmp_bytes = spec.get("private_tmp")
        if tmp_bytes:
            # First: every file of the job must be opened inside its mount namespace.
            from stasis.engine import privatetmp

            privatetmp.enter(tmp_bytes)
        if job_net:
            # Its MPI gives its ranks pseudo-terminals, whose numbers a restore needs again:
            # free only in a devpts of the part's own (engine/privatepts.py).
            from stasis.engine import privatepts

            privatepts.enter(new_namespace=not tmp_bytes)
        # While still root: a job cannot make its own (CRIU refuses nested IPC namespaces).
        _check(_libc.unshare(CLONE_NEWIPC), "unshare(CLONE_NEWIPC)")
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        if spec["uid"] != 0 or spec["gid"] != 0:
            os.setgroups(spec["groups"])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        log = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(spec["cwd"])
        # The init would only report this in the log, and the job would seem to have started:
        # the caller deserves to hear it now.
        _find_program(spec["command"][0], spec["env"].get("PATH", ""))
        argv = [spec["init"], "--", *spec["command"]]
        os.execve(spec["init"], argv, spec["env"])
    except OSError as e:
        where = f" ({e.filename})" if e.filename and e.filename != spec["command"][0] else ""
        os.write(status_w, f"{e.strerror or e}{where}".encode())
    except BaseException as e:  # whatever it is, the job did not start: say so
        os.write(status_w, f"{type(e).__name__}: {e}".encode())
    finally:
        os._exit(127)


def _enter_netns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), f"setns({path})")
    finally:
        os.close(fd)


def _find_program(prog: str, path: str) -> str:
    """Where execvp (in stasis-init) will find `prog`, checked as the job's user now: a regular,
    executable file whose interpreter (#!, or an ELF program's loader) exists. Raises OSError
    saying what is wrong, as execve would."""
    if "/" in prog:
        return _check_executable(prog, prog)
    denied = None
    for d in path.split(":"):
        candidate = os.path.join(d or ".", prog)
        try:
            return _check_executable(candidate, prog)
        except FileNotFoundError:
            continue
        except OSError as e:
            denied = denied or e  # execvp goes on looking, and reports EACCES at the end
    if denied is not None:
        raise denied
    raise FileNotFoundError(errno.ENOENT, "no such executable program on PATH", prog)


def _check_executable(path: str, prog: str, depth: int = 0) -> str:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such executable program", prog) from None
    if not stat.S_ISREG(st.st_mode) or not os.access(path, os.X_OK):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not an executable file"
        raise PermissionError(errno.EACCES, f"{what}, not a program it may run", path)
    interpreter = _interpreter(path)
    if interpreter and depth < 4:  # the kernel follows #! four levels deep
        try:
            _check_executable(interpreter, prog, depth + 1)
        except OSError as e:
            raise OSError(e.errno, f"its interpreter {interpreter}: {e.strerror}", path) from None
    return path


def _interpreter(path: str) -> str | None:
    """The program the kernel runs for `path`: its #! line's, or its ELF loader (PT_INTERP)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
            if head.startswith(b"#!"):
                words = head[2:].split(b"\n", 1)[0].split()
                return words[0].decode(errors="replace") if words else None
            if head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
                return None
            bits64, order = head[4] == 2, "<" if head[5] == 1 else ">"
            if bits64:
                (phoff,) = struct.unpack_from(order + "Q", head, 32)
                phentsize, phnum = struct.unpack_from(order + "HH", head, 54)
            else:
                (phoff,) = struct.unpack_from(order + "I", head, 28)
                phentsize, phnum = struct.unpack_from(order + "HH", head, 42)
            for i in range(min(phnum, 64)):
                f.seek(phoff + i * phentsize)
                ph = f.read(phentsize)
                if len(ph) < 16 or struct.unpack_from(order + "I", ph, 0)[0] != 3:  # PT_INTERP
                    continue
                if bits64:
                    (offset,) = struct.unpack_from(order + "Q", ph, 8)
                    (size,) = struct.unpack_from(order + "Q", ph, 32)
                else:
                    (offset,) = struct.unpack_from(order + "I", ph, 4)
                    (size,) = struct.unpack_from(order + "I", ph, 16)
                f.seek(offset)
                return f.read(min(size, 4096)).split(b"\0", 1)[0].decode(errors="replace")
    except (OSError, struct.error):
        return None  # not readable by the user (execute-only) or odd: let execve judge
    return None


def run(job_dir: Path, spec: RunSpec) -> None:
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(status_r)
        _exec_job(spec, status_w)
    os.close(status_w)
    failure = os.read(status_r, 4096)
    os.close(status_r)
    if failure:
        os.waitpid(pid, 0)
        _error("UsageError", f"cannot start {spec['command'][0]}: {failure.decode()}")
        return
    _note_pid(job_dir, pid)
    _answer(Ran(pid=pid))
    _wait_for(job_dir, pid)
    _remove_cgroup(spec.get("job_net"))


def _remove_cgroup(job_net: JobNetSpec | None) -> None:
    """A job part's cgroup goes with its tree."""
    if job_net:
        from stasis.daemon import partcgroup

        partcgroup.remove(Path(job_net["cgroup"]))


class _ResumeGate:
    """The daemon checks the images (and records the job) while CRIU restores: resume only on
    its "ok".

    post-restore comes once all memory is in place and before the tasks run any of their own
    code; a failure there makes CRIU kill them (a failed pre-resume would not stop the resume).
    The daemon's word is read as soon as it comes, from before CRIU starts: should it be "no"
    (the daemon's check refused the images) or its pipe close without one (the daemon died),
    whatever of the restore runs is killed at once, not at post-restore, which a lazy restore
    whose page server died with the daemon would never reach, and again until the restore is
    `over` (a CRIU started after a pass, as a lazy restore's fallback to a full one is).
    """

    def __init__(self) -> None:
        self._word: bytes | None = None
        self._said = threading.Event()
        self._over = threading.Event()
        threading.Thread(target=self._listen, name="stasis-gate", daemon=True).start()

    @property
    def refused(self) -> bool:
        return self._said.is_set() and self._word != b"ok"

    def over(self) -> None:
        """The restore returned or failed: nothing of it is left to kill."""
        self._over.set()

    def _listen(self) -> None:
        try:
            word = sys.stdin.buffer.readline().strip()
        except OSError:
            word = b""
        self._word = word
        self._said.set()
        if word != b"ok":
            while not self._over.is_set():
                _kill_children()
                self._over.wait(0.05)

    def __call__(self, script: str, _pid: int) -> bool:
        if script != "post-restore":
            return True
        self._said.wait()
        return self._word == b"ok"


def _kill_children() -> None:
    """SIGKILL every process under this one (a restore's CRIU, lazy-pages, restored tasks).

    Again and again until none is left (for up to 5 s): CRIU may be forking the restored tasks
    while the first pass runs, and one forked after it would stand half-restored forever, its
    restore never finished, keeping this supervisor and the job's `restoring` record alive (seen
    under load). Orphans come back to this process, the subreaper, for the next pass."""
    from stasis.engine import proctree

    proctree.kill_descendants()


def restore(job_dir: Path, spec: RestoreSpec) -> None:
    from stasis.engine.criu import CRIU, Owner
    from stasis.engine.ghosts import Ghosts
    from stasis.engine.restoring import restore_tree
    from stasis.errors import StasisError

    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    if spec.get("own_pts"):
        # Before any thread and any file of the job's: the tree comes back in this namespace,
        # its log opened in it (engine/privatepts.py).
        from stasis.engine import privatepts

        try:
            privatepts.enter(new_namespace=True)
        except OSError as e:
            _error("RestoreError", str(e))
            return
    # Listening from now on (after the namespace above: unshare wants one thread): a refusal
    # that comes before CRIU starts stops it starting.
    gate = _ResumeGate() if spec["gate"] else None
    criu = CRIU(spec["criu"], Path(spec["criu_log_dir"]))
    # Before CRIU runs, in its mount namespace: what it would leave should it be killed.
    ghosts = Ghosts(Path(spec["images"]), bool(spec.get("private_tmp")), spec["checkpoint"])
    started = time.monotonic()
    job_net = spec.get("job_net")
    if gate is not None and gate.refused:
        _error("RestoreError", "the restore was refused before CRIU started")
        return
    with _in_job_net(job_net) as netns_fd:
        try:
            result = restore_tree(
                criu,
                Path(spec["images"]),
                Owner(spec["uid"], spec["gid"], spec["groups"]),
                [(spec["image_log"], spec["log"])],
                spec["criu_log_name"],
                umask=spec["umask"],
                lazy=spec["lazy"],
                notify=gate,
                page_server=Path(spec["page_server"]) if spec.get("page_server") else None,
                stream=spec.get("stream", False),
                on_lost=lambda why: note_killed(job_dir, why),
                expect=spec["expect"],
                checkpoint=spec["checkpoint"],
                criu_version=spec["criu_version"],
                own_mounts=bool(spec.get("private_tmp")),
                external_files=spec.get("external_files"),
                caller_cgroups=netns_fd is not None,
                job_netns_fd=netns_fd,
            )
        except OSError as e:
            # Not CRIU's words: its socket, a file of the images (the job's output is a
            # RestoreError of its own).
            _failed(gate, ghosts)
            _error("RestoreError", f"the restore failed: {e}")
            return
        except StasisError as e:
            _failed(gate, ghosts)
            _error(type(e).__name__, str(e))
            return
        finally:
            if gate is not None:
                gate.over()
    _note_pid(job_dir, result.pid)
    _answer(
        Restored(
            pid=result.pid,
            duration_s=result.duration_s,
            lazy=result.lazy_pages is not None,
            fallback=result.fallback_reason,
            notes=result.notes,
        )
    )
    _wait_for(job_dir, result.pid, result.lazy_pages.pid if result.lazy_pages else None, started)
    _remove_cgroup(job_net)


@contextmanager
def _in_job_net(job_net: JobNetSpec | None) -> Iterator[int | None]:
    """For a part of a job that spans nodes: its job network's namespace on this node, open
    (CRIU restores the tree into it), and this process in the part's cgroup meanwhile, so that
    the tree CRIU forks is born there (CRIU leaves cgroups alone: caller_cgroups); back in
    its own cgroup after."""
    if not job_net:
        yield None
        return
    from stasis.daemon import partcgroup

    own = partcgroup.current(os.getpid())
    fd = os.open(job_net["netns"], os.O_RDONLY | os.O_CLOEXEC)
    try:
        partcgroup.join(Path(job_net["cgroup"]))
        yield fd
    finally:
        os.close(fd)
        if own is not None:
            partcgroup.join(own)


def _failed(gate: _ResumeGate | None, ghosts: Ghosts) -> None:
    """After a restore that failed: nothing of it left running, nor its ghost files."""
    if gate is not None:
        gate.over()
    _end_leftovers()
    ghosts.remove_left()  # its CRIU is gone


def _end_leftovers() -> None:
    """Kill and reap what a failed restore left: tasks CRIU had made before it gave up or was
    killed are our children (rst_sibling, and we are their subreaper). Left alone, they would
    run unverified and untracked, or stay zombies of the daemon once we exit."""
    _kill_children()
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _wait_for_job() -> tuple[Path, Spec] | None:
    """As a spare: import now what a restore needs, then wait for our job's directory and spec."""
    import importlib

    importlib.import_module("stasis.engine.restoring")
    importlib.import_module("stasis.engine.rpc").messages()
    importlib.import_module("stasis.engine.nodefacts").cpu()  # what a restore compares
    line = sys.stdin.buffer.readline().strip()
    spec = sys.stdin.buffer.readline()
    if not line or not spec:
        return None
    return Path(line.decode()), json.loads(spec)


def main() -> None:
    # Its files (exit.json, CRIU's restore log) are root's alone, whatever umask the daemon had
    # at the moment it started us (it narrows it briefly to create its socket).
    os.umask(0o077)
    # Its stderr is the daemon's: the same lines (what goes wrong only).
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s stasis %(levelname)s %(message)s"
    )
    spec: Spec
    if sys.argv[1:] == ["--spare"]:
        waited = _wait_for_job()
        if waited is None:
            return  # the daemon stopped without needing us
        job_dir, spec = waited
    else:
        job_dir = Path(sys.argv[1])
        spec = json.loads((job_dir / "spec.json").read_text())
    try:
        if spec["mode"] == "run":
            run(job_dir, spec)
        else:
            restore(job_dir, spec)
    except Exception as e:  # the daemon must get an answer, whatever happened
        _error("StasisError", f"job supervisor failed: {e}")


if __name__ == "__main__":
    main()
