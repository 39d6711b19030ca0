"""Checkpoint and restore real jobs with real CRIU; each test proves the state came back."""

from __future__ import annotations

import os
import re
import signal
import socket

from stasis.engine import proctree
from tests.conftest import Daemon, wait_for, workload


def numbers(text: str, prefix: str = "") -> list[int]:
    return [int(m) for m in re.findall(rf"^{prefix}(\d+)$", text, re.M)]


def last_number(daemon: Daemon, job: str, prefix: str = "") -> int:
    found = numbers(daemon.log_of(job), prefix)
    return found[-1] if found else -1


def workload_pid(init_pid: int) -> int:
    """The workload's pid: the child of the job's init."""
    return wait_for(lambda: next(iter(proctree.children(init_pid)), None), what="workload process")


def test_counter_resumes_from_checkpointed_value(daemon: Daemon) -> None:
    job = daemon.run(*workload("counter.py"), label="counter")
    wait_for(lambda: last_number(daemon, job["job"]) >= 10, what="counter at 10")
    cp = daemon.json("dump", job["job"])
    assert cp["label"] == "counter" and cp["size_bytes"] > 0
    assert daemon.job(job["job"])["state"] == "checkpointed"
    assert not proctree.alive(job["pid"], None)
    at_dump = last_number(daemon, job["job"])

    restored = daemon.json("restore", cp["checkpoint"])
    assert restored["pid"] != job["pid"]

    def new_log() -> str:
        return daemon.log_of(restored["job"])

    wait_for(lambda: numbers(new_log())[-1] >= at_dump + 10, what="counter past the dump")
    values = numbers(new_log())
    # One log, one sequence: what came after the restore continues the dump's value, no restart.
    assert daemon.job(restored["job"])["state"] == "restored"
    after = values[values.index(at_dump) + 1 :]
    assert after[:5] == list(range(at_dump + 1, at_dump + 6))
    assert values.count(0) == 1


def test_memory_digest_survives(daemon: Daemon) -> None:
    job = daemon.run(*workload("memhold.py", 256))
    wait_for(lambda: "ready" in daemon.log_of(job["job"]), 60, "256 MiB allocated")
    before = re.findall(r"^digest (\w+)$", daemon.log_of(job["job"]), re.M)[0]
    cp = daemon.json("dump", job["job"])
    assert cp["size_bytes"] >= 256 << 20
    restored = daemon.json("restore", cp["checkpoint"])
    os.kill(workload_pid(restored["pid"]), signal.SIGUSR1)
    wait_for(
        lambda: len(re.findall(r"^digest", daemon.log_of(restored["job"]), re.M)) == 2,
        30,
        "digest after restore",
    )
    digests = re.findall(r"^digest (\w+)$", daemon.log_of(restored["job"]), re.M)
    assert digests == [before, before]
    daemon.cli("kill", restored["job"])


def test_process_tree_with_pipe(daemon: Daemon) -> None:
    job = daemon.run(*workload("pipetree.py"))
    wait_for(lambda: last_number(daemon, job["job"], "got ") >= 5, what="pipe traffic")
    assert len(proctree.tree(job["pid"])) == 3  # init, parent, child
    cp = daemon.json("dump", job["job"])
    at_dump = last_number(daemon, job["job"], "got ")
    restored = daemon.json("restore", cp["checkpoint"])
    wait_for(lambda: last_number(daemon, restored["job"], "got ") >= at_dump + 5, what="more")
    got = numbers(daemon.log_of(restored["job"]), "got ")
    assert got == list(range(len(got)))  # the child's count went on through the pipe, no gap
    assert len(proctree.tree(restored["pid"])) == 3
    daemon.cli("kill", restored["job"])


