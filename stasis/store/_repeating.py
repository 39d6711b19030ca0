"""`Repeating`: a refresh that runs on a thread of its own (a publish's heartbeat, a pin)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from stasis.store._place import reason

log = logging.getLogger(__name__)


class Repeating:
    """Calls `fn` every `interval_s` on a thread of its own until `stop`; its failures are
    logged (once each kind), never raised: a missed refresh is retried at the next."""

    def __init__(
        self, interval_s: float, fn: Callable[[], None], what: str, at_once: bool = True
    ) -> None:
        self._at_once = at_once
        self._stopped = threading.Event()
        self._fn = fn
        self._what = what
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, name=f"refresh {what}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        said: set[str] = set()
        first = self._at_once
        while first or not self._stopped.wait(self._interval_s):
            first = False
            try:
                self._fn()
            except Exception as e:
                if type(e).__name__ not in said:
                    said.add(type(e).__name__)
                    log.warning("cannot refresh %s: %s", self._what, reason(e))

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
