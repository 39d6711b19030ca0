"""The launcher and the SPANK helper never wait forever on a daemon that does not answer
(they call it with a bounded Client)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from stasis.errors import DaemonAPIError
from stasis.client import Client


def test_a_daemon_that_never_answers_is_given_up_on(tmp_path: Path) -> None:
    path = tmp_path / "hung.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen(1)
        start = time.monotonic()
        with pytest.raises(DaemonAPIError, match="no answer in time"):
            Client(path, 0.5).request("GET", "/slurm/health")
        assert time.monotonic() - start < 5


def test_no_daemon_at_all(tmp_path: Path) -> None:
    with pytest.raises(DaemonAPIError, match="no socket there"):
        Client(tmp_path / "none.sock", 0.5).request("GET", "/slurm/health")


def test_something_that_is_not_the_daemon(tmp_path: Path) -> None:
    path = tmp_path / "other.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen(1)

        def answer_garbage() -> None:
            conn, _ = server.accept()
            conn.recv(4096)
            conn.sendall(b"SSH-2.0-OpenSSH\r\n")
            conn.close()

        threading.Thread(target=answer_garbage, daemon=True).start()
        with pytest.raises(DaemonAPIError, match="nothing answers"):
            Client(path, 5).request("GET", "/jobs")
