"""A job's network identity on a move, on a local Slurm cluster of two real nodes (each its own
network namespace, address and host name, its own stasis daemon; one store): a server listening
on all addresses listens again on the new node; a connection to a peer outside the job is closed
with a note there (CRIU failed the whole restore before) while one inside the job keeps working,
and no network lock rule is left on either node; on the node that dumped it the connection is
kept; a server bound to the old node's address is refused before CRIU, in one line; the job sees
the new node's host name."""

from __future__ import annotations

import json
import random
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import STASIS, TEST_USER, WORKLOADS
from tests.e2e.conftest import Cluster, close_cluster, new_cluster, until

# A server on 0.0.0.0:PORT and 127.0.0.1:PORT+1, answering each connection with its hit count
# (the job's state) and the host name it sees.
SERVER = """\
import socket, sys, threading
host, port = sys.argv[1], int(sys.argv[2])
hits = 0
lock = threading.Lock()
def serve(srv):
    global hits
    while True:
        conn, _ = srv.accept()
        with lock:
            hits += 1
            conn.sendall(f"hit {hits} on {socket.gethostname()}\\n".encode())
        conn.close()
def listen(addr):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen()
    return srv
srv = listen(host)
if host == "0.0.0.0":
    port += 1
    threading.Thread(target=serve, args=(listen("127.0.0.1"),), daemon=True).start()
    port -= 1
print("listening", flush=True)
serve(srv)
"""

LINE = re.compile(r"^(\d+) inner (\S+) (?:peer (\d+) host (\S+)|reconnect after: (.*))$", re.M)


