"""One dump per job at a time: a second dump of a job that is being dumped is refused at once,
and the first one completes as if it were alone."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from stasis.engine import proctree
from tests.conftest import STASIS, Daemon, MakeDaemon, wait_for, workload


def tracer(pid: int) -> int:
    """The pid of whoever ptraces `pid` (CRIU, during a dump), 0 when nobody does."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("TracerPid:")))


def test_second_stop_dump_is_refused_while_the_first_runs(make_daemon: MakeDaemon) -> None:
    d: Daemon = make_daemon()
    job = d.run(*workload("memhold.py", 128), label="twice")
    wait_for(lambda: "ready" in d.log_of(job["job"]), 30, "128 MiB allocated")
    first: dict[str, subprocess.CompletedProcess[str]] = {}
    thread = threading.Thread(
        target=lambda: first.update(
            r=subprocess.run(
                [STASIS, "dump", "--json", job["job"]],
                env=d.env,
                capture_output=True,
                text=True,
                timeout=120,
            )
        )
    )
    thread.start()
    # The first dump holds the tree (CRIU ptraces it): now the second one asks.
    wait_for(lambda: tracer(job["pid"]) or not thread.is_alive(), 30, "the first dump's CRIU")
    assert thread.is_alive(), f"the first dump ended too soon: {first}"
    second = d.cli("dump", job["job"], check=False)
    thread.join()

    assert second.returncode != 0
    assert second.stderr.strip() == (
        f"stasis: error: job {job['job']} is being checkpointed " "already; wait for it"
    )
    assert first["r"].returncode == 0, first["r"].stderr
    assert [c["label"] for c in d.json("checkpoints")] == ["twice"]
    assert d.job(job["job"])["state"] == "checkpointed"
    assert not proctree.alive(job["pid"], None)
    # Once it is over, another dump is told why there is nothing to dump, not that one runs.
    again = d.cli("dump", job["job"], check=False)
    assert again.returncode == 2 and "is not running (state checkpointed)" in again.stderr