def test_multithreaded_process(daemon: Daemon) -> None:
    job = daemon.run(*workload("threads.py"))
    wait_for(lambda: last_number(daemon, job["job"], r"threads 5 total ") >= 40, what="threads")
    cp = daemon.json("dump", job["job"])
    at_dump = last_number(daemon, job["job"], r"threads 5 total ")
    restored = daemon.json("restore", cp["checkpoint"])
    wait_for(
        lambda: last_number(daemon, restored["job"], r"threads 5 total ") >= at_dump + 40,
        what="all threads counting after restore",
    )
    tail = numbers(daemon.log_of(restored["job"]), r"threads 5 total ")
    first_after = tail[tail.index(at_dump) + 1]
    assert at_dump < first_after < at_dump + 40  # continued from the total, not from 0
    daemon.cli("kill", restored["job"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _hit(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        return s.makefile().readline().strip()


def test_listening_tcp_server(daemon: Daemon) -> None:
    port = _free_port()
    job = daemon.run(*workload("tcpserver.py", port))
    wait_for(lambda: "listening" in daemon.log_of(job["job"]), what="server up")
    assert [_hit(port), _hit(port)] == ["hit 1", "hit 2"]
    cp = daemon.json("dump", job["job"])
    restored = daemon.json("restore", cp["checkpoint"])
    assert _hit(port) == "hit 3"
    daemon.cli("kill", restored["job"])


def test_established_tcp_connection(daemon: Daemon) -> None:
    port = _free_port()
    job = daemon.run(*workload("tcpconn.py", port))
    wait_for(lambda: last_number(daemon, job["job"], "pong ") >= 5, what="pongs")
    cp = daemon.json("dump", job["job"])
    at_dump = last_number(daemon, job["job"], "pong ")
    restored = daemon.json("restore", cp["checkpoint"])
    wait_for(
        lambda: last_number(daemon, restored["job"], "pong ") >= at_dump + 5,
        what="pongs over the restored connection",
    )
    pongs = numbers(daemon.log_of(restored["job"]), "pong ")
    assert pongs == list(range(1, len(pongs) + 1))  # same connection, the server's count went on
    daemon.cli("kill", restored["job"])


def test_two_restores_beside_the_running_original(daemon: Daemon) -> None:
    job = daemon.run(*workload("memhold.py", 8))
    wait_for(lambda: "ready" in daemon.log_of(job["job"]), what="ready")
    digest = re.findall(r"^digest (\w+)$", daemon.log_of(job["job"]), re.M)[0]
    cp = daemon.json("dump", job["job"], "--leave-running")
    assert daemon.job(job["job"])["state"] == "running"
    first = daemon.json("restore", cp["checkpoint"])
    second = daemon.json("restore", cp["checkpoint"])
    pids = {job["pid"], first["pid"], second["pid"]}
    assert len(pids) == 3 and all(proctree.alive(p, None) for p in pids)
    for r in (first, second):
        os.kill(workload_pid(r["pid"]), signal.SIGUSR1)
    # All three share one log: the original's digest line, then one from each restored copy.
    wait_for(lambda: daemon.log_of(first["job"]).count("digest") == 3, what="both digests")
    assert re.findall(r"^digest (\w+)$", daemon.log_of(first["job"]), re.M) == [digest] * 3
    for j in (job, first, second):
        daemon.cli("kill", j["job"])
    # Killed, they are reaped a moment later (longer on a loaded machine).
    wait_for(lambda: not any(proctree.alive(p, None) for p in pids), what="all three gone")


def test_leave_running_dump_keeps_job_and_restores(daemon: Daemon) -> None:
    job = daemon.run(*workload("counter.py"))
    wait_for(lambda: last_number(daemon, job["job"]) >= 3, what="counting")
    cp = daemon.json("dump", job["job"], "--leave-running")
    mark = last_number(daemon, job["job"])
    wait_for(lambda: last_number(daemon, job["job"]) >= mark + 5, what="original still counting")
    assert daemon.job(job["job"])["state"] == "running"
    daemon.cli("kill", job["job"])
    assert daemon.job(job["job"])["state"] == "exited"
    before = numbers(daemon.log_of(job["job"]))
    restored = daemon.json("restore", cp["checkpoint"])
    wait_for(lambda: len(numbers(daemon.log_of(restored["job"]))) > len(before) + 3, what="more")
    first_new = numbers(daemon.log_of(restored["job"]))[len(before)]
    # It picks up at the checkpoint (at most `mark`), behind where the original got to, not at 0.
    assert 1 <= first_new <= mark + 1 < before[-1]
    daemon.cli("kill", restored["job"])


def test_exit_code_is_recorded(daemon: Daemon) -> None:
    job = daemon.run("sh", "-c", "echo bye; exit 3")
    wait_for(lambda: daemon.job(job["job"])["state"] == "exited", what="job end")
    assert daemon.job(job["job"])["exit_code"] == 3
    assert daemon.log_of(job["job"]) == "bye\n"


def test_compressed_checkpoints_restore(daemon: Daemon) -> None:
    for method in ("zstd", "lz4"):
        job = daemon.run(*workload("memhold.py", 16))
        wait_for(lambda: "ready" in daemon.log_of(job["job"]), what="ready")
        digest = re.findall(r"^digest (\w+)$", daemon.log_of(job["job"]), re.M)[0]
        cp = daemon.json("dump", job["job"], "--compress", method)
        listed = daemon.json("checkpoints")
        assert next(c for c in listed if c["id"] == cp["checkpoint"])["compression"] == method
        restored = daemon.json("restore", cp["checkpoint"])
        os.kill(workload_pid(restored["pid"]), signal.SIGUSR1)
        wait_for(lambda: daemon.log_of(restored["job"]).count("digest") >= 2, what="digest")
        assert re.findall(r"^digest (\w+)$", daemon.log_of(restored["job"]), re.M)[-1] == digest
        daemon.cli("kill", restored["job"])
