"""Reaping the processes that become the daemon's children without being started by it.

The daemon is a child subreaper: when a job's supervisor ends, what it leaves (CRIU helpers of a
restore that failed or was rejected at the gate, the tasks of a restore killed half-way) is
re-parented to the daemon, not to init. Nothing waits for those, so without this they stay
zombies (`[criu] <defunct>`) for as long as the daemon runs.

Reaping must not steal the exit status of a child that a `subprocess.Popen` waits for (criu swrk,
scontrol, the supervisors): a blanket waitpid(-1) would, and that Popen would then report exit
status 0 for a CRIU that failed. So a zombie child is reaped here only when it cannot be one of
those, decided without a race:

- The daemon's own short-lived children (criu swrk for dumps and checks, scontrol, mount) are
  started in the daemon's session. An orphan never is: it descends from a supervisor, which
  starts a session of its own, or it is a restored task, in its job's session. A zombie's session
  is still readable in /proc, so a zombie in the daemon's session is left to its Popen.
- Supervisors are in a session of their own, like orphans. They are started under `spawning()`,
  which holds the lock that every sweep holds too, and registered before it is released: a sweep
  never meets a supervisor it does not know. A registered supervisor is reaped through its own
  Popen (`poll()`), which keeps its status for whoever asks it later.

A zombie can only be reaped by its parent, and no Popen holds an orphan's pid, so nothing else
can reap an orphan between the sweep's look at /proc and its waitpid on that one pid.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stasis.engine import proctree

log = logging.getLogger("stasis.daemon")


class Reaper:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._supervisors: dict[int, subprocess.Popen[bytes]] = {}

    @contextmanager
    def spawning(self) -> Iterator[dict[int, subprocess.Popen[bytes]]]:
        """Start a child in a session of its own inside this block and put its Popen into the
        dict it yields (by pid) before the block ends: sweeps leave it to its Popen."""
        with self._lock:
            yield self._supervisors

    def sweep(self) -> list[int]:
        """Reap every zombie child of the daemon that no Popen waits for; return their pids."""
        try:
            # A cheap look first (WNOWAIT reaps nothing): most sweeps find no zombie at all.
            if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return []
        except ChildProcessError:
            return []
        ours = os.getsid(0)
        reaped: list[int] = []
        with self._lock:
            for pid, popen in list(self._supervisors.items()):
                if popen.poll() is not None:
                    del self._supervisors[pid]
            for pid in proctree.children(os.getpid()):
                if pid in self._supervisors:
                    continue
                state_session = _state_and_session(pid)
                if state_session is None or state_session[0] != "Z" or state_session[1] == ours:
                    continue
                try:
                    got, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    continue
                if got == pid:
                    reaped.append(pid)
        if reaped:
            log.debug("reaped %d orphaned process(es): %s", len(reaped), reaped)
        return reaped


def _state_and_session(pid: int) -> tuple[str, int] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # After the command name (which may hold spaces and parentheses): state ppid pgrp session.
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[3])
