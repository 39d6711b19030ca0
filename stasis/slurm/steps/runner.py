"""Running a step here, as srun would: its tasks are our children (so part of the job's
checkpointed tree), with srun's environment, output files, labels, signals, time limit and
exit code."""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import time

from stasis.slurm.steps.parse import Plan

# Set in the tasks we start: a nested srun sees it is inside one of our steps.
OUR_STEP_VAR = "STASIS_STEP_ID"

_FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
    signal.SIGALRM,
)
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
        "j": job,
        "J": f"{job}.{step}",
        "s": str(step),
        "t": str(task),
        "n": "0",
        "N": env.get("SLURMD_NODENAME", ""),
        "u": env.get("SLURM_JOB_USER", env.get("USER", "")),
        "x": env.get("SLURM_JOB_NAME", ""),
        "A": env.get("SLURM_ARRAY_JOB_ID", job),
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
    out.update(
        {
            "SLURM_STEP_ID": str(step),
            "SLURM_STEPID": str(step),
            OUR_STEP_VAR: str(step),
            "SLURM_NTASKS": n,
            "SLURM_NPROCS": n,
            "SLURM_STEP_NUM_TASKS": n,
            "SLURM_STEP_NUM_NODES": "1",
            "SLURM_NNODES": "1",
            "SLURM_NODEID": "0",
            "SLURM_STEP_NODELIST": node,
            "SLURM_NODELIST": node,
            "SLURM_STEP_TASKS_PER_NODE": n,
            "SLURM_TASKS_PER_NODE": n,
            "SLURM_GTIDS": ",".join(str(i) for i in range(p.ntasks)),
        }
    )
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

    def __init__(self, p: Plan, env: dict[str, str], step: int, err: int = 2) -> None:
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
            env = {
                **base,
                "SLURM_PROCID": str(task),
                "SLURM_LOCALID": str(task),
                "SLURM_TASK_PID": str(os.getpid()),
            }
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
                    os.write(
                        self.err,
                        f"srun: error: *** STEP {job}.{self.step} ON {self.node} "
                        "CANCELLED DUE TO TIME LIMIT ***\n".encode(),
                    )
                    self._kill_all(signal.SIGTERM)
                    term_at = ran_s
                elif term_at is not None and ran_s >= term_at + _KILL_WAIT_S:
                    self._kill_all(signal.SIGKILL)
            self._reap()
            if (
                not killed
                and self.p.kill_on_bad_exit
                and any(_status_code(s) != 0 for s in self.status.values())
                and self.tasks
            ):
                bad = next(t for t, s in self.status.items() if _status_code(s) != 0)
                self.say(
                    f"error: task {bad} failed: killing the step's other tasks "
                    "(--kill-on-bad-exit)"
                )
                self._kill_all(signal.SIGKILL)
                killed = True
            if not self.tasks:
                if not self.pipes:
                    break
                drain_until = drain_until or time.monotonic() + _DRAIN_S
                if time.monotonic() >= drain_until:
                    break
            timeout_ms = (
                None
                if drain_until is None
                else max(0, int((drain_until - time.monotonic()) * 1000))
            )
            if limit is not None and self.tasks:
                timeout_ms = (
                    int(_TICK_S * 1000)
                    if timeout_ms is None
                    else min(timeout_ms, int(_TICK_S * 1000))
                )
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
