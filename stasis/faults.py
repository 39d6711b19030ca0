"""Named fault points: places in the node daemon, the Kubernetes runtime and the control plane
where a test of what survives a crash (tests/faults/) has this process SIGKILLed.

A point is armed by the `test_fault_points` setting (STASIS_TEST_FAULT_POINTS, names separated
by ':'); production never sets it, and an unarmed point costs one set lookup. SIGKILL, not an
exception: what is tested is a process that ends with no `finally`, no flush and no goodbye, as
kill -9, the OOM killer or a node's power cut end it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable

_armed: frozenset[str] = frozenset()


def arm(points: Iterable[str]) -> None:
    """Arm `points` for this process (its entry point calls this once, from the settings)."""
    global _armed
    _armed = frozenset(points)


def point(name: str) -> None:
    """Die here, at once, if `name` is armed."""
    if name in _armed:
        os.kill(os.getpid(), signal.SIGKILL)


def armed() -> frozenset[str]:
    return _armed


__all__ = ["arm", "armed", "point"]
