"""`stasis-rsh HOST COMMAND...`: the launch agent of a protected Slurm job on several nodes.

An MPI launcher starts its daemons on the job's other nodes through `ssh HOST COMMAND`; set it to
use this instead (Open MPI 4: `OMPI_MCA_plm=rsh OMPI_MCA_plm_rsh_agent=stasis-rsh`; Open MPI 5:
`PRTE_MCA_plm=ssh PRTE_MCA_plm_ssh_agent=stasis-rsh`; MPICH's Hydra:
`mpiexec -launcher ssh -launcher-exec stasis-rsh`), and HOST's stasis daemon starts COMMAND as
that node's part of the job (stasis.slurm.parts): in the job's network there, in a freezer cgroup
of its own, as the job's user; not as a child of slurmstepd, which a checkpoint could not take.

It behaves as ssh does for such a launcher: COMMAND's words joined by spaces, run by /bin/sh -c
on HOST in a login-like environment (nothing of this one's is passed on), in this directory; its
output (stdout and stderr together) written to this stdout as it comes; its exit status this
one's (255: it could not be started or followed, one line on stderr says why). Its stdin is not
forwarded (Open MPI and Hydra give their daemons none). SIGTERM, SIGINT or SIGHUP here is passed
on to the part (a second one: SIGKILL).

The job is SLURM_JOB_ID's; HOST a node of the job (`user@` and a domain are dropped). It asks
HOST's daemon on the remote listener (`slurm_remote_port`), with a munge credential of the
calling user, polling for the output: no connection stays open across a checkpoint.

The agent is checkpointed with the batch script (it is a process of the batch node's part),
and its part with the rest of the job in the same cut. Restored after a requeue, maybe on other
nodes, it finds its part again: by its key (the part's name on every node), on the node that
has HOST's place in the job's NodeList now (SLURM_JOB_NODELIST is the one it started with). A
part a cut stopped ("checkpointed") has not ended: it is being moved.
"""

from __future__ import annotations

import base64
import os
import signal
import sys
import time
from types import FrameType

from stasis.config import Settings, load_settings
from stasis.errors import (
    DaemonAPIError,
    NotFoundError,
    PermissionDeniedError,
    SlurmError,
    StasisError,
    UsageError,
)
from stasis.slurm import remote, scontrol
from stasis.slurm.partnames import part_of

# Between reads of the part's output: POLL_S after it wrote some, then longer while it writes
# nothing, up to POLL_MAX_S. Each read makes a munge credential (a `munge` child connected to
# munged, outside the job): fewer of them, fewer moments a cut must wait out (partfreeze).
POLL_S = 0.2
POLL_MAX_S = 1.0
_BACK_OFF = 1.5
GIVE_UP_S = 120.0  # of its daemon unreachable before the part is taken for lost
_CALL_TIMEOUT_S = 30.0
_EXIT_FAILED = 255  # ssh's own failure
# ssh's options a launcher may put before HOST: these take a value, the others none.
_WITH_VALUE = frozenset("bcDEeFIiJLlmOopQRSWw")
_ENDED = ("exited", "failed")
_MOVED = "checkpointed"  # stopped by a cut: it runs again where the job is restored


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    """(host, command words) of an ssh-like command line; ssh's options before HOST skipped."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        flags = argv[i][1:]
        for j, flag in enumerate(flags):
            if flag in _WITH_VALUE:
                if j == len(flags) - 1:
                    i += 1  # its value is the next word
                break
        i += 1
    if i < len(argv) and argv[i] == "--":
        i += 1
    if len(argv) - i < 2:
        raise SystemExit(
            "usage: stasis-rsh HOST COMMAND... (a launch agent: HOST's stasis daemon runs "
            "COMMAND as that node's part of this Slurm job)"
        )
    host = argv[i].rpartition("@")[2]
    return host, argv[i + 1 :]


def _target(settings: Settings, host: str) -> remote.RemoteNode:
    """HOST's daemon: HOST as a Slurm node name, else its first label."""
    for node in dict.fromkeys((host, host.split(".")[0])):
        try:
            address = scontrol.node_address(node)
        except (NotFoundError, SlurmError):
            continue
        return remote.remote_node(settings, node, address, timeout_s=_CALL_TIMEOUT_S)
    raise NotFoundError(f"{host} is not a Slurm node: stasis-rsh starts parts on the job's nodes")


