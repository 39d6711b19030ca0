"""What a restore decides about a checkpoint's TCP sockets (engine/netidentity.py), read from
real CRIU images of real processes: connections inside the job over loopback come back, one to a
peer outside it whose network lock this node does not hold is restored closed, with a note."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stasis.engine import CRIU, DumpOptions, find_criu, netidentity, proctree
from tests.conftest import wait_for, workload


@contextmanager
def _job(tmp_path: Path, *argv: str) -> Iterator[tuple[int, Path]]:
    log = tmp_path / "out.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--", "setsid", "tini", "-g", "--", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    init = wait_for(lambda: next(iter(proctree.children(proc.pid)), None), what="namespace init")
    wait_for(lambda: log.read_text().count("\n") >= 3, what="three lines")
    try:
        yield init, log
    finally:
        proctree.signal_tree(init, signal.SIGKILL)
        proc.wait()


def _dump(tmp_path: Path, init: int) -> Path:
    images = tmp_path / "img"
    images.mkdir()
    # Left running: CRIU lifts its network lock again, as after a restore elsewhere.
    CRIU(find_criu(), tmp_path / "logs").dump(
        init, images, DumpOptions(leave_running=True), "dump.log"
    )
    return images


@pytest.fixture
def peer() -> Iterator[int]:
    """A ping server outside the job, on loopback."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        with conn, conn.makefile("rb") as lines:
            try:
                for _ in lines:
                    conn.sendall(b"pong\n")
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


def test_connection_inside_the_job_over_loopback_comes_back(tmp_path: Path) -> None:
    port = random.randrange(20000, 30000)
    with _job(tmp_path, *workload("tcpconn.py", port)) as (init, _):
        images = _dump(tmp_path, init)
        found = [s for s in netidentity.sockets(images) if s.connected_tcp]
        # Both ends are in the images, each the other's reverse.
        assert len(found) == 2, found
        a, b = found
        assert (a.src, a.sport, a.dst, a.dport) == (b.dst, b.dport, b.src, b.sport)
        assert {a.sport, a.dport} >= {port} and a.src == "127.0.0.1"
        plan = netidentity.plan(images, "c")
        assert plan.close == [] and plan.notes == [] and not plan.all_closed


def test_connection_to_a_peer_outside_without_its_lock_here_is_closed(
    tmp_path: Path, peer: int
) -> None:
    with _job(tmp_path, *workload("tcppeer.py", peer)) as (init, _):
        images = _dump(tmp_path, init)
        plan = netidentity.plan(images, "c")
        assert [(s.dst, s.dport) for s in plan.close] == [("127.0.0.1", peer)]
        assert plan.all_closed
        assert plan.notes == [
            "1 TCP connection to a peer outside the job was closed on the move (the job reads "
            f"end-of-file, as when a peer closes): 127.0.0.1:{peer}"
        ]


def test_only_the_outside_connection_is_closed_or_all_where_criu_cannot_choose(
    tmp_path: Path, peer: int
) -> None:
    port = random.randrange(20000, 30000)
    with _job(tmp_path, *workload("tcpmixed.py", "127.0.0.1", peer, port)) as (init, _):
        images = _dump(tmp_path, init)
        plan = netidentity.plan(images, "c", find_criu())
        assert [(s.dst, s.dport) for s in plan.close] == [("127.0.0.1", peer)]
        assert not plan.all_closed and len(plan.notes) == 1
        # A criu without patch 0005 closes every connection rather than fail the restore.
        plain = netidentity.plan(images, "c", "/bin/true")
        assert plain.all_closed and len(plain.close) == 3
        assert plain.notes[1].startswith(
            "1 TCP connection that could have come back was "
            "closed too: /bin/true cannot close only some"
        )
