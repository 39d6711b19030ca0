"""What the job manager's parts (dumping, restoring, housekeeping) share: the daemon's
settings, the checkpoint store, the job database, the network locks this node holds, the dumps
it has in flight, who hears of what it did."""

from __future__ import annotations

from dataclasses import dataclass

from stasis.config import Settings
from stasis.daemon.activity import JobWork, Listeners
from stasis.daemon.db import JobDB
from stasis.daemon.inflight import DumpJournal
from stasis.daemon.netlocks import NetLocks
from stasis.store import Store


@dataclass(frozen=True)
class Core:
    settings: Settings
    store: Store
    db: JobDB
    netlocks: NetLocks
    journal: DumpJournal
    hostname: str  # `settings.node`, asked once: it may ask the system
    activity: Listeners  # told of every checkpoint published and restore done
    work: JobWork  # the seconds of work each job started from