class _Signals:
    """The signals this agent got, passed on to the part at the next turn of its loop."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.count = 0
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._got)

    def _got(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.pending.append("KILL" if self.count > 1 else signal.Signals(signum).name[3:])

    def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`, less if a signal comes: it is passed on without the wait."""
        deadline = time.monotonic() + seconds
        while not self.pending and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))


def moved_to(host: str, started_on: list[str], now: list[str]) -> str:
    """The node that has `host`'s place in the job's NodeList `now` (`started_on`: the
    NodeList the agent started with; the job prolog gives the i-th node the part of the job's
    network that the i-th had); `host` itself if it cannot tell."""
    short = host.split(".")[0]
    if short not in started_on or len(now) < len(started_on):
        return host
    return now[started_on.index(short)]


def _moved_to(job: str, host: str, started_on: list[str]) -> str:
    try:
        now = scontrol.job_node_list(job)
    except (SlurmError, NotFoundError):
        return host
    return moved_to(host, started_on, now)


def _node_list(text: str) -> list[str]:
    try:
        return scontrol.hostnames(text) if text else []
    except SlurmError:
        return []


def relay(settings: Settings, host: str, words: list[str]) -> int:
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job:
        raise SlurmError(
            "no SLURM_JOB_ID here: stasis-rsh starts a part of the Slurm job it runs in; use it "
            "inside the job's allocation"
        )
    started_on = _node_list(os.environ.get("SLURM_JOB_NODELIST", ""))
    target = _target(settings, host)
    cwd = os.getcwd()
    signals = _Signals()
    started = remote.start_part(
        settings, target, job, ["/bin/sh", "-c", " ".join(words)], cwd if cwd[:1] == "/" else "/"
    )
    of = part_of(started["label"])
    if of is None:
        raise DaemonAPIError(f"{host} started no part of job {job} (label {started['label']!r})")
    part, offset, lost_since, idle = of[1], 0, 0.0, POLL_S
    out = sys.stdout.buffer

    def follow() -> None:
        """Point at the node that has the part now (after a restore, maybe another)."""
        nonlocal target
        now = _moved_to(job, host, started_on)
        if now != target.node:
            try:
                target = _target(settings, now)
            except (NotFoundError, SlurmError):
                pass

    while True:
        while signals.pending:
            sig = signals.pending.pop(0)
            try:
                remote.signal_part(settings, target, job, part, sig)
            except StasisError as e:
                print(f"stasis-rsh: cannot pass SIG{sig} on to {host}: {e}", file=sys.stderr)
        try:
            got = remote.part_output(settings, target, job, part, offset)
        except (DaemonAPIError, NotFoundError, UsageError, PermissionDeniedError) as e:
            # Its daemon restarting, the node busy, or the part moved with the job (restored
            # here, it is somewhere else now): ask again, where it is.
            lost_since = lost_since or time.monotonic()
            if time.monotonic() - lost_since > GIVE_UP_S:
                raise DaemonAPIError(
                    f"lost the part on {host} for {GIVE_UP_S:.0f} s: {e}"
                ) from None
            time.sleep(1.0)
            follow()
            continue
        lost_since = 0.0
        data = base64.b64decode(got["data"])
        if data:
            out.write(data)
            out.flush()
            offset, idle = got["offset"], POLL_S
            continue
        if got["state"] in _ENDED:
            code = got["exit_code"]
            return code if code is not None and 0 <= code <= 255 else _EXIT_FAILED
        if got["state"] == _MOVED:
            # Only seen by an agent restored with its job: its part is back elsewhere, or soon.
            time.sleep(1.0)
            follow()
            continue
        signals.wait(idle)
        idle = min(idle * _BACK_OFF, POLL_MAX_S)


def main(argv: list[str] | None = None) -> int:
    host, words = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return relay(load_settings(), host, words)
    except StasisError as e:
        print(f"stasis-rsh: {host}: {e}", file=sys.stderr)
        return _EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
