from __future__ import annotations

import os
import subprocess
from pathlib import Path

from stasis.engine import proctree


def test_tree_alive_and_start_time() -> None:
    # Children of the session that are not this test's (the session's S3 server).
    before = proctree.children(os.getpid())
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        kids = []
        for _ in range(100):
            kids = proctree.children(proc.pid)
            if kids:
                break
            __import__("time").sleep(0.02)
        assert proctree.tree(proc.pid) == [proc.pid, *kids]
        started = proctree.start_time(proc.pid)
        assert started is not None and proctree.alive(proc.pid, started)
        assert not proctree.alive(proc.pid, started + 1)  # a recycled pid is not the job
        assert proctree.resident_bytes(proc.pid) > 0
    finally:
        proctree.signal_tree(proc.pid, __import__("signal").SIGKILL)
        proc.wait()
    assert not proctree.alive(proc.pid, None)
    assert proctree.children(os.getpid()) == before


def test_resident_bytes_counts_the_whole_tree() -> None:
    hold = 'import sys, time; b = b"x" * (64 << 20); print("ready", flush=True); time.sleep(30)'
    proc = subprocess.Popen(["sh", "-c", f"python3 -c '{hold}' & wait"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == b"ready"
        statm = Path(f"/proc/{proc.pid}/statm").read_text()
        own = int(statm.split()[1]) * os.sysconf("SC_PAGE_SIZE")
        assert own < (16 << 20)  # the shell itself holds little: the 64 MiB are its child's
        assert proctree.resident_bytes(proc.pid) >= 64 << 20
    finally:
        proctree.signal_tree(proc.pid, __import__("signal").SIGKILL)
        proc.wait()
        proc.stdout.close()
