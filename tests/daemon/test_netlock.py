"""CRIU's network lock (issue 15, item 3): the DROP rules a dump that stops a job leaves for its
TCP connections go when they protect nothing any more, and a failed dump leaves the job's
connections working. The peer is a real TCP server in the test process, outside the job."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon, MakeDaemon, wait_for, workload


class Peer:
    """A TCP server outside the job that answers each `ping` line with `pong N`."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conn: socket.socket | None = None
        self.pongs = 0
        self.answering = True

    def accept(self) -> int:
        """Wait for the job to connect; the job's port."""
        self.listener.settimeout(20)
        self.conn, (_, job_port) = self.listener.accept()
        threading.Thread(target=self._serve, daemon=True).start()
        return int(job_port)

    def _serve(self) -> None:
        assert self.conn is not None
        reader = self.conn.makefile("rb")
        try:
            for _ in reader:
                if not self.answering:
                    return
                self.pongs += 1
                self.conn.sendall(f"pong {self.pongs}\n".encode())
        except OSError:
            return

    def probe(self, timeout_s: float) -> str:
        """Send to the job's side and say what came back: "silence" (the lock drops it),
        "reset" (no socket there any more) or "answer"."""
        self.answering = False
        assert self.conn is not None
        self.conn.settimeout(timeout_s)
        try:
            self.conn.sendall(b"are you there\n")
            data = self.conn.recv(4096)
        except TimeoutError:
            return "silence"
        except (ConnectionResetError, BrokenPipeError):  # a reset came back: EPIPE on send
            return "reset"
        return "answer" if data else "closed"

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.close()


def lock_rules(job_port: int) -> list[str]:
    """The CRIU lock rules in the firewall for the connection of the job's port."""
    saved = subprocess.run(
        ["iptables-save", "-t", "filter"], capture_output=True, text=True, check=True
    ).stdout
    ports = (f"--sport {job_port} ", f"--dport {job_port} ")
    return [
        line
        for line in saved.splitlines()
        if "0xc114" in line and any(p in line + " " for p in ports)
    ]


def start(d: Daemon, peer: Peer, hold_mib: int = 0) -> tuple[Any, int]:
    job = d.run(*workload("tcppeer.py", peer.port, hold_mib))
    job_port = peer.accept()
    wait_for(lambda: peer.pongs >= 3, what="the job talking to its peer")
    return job, job_port


def reset_within(peer: Peer, timeout_s: float) -> bool:
    """Whether the peer is told within `timeout_s` that the job's side is gone (its
    retransmissions, dropped while locked, now meet no socket and get a reset)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if peer.probe(1.0) in ("reset", "closed"):
            return True
    return False


def test_deleting_the_checkpoint_lifts_its_lock(daemon: Daemon, peer: Peer) -> None:
    job, job_port = start(daemon, peer)
    checkpoint = daemon.json("dump", job["job"])["checkpoint"]
    # Held for the checkpoint: the peer meets silence, not a reset, and the lock is listed.
    assert len(lock_rules(job_port)) == 2
    assert peer.probe(1.0) == "silence"
    report = daemon.json("check")
    held = [
        lock
        for lock in report["network_locks"]
        if f"--sport {job_port}" in lock["rule"] or f"--dport {job_port}" in lock["rule"]
    ]
    assert len(held) == 2 and {lock["checkpoint"] for lock in held} == {checkpoint}
    assert all(lock["release_at"] and lock["job"] == job["job"] for lock in held)
    text = daemon.cli("check", check=False).stdout
    assert f"held for checkpoint {checkpoint}" in text
    daemon.cli("checkpoints", "rm", checkpoint)
    assert lock_rules(job_port) == []
    assert reset_within(peer, 20), "the peer still hangs after the checkpoint went"


def test_lock_goes_after_the_timeout_even_across_a_daemon_restart(
    make_daemon: MakeDaemon, peer: Peer
) -> None:
    d: Daemon = make_daemon(env={"STASIS_NETLOCK_TIMEOUT_S": "8"})
    job, job_port = start(d, peer)
    d.json("dump", job["job"])
    assert len(lock_rules(job_port)) == 2
    d.stop()  # the lock is recorded: a daemon started later still lifts it
    assert len(lock_rules(job_port)) == 2
    d.start()
    wait_for(lambda: lock_rules(job_port) == [], 30, "the lock to time out")
    # The daemon logs it just after the rules went: wait for the line, do not race it.
    wait_for(lambda: "held for 8 s" in (d.root / "daemon.log").read_text(), 10, "the log line")
    assert reset_within(peer, 20)


def test_restoring_here_lets_criu_lift_the_lock_and_forgets_it(daemon: Daemon, peer: Peer) -> None:
    job, job_port = start(daemon, peer)
    checkpoint = daemon.json("dump", job["job"])["checkpoint"]
    assert len(lock_rules(job_port)) == 2
    before = peer.pongs
    restored = daemon.json("restore", checkpoint)
    wait_for(lambda: peer.pongs > before + 3, what="the restored job talking again")
    assert lock_rules(job_port) == []
    # Nothing held any more: deleting the checkpoint now removes no rule of anyone's.
    assert [
        lock for lock in daemon.json("check")["network_locks"] if f"{job_port}" in lock["rule"]
    ] == []
    daemon.cli("kill", restored["job"])


def test_restored_on_another_node_lifts_the_lock_on_the_first(
    make_daemon: MakeDaemon, site_key: Path, peer: Peer
) -> None:
    node_a: Daemon = make_daemon(
        env={"STASIS_SITE_KEY": str(site_key), "STASIS_NODE_NAME": "node-a"}
    )
    node_b: Daemon = make_daemon(
        store=node_a.store, env={"STASIS_SITE_KEY": str(site_key), "STASIS_NODE_NAME": "node-b"}
    )
    job, job_port = start(node_a, peer)
    checkpoint = node_a.json("dump", job["job"])["checkpoint"]
    restored = node_b.json("restore", checkpoint)
    # Both nodes share this machine's firewall, so node B's CRIU lifts the rules; node A
    # must learn from the store that its lock is done with, and drop it.
    wait_for(
        lambda: "the checkpoint was restored on another node"
        in (node_a.root / "daemon.log").read_text(),
        20,
        "node A to drop its lock",
    )
    assert (Path(node_a.store) / checkpoint / "restored.json").exists()
    node_b.cli("kill", restored["job"])


def test_failed_dump_leaves_the_jobs_connections_working(
    make_daemon: MakeDaemon, world_tmp: Path, peer: Peer
) -> None:
    # CRIU succeeds (its images go to local staging), then the upload to the store fails: the
    # job was stopped with its connection locked, and must come back with it working.
    mnt = world_tmp / f"full-store-{os.getpid()}"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=755", "tmpfs", str(mnt)], check=True
    )
    try:
        d: Daemon = make_daemon(store=f"dir::file://{mnt}")
        job, job_port = start(d, peer, hold_mib=16)
        result = d.cli("dump", job["job"], check=False)
        assert result.returncode == 1 and "still running" in result.stderr
        assert "space" in result.stderr
        assert lock_rules(job_port) == []
        before = peer.pongs
        wait_for(lambda: peer.pongs > before + 5, 10, "the job talking to its peer again")
        assert d.job(job["job"])["state"] == "running"
        d.kill_all()
        d.stop()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
