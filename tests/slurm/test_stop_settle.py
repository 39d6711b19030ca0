"""A Slurm job's stop-dump that a killed daemon left published (issue 28): the next start ends
its tree (the stop was asked and its checkpoint is in the store), it does not resume it. Slurm
dumps are journaled under the Slurm job's id, not a stasis job's: they were resumed, and ran
beside their checkpoint until the Slurm integration's recovery killed them."""

from __future__ import annotations

import json
import signal
import subprocess
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from stasis.daemon.inflight import InFlightDump
from stasis.engine import proctree
from stasis.store import new_checkpoint_id
from tests.conftest import MakeDaemon


def _journaled(state_dir: Path, pid: int, published: bool) -> str:
    """A Slurm job's stop-dump as the daemon journals it (checkpoint_tree)."""
    checkpoint = new_checkpoint_id(datetime.now(timezone.utc))
    entry = InFlightDump(
        checkpoint=checkpoint,
        job="4711",
        pid=pid,
        pid_start=proctree.start_time(pid),
        leave_running=False,
        published=published,
    )
    (state_dir / "dumps" / f"{checkpoint}.json").write_text(json.dumps(asdict(entry)))
    return checkpoint


def test_a_published_slurm_stop_dump_is_ended_at_the_next_start(make_daemon: MakeDaemon) -> None:
    d = make_daemon()
    d.stop()
    published = subprocess.Popen(["sleep", "60"])
    unpublished = subprocess.Popen(["sleep", "60"])
    try:
        for p in (published, unpublished):
            p.send_signal(signal.SIGSTOP)  # as CRIU leaves a stop-dump's tree
        (d.state_dir / "dumps").mkdir(mode=0o700, exist_ok=True)
        _journaled(d.state_dir, published.pid, published=True)
        _journaled(d.state_dir, unpublished.pid, published=False)
        d.start()
        # Killed, as asked: before, it was resumed (SIGCONT) and slept on.
        assert published.wait(timeout=20) == -signal.SIGKILL
        # Not published: nothing was asked that can be carried out; it runs on.
        assert unpublished.poll() is None and not proctree.stopped(unpublished.pid)
        assert not list((d.state_dir / "dumps").glob("*.json")), "the journal kept an entry"
    finally:
        for p in (published, unpublished):
            p.kill()
            p.wait()
