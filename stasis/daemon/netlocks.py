"""The network locks this node holds for its checkpoints, and when they go.

A dump that stops a job with established TCP connections leaves CRIU's DROP rules for them in
the node's firewall (stasis/engine/netlock.py): they keep the peers waiting for a restore of that
checkpoint instead of seeing a reset. They protect nothing once
- the checkpoint is deleted (`checkpoints rm`, retention, another node of a shared store),
- it was restored: here CRIU lifts them itself; elsewhere the restoring node leaves a note in the
  store (`Store.mark_restored`) that this node finds,
- `netlock_timeout_s` passed: by then the peers' TCP has given up on the connection (Linux
  retransmits for ~15 minutes by default) and a restore finds them gone anyway.
Each lock is recorded in the job table's database when the dump is published, so that a
restarted daemon still lifts it; the daemon sweeps every few seconds.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

from stasis import wire
from stasis.daemon.db import JobDB, NetLockRow
from stasis.engine import netlock
from stasis.engine.check import network_locks
from stasis.engine.netlock import LockRule
from stasis.errors import StasisError
from stasis.store import Store

log = logging.getLogger("stasis.daemon")

SWEEP_INTERVAL_S = 5.0


class NetLocks:
    def __init__(self, db: JobDB, store: Store, timeout_s: int) -> None:
        self.db = db
        self.store = store
        self.timeout_s = timeout_s

    def hold(self, checkpoint_id: str, job: str, rules: list[LockRule]) -> None:
        """Record the lock of a published checkpoint whose job is about to be killed."""
        argvs = {r.argv for r in rules}
        for row in self.db.netlocks():
            # The same connection locked again: it was restored from that older checkpoint (by
            # a restore that lifted its rules) and dumped anew. Taking the old record's rules
            # out later would remove the new ones: iptables deletes the first rule that matches.
            if argvs & {tuple(argv) for argv in row.rules}:
                self.db.remove_netlock(row.checkpoint)
        if rules:
            self.db.add_netlock(
                NetLockRow(
                    checkpoint=checkpoint_id,
                    job=job,
                    created=time.time(),
                    rules=[list(r.argv) for r in rules],
                )
            )

    def lifted_by_restore(self, checkpoint_id: str) -> None:
        """CRIU restored `checkpoint_id` on this node and took its rules out."""
        self.db.remove_netlock(checkpoint_id)

    def release(self, checkpoint_id: str, why: str) -> None:
        for row in self.db.netlocks():
            if row.checkpoint == checkpoint_id:
                self._release(row, why)

    def _release(self, row: NetLockRow, why: str) -> None:
        problems = netlock.remove(LockRule(tuple(argv)) for argv in row.rules)
        if problems:
            # Kept: the next sweep tries again (iptables busy, say).
            log.warning(
                "cannot lift the network lock of checkpoint %s (%s): %s",
                row.checkpoint,
                why,
                "; ".join(problems),
            )
            return
        self.db.remove_netlock(row.checkpoint)
        log.info(
            "lifted the network lock of checkpoint %s (job %s; %d rule(s)): %s",
            row.checkpoint,
            row.job,
            len(row.rules),
            why,
        )

    def sweep(self) -> None:
        now = time.time()
        for row in self.db.netlocks():
            why = self._why_release(row, now)
            if why:
                self._release(row, why)

    def _why_release(self, row: NetLockRow, now: float) -> str | None:
        if self.timeout_s and now - row.created >= self.timeout_s:
            return f"held for {self.timeout_s} s (netlock_timeout_s)"
        try:
            if not self.store.catalog.exists(row.checkpoint):
                return "the checkpoint was deleted"
            if self.store.catalog.was_restored(row.checkpoint):
                return "the checkpoint was restored on another node"
        except StasisError as e:
            log.warning(
                "cannot tell whether checkpoint %s still needs its network lock: %s",
                row.checkpoint,
                e,
            )
        return None

    def present(self) -> list[wire.NetworkLock]:
        """Every CRIU lock rule in this node's firewall, with the checkpoint it is held for."""
        rows = self.db.netlocks()
        found = []
        for lock in network_locks():
            held = next(
                (
                    row
                    for row in rows
                    for argv in row.rules
                    if netlock.matches(lock["rule"], LockRule(tuple(argv)))
                ),
                None,
            )
            if held is not None:
                lock["checkpoint"], lock["job"] = held.checkpoint, held.job
                if self.timeout_s:
                    lock["release_at"] = datetime.fromtimestamp(
                        held.created + self.timeout_s, timezone.utc
                    ).isoformat(timespec="seconds")
            found.append(lock)
        return found
