"""What the engine's tests of jobs in namespaces of their own share: a scratch directory outside
/tmp (their namespaces hide the node's), and the end of their process trees."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.engine import proctree


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="stasis-tests-", dir="/var/lib"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def end_trees(*procs: subprocess.Popen[bytes] | None) -> None:
    """Kill each process's whole tree, reap it, close its pipe."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proctree.signal_tree(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