class Peer:
    """A TCP server outside the job (on this machine, at the nodes' bridge address): counts the
    pings of each connection and remembers where each came from."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, 0))
        self.sock.listen()
        self.address, self.port = address, self.sock.getsockname()[1]
        self.sources: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, source = self.sock.accept()
            except OSError:
                return
            self.sources.append(source[0])
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket) -> None:
        n = 0
        with conn, conn.makefile("rb") as lines:
            try:
                for _ in lines:
                    n += 1
                    conn.sendall(f"{n}\n".encode())
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def two() -> Iterator[Cluster]:
    c = new_cluster("netid", nodes=2)
    (c.work / "server.py").write_text(SERVER)
    (c.work / "client.py").write_text((WORKLOADS / "tcpmixed.py").read_text())
    yield c
    close_cluster(c)


@pytest.fixture(scope="module")
def peer(two: Cluster) -> Iterator[Peer]:
    p = Peer(two.lay.host_address())
    yield p
    p.close()


def _addr(c: Cluster, node: str) -> str:
    return c.on(node, "ip", "-4", "-o", "addr", "show", "eth0").stdout.split()[3].split("/")[0]


def _port() -> int:
    return random.randrange(20000, 30000)


def _run(c: Cluster, node: str, label: str, *argv: str) -> tuple[str, Path]:
    log = c.work / f"{label}.log"
    out = c.on(
        node,
        STASIS,
        "run",
        "--label",
        label,
        "--log",
        str(log),
        "--json",
        "--",
        "python3",
        "-u",
        *argv,
        user=TEST_USER,
    ).stdout
    return str(json.loads(out)["job"]), log


def _dump(c: Cluster, node: str, job: str) -> None:
    c.on(node, STASIS, "dump", job, "--json", user=TEST_USER)


def _restore(c: Cluster, node: str, label: str) -> dict[str, object]:
    answer: dict[str, object] = json.loads(
        c.on(node, STASIS, "restore", "--label", label, "--json", user=TEST_USER).stdout
    )
    return answer


def _kill(c: Cluster, node: str, job: object) -> None:
    c.on(node, STASIS, "kill", str(job), user=TEST_USER, check=False)


def _lock_rules(c: Cluster, node: str) -> list[str]:
    saved = c.on(node, "iptables-save", "-t", "filter").stdout
    return [line for line in saved.splitlines() if "0xc114" in line.lower()]


def _rounds(log: Path) -> list[tuple[int, str, str | None, str | None, str | None]]:
    return [
        (int(m[0]), m[1], m[2] or None, m[3] or None, m[4] or None)
        for m in LINE.findall(log.read_text())
    ]


def _ask(address: str, port: int) -> str:
    with socket.create_connection((address, port), timeout=10) as s:
        return s.makefile().readline().strip()


def test_server_on_all_addresses_listens_on_the_new_node_with_its_host_name(two: Cluster) -> None:
    port = _port()
    job, log = _run(two, "n1", "listener", str(two.work / "server.py"), "0.0.0.0", str(port))
    n1, n2 = _addr(two, "n1"), _addr(two, "n2")
    until(lambda: "listening" in log.read_text(), 30, "the server listening")
    assert _ask(n1, port) == "hit 1 on n1"
    _dump(two, "n1", job)
    answer = _restore(two, "n2", "listener")
    try:
        assert answer["notes"] == [], answer
        # Listening again on the new node's address (0.0.0.0) and on its loopback, its count
        # going on, and the host name it sees is the new node's: jobs have no UTS namespace of
        # their own.
        assert _ask(n2, port) == "hit 2 on n2"
        inside = two.on(
            "n2",
            "python3",
            "-c",
            "import socket; s = socket.create_connection("
            f"('127.0.0.1', {port + 1})); print(s.makefile().readline().strip())",
        )
        assert inside.stdout.strip() == "hit 3 on n2"
        with pytest.raises(OSError):
            _ask(n1, port)  # nothing listens on the old node any more
    finally:
        _kill(two, "n2", answer["job"])


def test_connection_to_a_peer_outside_the_job_is_closed_on_a_move_with_a_note(
    two: Cluster, peer: Peer
) -> None:
    job, log = _run(
        two, "n1", "mover", str(two.work / "client.py"), peer.address, str(peer.port), str(_port())
    )
    until(lambda: len(_rounds(log)) >= 5, 30, "five rounds on n1")
    _dump(two, "n1", job)
    before = _rounds(log)
    # The dump locked the connections on n1 (the outside peer waits for a restore).
    assert sum(f"--sport {peer.port} " in r for r in _lock_rules(two, "n1")) == 1
    answer = _restore(two, "n2", "mover")
    try:
        notes = answer["notes"]
        assert isinstance(notes, list) and len(notes) == 1, notes
        assert notes[0].startswith(
            "1 TCP connection to a peer outside the job was closed on " "the move"
        ), notes
        assert f"{peer.address}:{peer.port}" in notes[0], notes
        until(lambda: sum(1 for r in _rounds(log) if r[3] == "n2") >= 5, 30, "five rounds on n2")
        rounds = _rounds(log)
        after = rounds[len(before) :]
        # It read end-of-file (or EPIPE) on the closed connection once, reconnected from n2's
        # address, and went on from where it was: its rounds and the in-job connection's count
        # continue (that connection, over loopback, came back as it was).
        assert after[0][4] is not None and after[0][0] == before[-1][0] + 1, after[:2]
        assert [r[0] for r in rounds] == list(range(1, len(rounds) + 1))
        assert all(r[1] == str(r[0]) for r in rounds), rounds
        assert {r[3] for r in after[1:]} == {"n2"} and after[1][2] == "1", after[:3]
        assert peer.sources[-1] == _addr(two, "n2"), peer.sources
        # No network lock rule is left behind: n2 never had one, n1 lifts its own once it
        # reads in the store that the checkpoint was restored elsewhere.
        assert _lock_rules(two, "n2") == []
        until(lambda: _lock_rules(two, "n1") == [], 30, "n1's lock rules lifted")
    finally:
        _kill(two, "n2", answer["job"])


def test_connection_inside_the_job_over_the_old_nodes_address_is_closed_with_a_note(
    two: Cluster, peer: Peer
) -> None:
    n1 = _addr(two, "n1")
    job, log = _run(
        two,
        "n1",
        "selfish",
        str(two.work / "client.py"),
        peer.address,
        str(peer.port),
        str(_port()),
        n1,
    )
    until(lambda: len(_rounds(log)) >= 5, 30, "five rounds on n1")
    _dump(two, "n1", job)
    before = _rounds(log)
    answer = _restore(two, "n2", "selfish")
    try:
        notes = answer["notes"]
        assert isinstance(notes, list) and len(notes) == 2, notes
        assert notes[1].startswith(
            "1 TCP connection between processes of the job was closed "
            f"on the move: it runs over an address of the node that "
            f"checkpointed it ({n1})"
        ), notes
        until(lambda: sum(1 for r in _rounds(log) if r[3] == "n2") >= 3, 30, "three rounds on n2")
        after = _rounds(log)[len(before) :]
        assert after[0][0] == before[-1][0] + 1, (before, after)
        if after[0][1] != "closed":
            # The round the dump caught had its inside answer before it (the next count: the
            # job's state), its outside one after the restore: end-of-file, the move's close.
            assert after[0][1] == str(int(before[-1][1]) + 1), (before, after)
            assert after[0][4] is not None, after
            after = after[1:]
        # Both of its ends were closed (the job's own server end read end-of-file); the
        # connection to the outside peer was re-made, the job going on.
        assert after and {r[1] for r in after} == {"closed"}, after
    finally:
        _kill(two, "n2", answer["job"])


def test_connection_is_kept_on_the_node_that_dumped_it(two: Cluster, peer: Peer) -> None:
    job, log = _run(
        two, "n1", "stayer", str(two.work / "client.py"), peer.address, str(peer.port), str(_port())
    )
    until(lambda: len(_rounds(log)) >= 5, 30, "five rounds")
    # Rules of the tests before (a checkpoint restored on n2) may still be there, and go
    # meanwhile: what counts is what this dump added.
    earlier = set(_lock_rules(two, "n1"))
    _dump(two, "n1", job)
    added = set(_lock_rules(two, "n1")) - earlier
    assert any(f"--dport {peer.port} " in rule for rule in added), added
    connections = len(peer.sources)
    before = _rounds(log)
    answer = _restore(two, "n1", "stayer")
    try:
        assert answer["notes"] == [], answer
        until(lambda: len(_rounds(log)) >= len(before) + 5, 30, "five more rounds")
        after = _rounds(log)[len(before) :]
        # The same connection: no reconnect, the peer's count goes on where it was.
        assert all(r[4] is None for r in after), after
        assert int(after[0][2] or 0) == int(before[-1][2] or 0) + 1, (before[-1], after[0])
        assert len(peer.sources) == connections
        # CRIU lifted the dump's lock rules as it restored the connections.
        assert not set(_lock_rules(two, "n1")) & added
    finally:
        _kill(two, "n1", answer["job"])


def test_server_bound_to_the_old_nodes_address_is_refused_in_one_line(two: Cluster) -> None:
    port = _port()
    n1 = _addr(two, "n1")
    job, log = _run(two, "n1", "pinned", str(two.work / "server.py"), n1, str(port))
    until(lambda: "listening" in log.read_text(), 30, "the server listening")
    assert _ask(n1, port) == "hit 1 on n1"
    _dump(two, "n1", job)
    refused = two.on("n2", STASIS, "restore", "--label", "pinned", user=TEST_USER, check=False)
    assert refused.returncode != 0
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert f"listens on {n1}:{port}" in lines[0] and "0.0.0.0" in lines[0], lines[0]
    assert "pinned" not in two.on("n2", STASIS, "ps", user=TEST_USER).stdout
    # Nothing lost: the node that has the address restores it, its count going on.
    answer = _restore(two, "n1", "pinned")
    try:
        assert _ask(n1, port) == "hit 2 on n1"
    finally:
        _kill(two, "n1", answer["job"])


def test_slurm_job_requeued_to_another_node_reconnects_to_its_peer(
    two: Cluster, peer: Peer
) -> None:
    script = two.script(
        "slurmmover",
        f"exec python3 -u {two.work}/client.py {peer.address} {peer.port} " f"{_port()}",
        f"--output={two.work}/slurmmover-%j.out",
        "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=slurmmover",
    )
    job = two.sbatch(script, user=TEST_USER)
    two.wait_state(job, ("RUNNING",))
    first = two.job(job)["BatchHost"]
    other = "n2" if first == "n1" else "n1"
    out = Path(two.job(job)["StdOut"])
    until(lambda: out.exists() and len(_rounds(out)) >= 5, 30, "five rounds")
    # Its node goes into maintenance: the checkpoint requeues it, and it resumes on the other.
    two.run("scontrol", "update", f"NodeName={first}", "State=DRAIN", "Reason=e2e")
    try:
        assert (
            "requeued" in two.on(other, STASIS, "dump", "--slurm-job", job, user=TEST_USER).stdout
        )
        until(lambda: "stasis: restored checkpoint" in out.read_text(), 90, f"job {job} restored")
        assert two.job(job)["BatchHost"] == other
        # The job's output says which connection was closed.
        assert re.search(
            r"^stasis: note: 1 TCP connection to a peer outside the job was "
            rf"closed on the move .*: {re.escape(peer.address)}:{peer.port}$",
            out.read_text(),
            re.M,
        ), out.read_text()
        until(
            lambda: sum(1 for r in _rounds(out) if r[3] == other) >= 3,
            30,
            f"three rounds on {other}",
        )
        rounds = _rounds(out)
        assert [r[0] for r in rounds] == list(range(1, len(rounds) + 1))
        assert all(r[1] == str(r[0]) for r in rounds), rounds
        assert sum(1 for r in rounds if r[4] is not None) == 1, rounds
        assert peer.sources[-1] == _addr(two, other)
        until(lambda: _lock_rules(two, first) == [], 30, f"{first}'s lock rules lifted")
        assert _lock_rules(two, other) == []
    finally:
        two.run("scancel", job, check=False)
        two.run("scontrol", "update", f"NodeName={first}", "State=RESUME", check=False)
