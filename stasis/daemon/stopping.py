"""`stasis kill`: ask a job to end with a signal (TERM by default), SIGKILL it when it has not
ended within its timeout, and say which of the two ended it.

The grace period is waited on the event loop (asyncio.sleep between cheap looks at the job), not
in a worker thread: the few threads that serve every request must not be held by jobs that take
their time to stop, or that ignore the signal.
"""

from __future__ import annotations

import asyncio
import signal
import time

from stasis.daemon.db import JobRow
from stasis.daemon.jobs import JobManager
from stasis.daemon.models import KillRequest
from stasis.daemon.signals import parse_signal
from stasis.daemon.users import Caller
from stasis.wire import KillAnswer

_LOOK_S = 0.02  # how often the job is looked at while it may be ending
_AFTER_SIGKILL_S = 10.0  # the kernel tears a namespace down in ms; longer means a stuck process


async def stop(manager: JobManager, job_id: str, caller: Caller, req: KillRequest) -> KillAnswer:
    asked = parse_signal(req.signal)
    timeout_s = float(manager.settings.kill_timeout_s if req.timeout_s is None else req.timeout_s)
    if timeout_s == 0:
        asked = signal.SIGKILL  # no time to end on anything else: the old `stasis kill`
    row = await asyncio.to_thread(manager.signal_job, job_id, caller, asked)
    killed = asked == signal.SIGKILL
    if row is not None:
        if not killed and not await _ended(manager, row, timeout_s):
            killed = await asyncio.to_thread(manager.send, row, signal.SIGKILL)
        await _ended(manager, row, _AFTER_SIGKILL_S)
    return await asyncio.to_thread(
        manager.kill_answer, job_id, caller, asked, row is not None, killed, timeout_s
    )


async def _ended(manager: JobManager, row: JobRow, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the job to end; whether it did."""
    deadline = time.monotonic() + timeout_s
    while not manager.has_ended(row):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_LOOK_S)
    return True


__all__ = ["stop"]
