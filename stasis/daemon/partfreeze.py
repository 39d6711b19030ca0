"""Job parts frozen for a checkpoint cut across nodes (issue 31), each written down before it is
frozen, so that a daemon killed meanwhile thaws it at its next start.

A coordinator (the Slurm side, a test) cuts a job that spans nodes in two phases, through each
node's daemon: it freezes every part (`freeze`: the part's freezer cgroup, partcgroup.py, and
its job network held still, jobnet.hold), then dumps each frozen part (the dump route with
`frozen`: CRIU dumps the frozen cgroup as it is and leaves it frozen). Every dump done, it ends
every part (`thaw` with `stop`: its connections put in repair mode and the tree killed, its
network still held, so that nothing reaches a peer, then thawed to die); one dump failed, it deletes the checkpoints the others took
and thaws every part (`thaw`): each goes on where it was, its peers' TCP sending again what the
held network dropped.

Each freeze is a file under `<state_dir>/part-freezes/` (durable: written before the freeze)
until its part runs again or is killed; `stop` is written before the kill. A daemon that starts
settles each file it finds (`settle`): the tree killed if a stop was asked, the network
released and the cgroup thawed otherwise. A freeze also has a deadline (`timeout_s`): a
coordinator that died leaves no part frozen for longer.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stasis.atomicfile import write_atomically
from stasis.daemon import jobnet, partcgroup
from stasis.engine import jobnetns, proctree, unixpeers
from stasis.errors import CheckpointError, StasisError, UsageError

log = logging.getLogger("stasis.daemon")

DIRECTORY = "part-freezes"
_MAX_BYTES = 64 << 10
EDGE_SETTLE_S = 3.0  # frozen again and again until no connection crosses the part's edge


@dataclass
class PartFreeze:
    job: str
    pid: int
    pid_start: int | None
    cgroup: str
    vni: int | None  # its job network, held still while frozen (None: none)
    deadline: float  # wall clock (time.time()): thawed then, unless stopped or thawed before
    checkpoints: list[str] = field(default_factory=list)  # taken while frozen
    stop: bool = False  # written before the tree is killed


class PartFreezes:
    """The parts this node holds frozen, and their journal."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._open: dict[str, PartFreeze] = {}
        self._timers: dict[str, threading.Timer] = {}
        self._dumping: set[str] = set()  # frozen parts being dumped: their deadline waits

    # -- the journal -------------------------------------------------------------------------

    def _path(self, job: str) -> Path:
        return self.directory / f"{job}.json"

    def _write(self, entry: PartFreeze) -> None:
        self.directory.mkdir(mode=0o700, exist_ok=True)
        write_atomically(self._path(entry.job), json.dumps(asdict(entry)).encode())

    def _end(self, job: str) -> None:
        self._open.pop(job, None)
        timer = self._timers.pop(job, None)
        if timer is not None:
            timer.cancel()
        self._path(job).unlink(missing_ok=True)

    def get(self, job: str) -> PartFreeze | None:
        with self._lock:
            return self._open.get(job)

    # -- freeze, thaw --------------------------------------------------------------------------

    def freeze(self, job: str, pid: int, timeout_s: float, viewer: int | None) -> PartFreeze:
        """Freeze the part `job` whose tree is `pid` (its cgroup and job network) for at most
        `timeout_s`; UsageError (one line) when it is not a part or frozen already,
        CheckpointError when it cannot be frozen, nothing left frozen. Its refusals name other
        processes as `viewer` (a uid, the part's owner; None or 0: root) may see them."""
        cgroup = partcgroup.of(pid)
        if cgroup is None:
            raise UsageError(
                f"job {job} cannot be frozen for a checkpoint across nodes: it does not run in "
                "a cgroup of its own (only a job started or restored in a job network does); "
                "run it with job_net, or dump it alone"
            )
        with self._lock:
            if job in self._open:
                raise UsageError(f"job {job} is frozen already; dump it (frozen) or thaw it first")
            entry = PartFreeze(
                job=job,
                pid=pid,
                pid_start=proctree.start_time(pid),
                cgroup=str(cgroup),
                vni=jobnet.vni_of(pid),
                deadline=time.time() + timeout_s,
            )
            try:
                self._write(entry)  # before the freeze: a daemon killed after it thaws it
            except OSError as e:
                raise CheckpointError(
                    f"job {job} not frozen: cannot record its freeze in {self.directory} "
                    f"({e.strerror or e}); free space there (the daemon's state_dir)"
                ) from None
            self._open[job] = entry
        try:
            if entry.vni is not None:
                jobnet.hold(entry.vni)
            self._freeze_between_connections(job, pid, cgroup, viewer)
        except (StasisError, OSError) as e:
            self._thaw(entry)
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"job {job} not frozen: {e}; it runs on") from e
        except BaseException:
            self._thaw(entry)  # whatever it was, the part is not left frozen without a deadline
            raise
        # Its deadline counts from the freeze, however long settling it took.
        with self._lock:
            entry.deadline = time.time() + timeout_s
            try:
                self._write(entry)
            except OSError as e:  # the journal's earlier deadline stands there: no harm
                log.warning("job %s: its freeze's deadline cannot be recorded: %s", job, e)
        timer = threading.Timer(timeout_s, self._expired, args=(job,))
        timer.daemon = True
        with self._lock:
            self._timers[job] = timer
        timer.start()
        return entry

    def _freeze_between_connections(
        self, job: str, pid: int, cgroup: Path, viewer: int | None
    ) -> None:
        """Freeze the cgroup at a moment no unix stream connection crosses the tree's edge, if
        one comes within EDGE_SETTLE_S: a part that talks to a node's service now and then (the
        launch agent's munge, for one credential per call) would make CRIU fail "Can't dump
        half of stream unix connection" on a freeze that caught it mid-call. A connection that
        stays (a terminal multiplexer's client) refuses the freeze, saying whose it is (the
        commands as `viewer`, the part's owner, may see them)."""
        deadline = time.monotonic() + EDGE_SETTLE_S
        while True:
            if not partcgroup.freeze(cgroup):
                raise CheckpointError(
                    f"job {job} not frozen: its cgroup {cgroup} did not freeze within 10 s (a "
                    "process stuck in the kernel); it runs on"
                )
            try:
                if not unixpeers.crosses_edge(pid):
                    return
                if time.monotonic() > deadline:
                    crossing = unixpeers.external_peers(pid, viewer)
                    if not crossing:
                        return
                    raise CheckpointError(
                        f"job {job} not frozen: "
                        + "; ".join(p.describe() for p in crossing)
                        + f" (still so after {EDGE_SETTLE_S:.0f} s); it runs on"
                    )
            except OSError as e:
                log.warning("job %s: its unix connections cannot be looked at: %s", job, e)
                return  # CRIU's dump says what it finds
            # A short pause of no fixed length: a part calling out on a period of its own is
            # not caught mid-call again and again in step with it.
            pause = random.uniform(0.005, 0.05)
            log.info(
                "job %s: frozen mid-connection to a process outside it; thawed for %.0f ms and "
                "frozen again",
                job,
                pause * 1000,
            )
            partcgroup.set_frozen(cgroup, False)
            time.sleep(pause)

    @contextmanager
    def dumping(self, job: str) -> Iterator[None]:
        """While the frozen part `job` is dumped: a deadline that passes meanwhile thaws it
        once the dump is over (thawed under CRIU, the part would be frozen again when CRIU
        ends, as it found it, and by then no longer written down)."""
        with self._lock:
            self._dumping.add(job)
        try:
            yield
        finally:
            with self._lock:
                self._dumping.discard(job)

    def note_checkpoint(self, job: str, checkpoint: str) -> None:
        with self._lock:
            entry = self._open.get(job)
            if entry is not None:
                entry.checkpoints.append(checkpoint)
                self._write(entry)

    def thaw(self, job: str, stop: bool) -> PartFreeze:
        """Let the frozen part run on, or (`stop`) end it at the checkpoint taken while it was
        frozen; the entry it was. UsageError when it is not frozen, or `stop` without a
        checkpoint taken."""
        with self._lock:
            entry = self._open.get(job)
            if entry is None:
                raise UsageError(f"job {job} is not frozen; nothing to thaw")
            if stop and not entry.checkpoints:
                raise UsageError(
                    f"job {job} not stopped: no checkpoint was taken while it was frozen; "
                    "thaw it, or kill it with `stasis kill`"
                )
            if stop:
                entry.stop = True
                self._write(entry)  # before the kill: a daemon killed after it kills it again
        self._thaw(entry)
        return entry

    def _thaw(self, entry: PartFreeze) -> None:
        """Kill the tree first if its stop was asked (its network still held: no reset leaves
        it; the restore into that namespace releases it), else release its network; then thaw
        the cgroup (a frozen task dies of SIGKILL only once thawed)."""
        cgroup = Path(entry.cgroup)
        if entry.stop:
            if proctree.alive(entry.pid, entry.pid_start):
                try:
                    # Its connections live on in its images: closed without a word.
                    jobnetns.silence_connections(entry.pid)
                except OSError as e:
                    log.warning("job %s: cannot close its connections quietly: %s", entry.job, e)
                try:
                    os.kill(entry.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        elif entry.vni is not None:
            jobnet.release(entry.vni)
        try:
            if partcgroup.exists(cgroup):
                partcgroup.set_frozen(cgroup, False)
        except OSError as e:
            log.warning("job %s: cannot thaw its cgroup %s: %s", entry.job, cgroup, e)
        with self._lock:
            self._end(entry.job)

    def _expired(self, job: str) -> None:
        with self._lock:
            entry = self._open.get(job)
            if entry is not None and job in self._dumping:
                timer = threading.Timer(1.0, self._expired, args=(job,))
                timer.daemon = True
                self._timers[job] = timer
                timer.start()
                return
        if entry is None or entry.stop:
            return
        log.warning(
            "job %s: thawed, its freeze for a checkpoint across nodes ran out before it was "
            "stopped or thawed (its coordinator gone?)",
            job,
        )
        try:
            self._thaw(entry)
        except Exception:  # a thread of its own: say so rather than die silently
            log.exception("cannot thaw job %s", job)

    def settle(self) -> None:
        """At start: thaw (or kill, where a stop was asked) every part a killed daemon left
        frozen."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return
        for name in names:
            path = self.directory / name
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    entry = PartFreeze(**json.loads(f.read(_MAX_BYTES)))
                if name != f"{entry.job}.json" or not entry.cgroup.startswith(
                    str(partcgroup.root())
                ):
                    raise ValueError("not an entry of this journal")
            except (OSError, ValueError, TypeError) as e:
                # A write cut short: the freeze it announced never happened.
                log.warning("dropping unreadable part freeze record %s: %s", path, e)
                path.unlink(missing_ok=True)
                continue
            log.warning(
                "job %s: %s; a daemon that stopped had left it frozen for a checkpoint across "
                "nodes",
                entry.job,
                "killed at its checkpoint, as asked" if entry.stop else "thawed",
            )
            self._thaw(entry)


__all__ = ["DIRECTORY", "PartFreeze", "PartFreezes"]
