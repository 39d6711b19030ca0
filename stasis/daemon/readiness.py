"""Whether the checkpoint store answers, asked for the daemon's readiness (`stasis check`, the
control plane's node report, the Kubernetes agent's taint): one small read, bounded in time,
one at a time (a store that hangs must not pile up threads nor hold `/check`)."""

from __future__ import annotations

import threading
from datetime import datetime, timezone

from stasis.errors import StasisError
from stasis.store import Store, new_checkpoint_id

# Long enough for one request to a healthy remote store, short enough for a /check.
PROBE_TIMEOUT_S = 5.0


class StoreProbe:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._running: threading.Thread | None = None
        self._result: str | None = None
        self._done = threading.Event()

    def problem(self) -> str | None:
        """None when the store answered a read within PROBE_TIMEOUT_S; else why not."""
        with self._lock:
            if self._running is not None and self._running.is_alive():
                return f"a read of it has not answered for over {PROBE_TIMEOUT_S:g} s"
            self._done = threading.Event()
            done = self._done
            self._running = threading.Thread(
                target=self._probe, args=(done,), name="stasis-store-probe", daemon=True
            )
            self._running.start()
        if not done.wait(PROBE_TIMEOUT_S):
            return f"a read of it did not answer within {PROBE_TIMEOUT_S:g} s"
        return self._result

    def _probe(self, done: threading.Event) -> None:
        try:
            # An id nobody has: what is asked is whether the store answers, not what it holds.
            self._store.catalog.exists(new_checkpoint_id(datetime(2000, 1, 1, tzinfo=timezone.utc)))
            self._result = None
        except StasisError as e:
            self._result = str(e)
        except Exception as e:  # noqa: BLE001 - whatever the backend raised: not answering
            self._result = f"{type(e).__name__}"
        finally:
            done.set()
