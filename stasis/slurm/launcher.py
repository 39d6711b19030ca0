"""The launcher: what an opted-in job's batch task execs instead of the batch script.

The SPANK plugin swaps argv[0] for this program, so to Slurm it is the batch "shell": it gets the
`B:` signals, its exit code is the job's. It runs as the job's user and forks nothing but the
workload (its first child is the init of the job's PID namespace). By the mode the helper left in
STASIS_SLURM_START:

    fresh     fork the namespace init: setsid, exec tini -g -- <batch script>
    restored  adopt the restored namespace init (already our child: we are a subreaper)
    off       run the batch script as a plain child: stasis cannot protect this job
    held      run nothing: the helper could not tell whether the job has a checkpoint (store
              or node daemon unreachable) and requeued it held; Slurm kills us meanwhile

A fresh workload gets our `srun` (<lib_dir>/bin, stasis.slurm.steps) first on its PATH, so that
the steps that stay on this node run inside the tree (a restored one has its environment back).
Then it waits for the workload and
    SIGURG (preemption, or the time limit ahead; SIGUSR1 too)  asks the node daemon for a
              checkpoint; the daemon publishes it, kills the workload and requeues the job
    SIGTERM/INT/HUP/CONT/USR2                      forwarded to the workload
    STASIS_INTERVAL=<s>                             a leave-running checkpoint every <s> seconds
    STASIS_INTERVAL=auto                            ...every Young/Daly interval the daemon
              chooses (stasis.slurm.intervals), asked again after each checkpoint
    STASIS_INTERVAL=off (or 0)                      none, whatever the node's default
    no STASIS_INTERVAL                              the node's default (its `interval` setting:
              none, seconds or auto), which the daemon resolves when asked for "default"
A checkpoint is not asked for while a step handed to Slurm's own srun runs (its tasks are outside
the tree: the restored client would talk to a step that is gone): a line in the job's output says
so, and the job goes on. When the workload ends by itself, the launcher exits with its exit code and tells the daemon, which
retires the label's checkpoints only on a genuine success: exit 0, and no warning, stop signal
or stop checkpoint (failed or not) in this run.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

from stasis.client import Client
from stasis.config import interval_asked
from stasis.engine import privatetmp
from stasis.errors import DaemonAPIError, StasisError
from stasis.slurm import steps
from stasis.slurm.labels import INTERVAL_VARS
from stasis.slurm.partnames import RSH_NAME

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCONT, signal.SIGUSR2)
# The warning Slurm sends the batch step (cli_filter asks for URG: its default action is to be
# ignored, so an opted-in job that lands on a node without stasis runs on as without it; USR1
# is what jobs submitted before asked for).
WARNINGS = (signal.SIGURG, signal.SIGUSR1)
_PRIVATE = ("STASIS_SLURM_START", "STASIS_SLURM_SCRIPT")
# After the daemon requeued the job, Slurm kills us; if it does not, give up after this long.
_REQUEUE_WAIT_S = 300


# STASIS_INTERVAL=auto and the daemon cannot say (an older daemon, or down): asked again then.
_AUTO_FALLBACK_S = 3600.0


# A daemon that does not answer these in time is as good as down (a checkpoint has no bound).
_QUICK_S = 20.0
# The daemon died during a stop checkpoint: how long to wait for it to come back and say
# whether the checkpoint was taken (it then finishes the stop: kills the workload, requeues).
_SETTLE_WAIT_S = 120.0
# Signals that mean this run is being stopped (scancel, the grace time's end): its end is no
# genuine success, whatever the workload's exit code.
_STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def mpi_launch_env(agent: str, job_id: str) -> dict[str, str]:
    """What points Open MPI 4 (ORTE's rsh launcher), Open MPI 5 (PRRTE's, named ssh) and
    MPICH's Hydra at the launch agent `agent` instead of srun; each ignores the others'."""
    # Open MPI names a run after its launcher's host and pid, which is the same in every job
    # (a PID namespace of its own: mpirun is always its 3rd process), and keeps its rendezvous
    # files under a session directory of that name: a job whose earlier run (or another job)
    # was stopped at a checkpoint left them on the nodes, and PRRTE's daemons then lose their
    # launcher. A session tree of the Slurm job's own (the same again when it is restored).
    session = f"/tmp/stasis-mpi-{job_id}"
    return {
        "OMPI_MCA_orte_tmpdir_base": session,
        "PRTE_MCA_prte_tmpdir_base": session,
        "OMPI_MCA_plm": "rsh",
        "OMPI_MCA_plm_rsh_agent": agent,
        "OMPI_MCA_plm_rsh_no_tree_spawn": "1",
        "PRTE_MCA_plm": "ssh",
        "PRTE_MCA_plm_ssh_agent": agent,
        "PRTE_MCA_plm_ssh_no_tree_spawn": "1",
        "HYDRA_LAUNCHER": "ssh",
        "HYDRA_LAUNCHER_EXEC": agent,
        # UCX's shared memory (MPICH's ch4:ucx) opens a peer's segment at /proc/<its pid>/fd:
        # the pid in the part's own PID namespace, which the node's /proc does not name.
        # By name in /dev/shm instead.
        "UCX_POSIX_USE_PROC_LINK": "n",
    }


def say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class Launcher:
    def __init__(
        self, start: dict[str, Any], script: str, job_id: str, steps_dir: Path | None = None
    ) -> None:
        self.start = start
        self.steps_dir = steps_dir  # holds our srun
        self.script = script
        self.job_id = job_id
        self.mode: str = start.get("mode", "off")
        self.socket = Path(start["socket"]) if start.get("socket") else None
        self.pid = 0
        self.requeued = False  # the daemon took the final checkpoint and requeued the job
        # ...or left the requeue to Slurm, which makes it when this batch step ends (preempted)
        self.slurm_requeues = False
        self.interval_s = 0.0  # STASIS_INTERVAL: periodic leave-running checkpoints
        self.auto = False  # STASIS_INTERVAL=auto: the daemon chooses interval_s
        # What the daemon is asked for: "auto", seconds, "default" (the job asked for nothing:
        # the node's `interval` setting), or "" (no periodic checkpoints, nothing asked).
        self.requested = ""
        self.refused: list[str] = []  # the outside steps a periodic checkpoint was skipped for
        self.stopped = False  # warned (preemption, time limit) or told to stop in this run
        self.final_unknown = False  # the daemon went away while taking the stop checkpoint

    # -- the workload --------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _PRIVATE}
        if (
            self.mode == "fresh"
            and self.steps_dir is not None
            and os.access(self.steps_dir / steps.SRUN_NAME, os.X_OK)
        ):
            path = env.get("PATH", os.defpath)
            real = steps.find_real_srun(path, str(self.steps_dir))
            env["PATH"] = f"{self.steps_dir}{os.pathsep}{path}"
            env[steps.STEPS_VAR] = self.job_id
            if real:
                env[steps.REAL_SRUN_VAR] = real
            agent = self.steps_dir / RSH_NAME
            if self.start.get("spans_nodes") and os.access(agent, os.X_OK):
                # Its MPI starts its daemons on the other nodes through the launch agent, as
                # parts under their node daemons (stasis.slurm.rsh), not through srun as
                # slurmstepd's children, which no cut could take; what the job set stays.
                for name, value in mpi_launch_env(str(agent), self.job_id).items():
                    env.setdefault(name, value)
        return env

    def spawn(self) -> None:
        if self.mode == "restored":
            self.pid = int(self.start["pid"])
            return
        argv = [self.script]
        if self.mode == "fresh":
            argv = [self.start["tini"], "-g", "--", self.script]
        pid = os.fork()
        if pid == 0:
            try:
                for sig in (*FORWARDED, *WARNINGS, signal.SIGPIPE):
                    signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, set())
                if self.mode == "fresh":
                    os.setsid()  # inside the namespace: session ids stay in the dumped tree
                    # A job container's job: its stdin and output opened where CRIU can dump them.
                    privatetmp.reopen_in_namespace()
                os.execve(argv[0], argv, self._env())
            except OSError as e:
                os.write(2, f"stasis: cannot start {argv[0]}: {e}\n".encode())
            os._exit(127)
        self.pid = pid

    # -- the daemon ----------------------------------------------------------------------------

    def _client(self, timeout_s: float | None = _QUICK_S) -> Client:
        assert self.socket is not None
        return Client(self.socket, timeout_s)

    def register(self) -> None:
        if self.mode == "off":
            return
        asked, warning = interval_asked(_env_first(INTERVAL_VARS))
        try:
            with self._client() as c:
                c.slurm_register(
                    slurm_job=self.job_id,
                    pid=self.pid,
                    label=self.start["label"],
                    explicit_label=bool(self.start.get("explicit_label")),
                    restored_from=self.start.get("checkpoint"),
                )
        except StasisError as e:
            say(
                f"stasis: warning: the node daemon did not take this job ({e}); "
                "it runs WITHOUT checkpoint protection"
            )
            self.mode = "off"
            return
        if warning:
            say(f"stasis: warning: {warning}")
        if asked == "auto":
            self.auto = True
            self.interval_s = _AUTO_FALLBACK_S
            self.requested = "auto"
        elif asked is None:
            self.requested = "default"
        elif asked != "off":
            self.interval_s = float(asked)
            self.requested = f"{self.interval_s:.6f}".rstrip("0").rstrip(".")
        self.ask_interval()

    def ask_interval(self) -> None:
        """Tell the daemon the job's interval (shown by `stasis slurm intervals`); with `auto`
        or the node's default, take the one it chooses (said in the job's output when it
        changes)."""
        if not self.requested:
            return
        try:
            with self._client() as c:
                answer = c.slurm_interval(self.job_id, self.requested)
            chosen = float(answer["interval_s"])
        except (StasisError, KeyError, TypeError, ValueError) as e:
            if self.auto:
                say(
                    f"stasis: warning: the node daemon chose no checkpoint interval ({e}); "
                    f"the next periodic checkpoint comes in {self.interval_s:.0f} s"
                )
            return
        if self.requested == "default":
            # The node's default decides, at each ask (auto: re-estimated like the job's own).
            self.auto = answer.get("requested") == "auto"
            if chosen > 0 and round(chosen, 1) != round(self.interval_s, 1):
                say(f"stasis: checkpoint interval {chosen:.1f} s ({answer.get('why', '')})")
            self.interval_s = chosen if chosen > 0 else 0.0
            return
        if self.auto and chosen > 0:
            if round(chosen, 1) != round(self.interval_s, 1):
                say(f"stasis: checkpoint interval {chosen:.1f} s ({answer.get('why', '')})")
            self.interval_s = chosen

    def steps_outside(self, final: bool) -> bool:
        """Whether a step handed to Slurm's srun runs now (then no checkpoint: said why)."""
        try:
            running = steps.real_srun_running(self.pid)
        except OSError:
            running = []
        if not running:
            self.refused = []
            return False
        if final:
            say(
                f"stasis: warning: no checkpoint: {steps.refusal(running)}; the job goes on "
                "(if Slurm requeues it, it runs again from its last checkpoint, or from the "
                "start)"
            )
        else:
            if running != self.refused:  # once per step, not at every interval
                say(f"stasis: periodic checkpoint skipped: {steps.refusal(running)}")
            self.refused = running
        return True

    def checkpoint(self, final: bool) -> None:
        """Ask the daemon for a checkpoint; `final` stops the workload and requeues the job.

        Synchronous on purpose: a process that unshared its PID namespace cannot start threads,
        and must not fork anything but the workload. Signals that arrive meanwhile wait in the
        wakeup pipe.
        """
        try:
            with self._client(None) as c:
                answer = c.slurm_checkpoint(
                    self.job_id,
                    leave_running=not final,
                    reason="preemption or time limit" if final else "periodic",
                )
        except StasisError as e:
            if final and isinstance(e, DaemonAPIError) and e.status == 0:
                self.final_unknown = True  # it may have been taken: the daemon's restart says
            say(f"stasis: warning: checkpoint failed: {e}; the job goes on")
            return
        if final:
            self.requeued = True
            self.slurm_requeues = answer["slurm_requeues"]
            say(
                f"stasis: checkpoint {answer['checkpoint']} taken ({answer['size_bytes']} bytes, "
                f"{answer['duration_s']:.2f} s); the job is requeued and resumes from it"
            )
        else:
            say(f"stasis: periodic checkpoint {answer['checkpoint']} taken")

    def finish(self, code: int | None) -> None:
        if self.mode == "off":
            return
        try:
            with self._client() as c:
                answer = c.slurm_finish(self.job_id, code, stopped=self.stopped)
            if answer["retired"]:
                say(
                    f"stasis: job completed; retired {len(answer['retired'])} checkpoint(s) of "
                    f"label {self.start['label']}"
                )
        except StasisError as e:
            say(f"stasis: warning: could not tell the node daemon that the job ended: {e}")

    def taken_by_daemon(self) -> bool:
        """Whether the workload was stopped by a checkpoint someone else asked for (or ours, when
        the daemon died while taking it: then wait for it to come back and settle it)."""
        deadline = time.monotonic() + (_SETTLE_WAIT_S if self.final_unknown else 0.0)
        while True:
            try:
                with self._client() as c:
                    state = c.slurm_job(self.job_id)["state"]
            except DaemonAPIError as e:
                state = "unknown" if e.status == 0 else "gone"
            except StasisError:
                state = "gone"
            if state in ("checkpointed", "requeued"):
                return True
            if state not in ("unknown", "stopping") or time.monotonic() >= deadline:
                return False
            time.sleep(1.0)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wfd)
        for sig in (*FORWARDED, *WARNINGS):
            signal.signal(sig, lambda *_: None)
        self.spawn()
        self.register()
        pidfd = os.pidfd_open(self.pid)
        periodic = self.interval_s > 0 and self.mode != "off"
        next_periodic = time.monotonic() + self.interval_s if periodic else None
        while True:
            timeout = None if next_periodic is None else max(0.0, next_periodic - time.monotonic())
            ready, _, _ = select.select([rfd, pidfd], [], [], timeout)
            if pidfd in ready:
                break
            if rfd in ready:
                try:
                    data = os.read(rfd, 512)
                except BlockingIOError:
                    data = b""
                for num in data:
                    self._on_signal(signal.Signals(num))
            if next_periodic is not None and time.monotonic() >= next_periodic:
                if not self.steps_outside(final=False):
                    self.checkpoint(final=False)
                    if not self.requeued:
                        self.ask_interval()  # auto: re-estimated from this checkpoint's cost
                next_periodic = time.monotonic() + self.interval_s
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:  # not ours to wait for: how it ended cannot be told
            say(
                "stasis: warning: cannot tell how the job's workload ended; its checkpoints "
                "are kept"
            )
            self.finish(None)
            return 1
        code = os.waitstatus_to_exitcode(status)
        code = code if code >= 0 else 128 - code
        if self.requeued or (
            os.WIFSIGNALED(status)
            and os.WTERMSIG(status) == signal.SIGKILL
            and self.mode != "off"
            and self.taken_by_daemon()
        ):
            if self.slurm_requeues:
                # End now, within the grace time: that is what makes Slurm requeue it, once.
                return 0
            return _until_ended(rfd)
        self.finish(code)
        return code

    def _on_signal(self, sig: signal.Signals) -> None:
        if sig in WARNINGS or sig in _STOPPING:
            self.stopped = True
        if sig in WARNINGS:
            if self.mode == "off":
                say(
                    f"stasis: warning: {sig.name} (preemption or time limit ahead) but this job "
                    "is not protected: no checkpoint"
                )
                return
            if self.steps_outside(final=True):
                return
            say(f"stasis: {sig.name}: taking a checkpoint, then the job is requeued")
            self.checkpoint(final=True)
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


