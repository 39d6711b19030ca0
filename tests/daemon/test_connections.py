"""Unfinished requests lock nobody out: a real ordinary user holding many half-sent requests
against a daemon with a service manager's low limit of open files. Root is still served, running
jobs stay running (the job poller never takes an error for an exit), slow requests are cut off,
and the daemon's log stays small."""

from __future__ import annotations

import json
import pwd
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.conftest import STASIS, Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error
from tests.daemon.test_restore_state import last_number

# A client that opens N connections to the daemon's socket, each sending the start of a request
# and never the rest (or trickling it), and reports when the daemon closed each one.
HOLDER = r"""
import json, select, socket, sys, time
path, n, mode, hold_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
start = time.monotonic()
socks, refused = [], 0
for i in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.2)
    try:
        s.connect(path)
        if mode == "headers":
            s.sendall(b"POST /jobs HTTP/1.1\r\nHost: stasis\r\n")
        elif mode == "body":
            s.sendall(b"POST /jobs HTTP/1.1\r\nHost: stasis\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"command\": ")
    except OSError:
        refused += 1
        s.close()
        continue
    s.setblocking(False)
    socks.append(s)
print("ready", len(socks), flush=True)
poller = select.poll()
for s in socks:
    poller.register(s, select.POLLIN)
closed = {}
by_fd = {s.fileno(): s for s in socks}
last_trickle = 0.0
while time.monotonic() - start < hold_s and len(closed) < len(socks):
    for fd, _ in poller.poll(50):
        s = by_fd[fd]
        try:
            data = s.recv(65536)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        if not data:
            closed[fd] = round(time.monotonic() - start, 2)
            poller.unregister(fd)
    if mode == "trickle" and time.monotonic() - last_trickle > 0.2:
        last_trickle = time.monotonic()
        for s in socks:
            if s.fileno() not in closed:
                try:
                    s.send(b"X")  # a header line that never ends
                except OSError:
                    pass
print(json.dumps({"opened": len(socks), "refused": refused,
                  "closed_after_s": sorted(closed.values())}), flush=True)
"""


class Holder:
    def __init__(
        self, d: Daemon, n: int, mode: str, hold_s: float, user: str | None = None
    ) -> None:
        cmd = ["python3", "-c", HOLDER, str(d.socket), str(n), mode, str(hold_s)]
        if user:
            cmd = ["runuser", "-u", user, "--", *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline().split()
        assert ready[:1] == ["ready"], ready
        self.opened = int(ready[1])

    def report(self) -> Any:
        out, _ = self.proc.communicate(timeout=60)
        return json.loads(out)


def _ps(d: Daemon) -> list[Any]:
    """Root's `stasis ps`, which must answer promptly."""
    result = subprocess.run(
        [STASIS, "ps", "--json"], env=d.env, capture_output=True, text=True, timeout=10
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def _state(d: Daemon, job_id: str) -> str:
    return str(next(j for j in _ps(d) if j["job"] == job_id)["state"])


def _daemon_log(d: Daemon) -> Path:
    return d.root / "daemon.log"


def test_one_users_half_sent_requests_lock_nobody_out(
    make_daemon: MakeDaemon, test_user: pwd.struct_passwd
) -> None:
    # 128 open files in all, as a (low) service manager's limit; the user tries for 200.
    d: Daemon = make_daemon(
        nofile=128, env={"STASIS_MAX_CONNECTIONS_PER_UID": "16", "STASIS_REQUEST_TIMEOUT_S": "30"}
    )
    job = d.run(*workload("counter.py"))
    wait_for(lambda: last_number(d, job["job"]) >= 2, what="counting")
    holder = Holder(d, 200, "headers", hold_s=4, user=test_user.pw_name)
    # While the user holds everything they could: root is served, and the job stays running
    # (several rounds of the daemon's job poller).
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        assert _state(d, job["job"]) == "running"
        time.sleep(0.3)
    # The user themselves is told why, in one line.
    one_line_error(
        d.cli("ps", user=test_user.pw_name, check=False),
        1,
        "too many connections",
        "max_connections_per_uid",
    )
    report = holder.report()
    # Only the user's share stayed open; the daemon closed the rest at once.
    assert report["opened"] + report["refused"] == 200
    still_open = report["opened"] - len(report["closed_after_s"])
    assert still_open <= 16, report
    assert _state(d, job["job"]) == "running"
    assert not (d.state_dir / "jobs" / job["job"] / "exit.json").exists()
    d.cli("kill", job["job"])


def test_root_exhausting_the_daemon_does_not_end_its_jobs(make_daemon: MakeDaemon) -> None:
    # Root is not capped: here root itself takes every file the daemon may open, so the daemon
    # meets EMFILE everywhere (accepting, reading /proc, SQLite). A job is not `exited` for that,
    # and the daemon's log does not fill the disk.
    d: Daemon = make_daemon(nofile=64, env={"STASIS_REQUEST_TIMEOUT_S": "30"})
    job = d.run(*workload("counter.py"))
    wait_for(lambda: last_number(d, job["job"]) >= 2, what="counting")
    before = _daemon_log(d).stat().st_size
    holder = Holder(d, 120, "headers", hold_s=3)
    holder.report()  # its connections close when it exits
    wait_for(lambda: _state(d, job["job"]) == "running", 10, "the daemon answering again")
    time.sleep(1.0)  # the poller runs again, with files to spare
    assert _state(d, job["job"]) == "running"
    assert not (d.state_dir / "jobs" / job["job"] / "exit.json").exists()
    grown = _daemon_log(d).stat().st_size - before
    assert grown < 64 << 10, f"daemon log grew {grown} bytes"
    d.cli("kill", job["job"])


def test_slow_requests_are_cut_off(make_daemon: MakeDaemon, test_user: pwd.struct_passwd) -> None:
    d: Daemon = make_daemon(env={"STASIS_REQUEST_TIMEOUT_S": "1"})
    user = test_user.pw_name
    holders = {
        mode: Holder(d, 3, mode, hold_s=5, user=user)
        for mode in ("nothing", "headers", "trickle", "body")
    }
    for mode, holder in holders.items():
        report = holder.report()
        assert len(report["closed_after_s"]) == 3, (mode, report)
        assert max(report["closed_after_s"]) < 3.5, (mode, report)
    _ps(d)  # and the daemon still serves whoever asks properly
