"""The launcher and the SPANK helper never wait forever on a daemon that does not answer."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from stasis.errors import DaemonAPIError
from stasis.slurm.launcher import QuickClient


def test_a_daemon_that_never_answers_is_given_up_on(tmp_path: Path) -> None:
    path = tmp_path / "hung.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen(1)
        start = time.monotonic()
        with pytest.raises(DaemonAPIError, match="nothing answers"):
            QuickClient(path, 0.5).request("GET", "/slurm/health")
        assert time.monotonic() - start < 5


def test_no_daemon_at_all(tmp_path: Path) -> None:
    with pytest.raises(DaemonAPIError, match="no socket there"):
        QuickClient(tmp_path / "none.sock", 0.5).request("GET", "/slurm/health")