def _until_ended(wakeup_fd: int) -> int:
    """The job is requeued: Slurm ends its batch step, SIGTERM first, SIGKILL KillWait later,
    and the exit code does not count. Ended at that SIGTERM (or at once, should it have come
    already): a batch step that lingers to the SIGKILL holds the job's extern step until the
    moment slurmd tells that step to end too, where Slurm up to 25.05.0 races (its ticket
    22864: the extern step hangs UnkillableStepTimeout and the node drains "Kill task
    failed", on 24.11 seen after 2 of 36 stops)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    came = b""
    while True:  # every signal caught since the loop's last read, however many
        try:
            chunk = os.read(wakeup_fd, 512)
        except BlockingIOError:
            break
        if not chunk:
            break
        came += chunk
    if signal.SIGTERM in came:
        return 1
    time.sleep(_REQUEUE_WAIT_S)  # a bound, should Slurm never end it
    return 1


def _env_first(names: tuple[str, ...]) -> str:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return ""


def main() -> None:
    script = os.environ.get("STASIS_SLURM_SCRIPT", "")
    job_id = os.environ.get("SLURM_JOB_ID", "")
    try:
        start = json.loads(os.environ.get("STASIS_SLURM_START", "{}"))
    except ValueError:
        start = {"mode": "off", "messages": ["stasis: warning: bad STASIS_SLURM_START"]}
    if not isinstance(start, dict):
        start = {"mode": "off"}
    for line in start.get("messages", []):
        say(str(line))
    if not script:
        say("stasis: error: STASIS_SLURM_SCRIPT is not set; cannot find the batch script")
        sys.exit(1)
    if start.get("mode") == "held":
        # The helper requeued the job held: nothing runs, so that nothing starts over; Slurm
        # kills this batch step at once (the wait is a bound, should it not).
        time.sleep(_REQUEUE_WAIT_S)
        sys.exit(1)
    if start.get("mode") == "off" and not start.get("messages"):
        say("stasis: warning: this job runs WITHOUT checkpoint protection")
    # Installed as <lib_dir>/stasis-slurm-launch, our srun as <lib_dir>/bin/srun.
    here = Path(sys.argv[0]).resolve().parent if sys.argv and sys.argv[0] else None
    steps_dir = steps.install_dir(here) if here else None
    sys.exit(Launcher(start, script, job_id, steps_dir).run())


if __name__ == "__main__":
    main()
