from __future__ import annotations

import os
import subprocess

from stasis.engine import proctree


def test_tree_alive_and_start_time() -> None:
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
    assert proctree.children(os.getpid()) == []
