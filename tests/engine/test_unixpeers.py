"""Unix stream connections across a process tree's edge (engine/unixpeers.py), found in real
processes: one in a network namespace of its own (as a part in a job network is), and the
commands an error names, each kept to one line."""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import sys
from pathlib import Path

from stasis.engine import unixpeers

# Connects to argv[1], says so, and stays connected.
_STAY = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
print("connected", flush=True)
time.sleep(600)
"""


def test_a_connection_from_another_network_namespace_is_found(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    path = tmp_path / "service.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen(1)
        listener.settimeout(30)
        p = subprocess.Popen(
            ["unshare", "--net", sys.executable, "-c", _STAY, str(path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(p)
        conn, _ = listener.accept()
        with conn:
            assert p.stdout is not None and p.stdout.readline() == "connected\n"
            inside = next(iter(unixpeers.socket_inodes(p.pid)))  # unshare exec'd it
            # This namespace's listing does not have the tree's end; the tree's does.
            assert inside not in unixpeers.unix_sockets()
            assert unixpeers.netns(p.pid) != unixpeers.netns(os.getpid())
            found = unixpeers.external_peers(p.pid)
            assert len(found) == 1, found
            assert found[0].address == str(path) and found[0].served_inside is False
            assert [h.pid for h in found[0].holders] == [os.getpid()]
            said = found[0].describe()
            assert f"is connected to {path}, served by pid {os.getpid()}" in said
            assert "\n" not in said  # its command, a multi-line program, on one line


def test_a_command_is_named_on_one_line(started: list[subprocess.Popen[str]]) -> None:
    # A name set by prctl (PR_SET_NAME) may hold control characters; another user sees it.
    program = (
        "import ctypes, time\n"
        "ctypes.CDLL(None).prctl(15, b'ab\\ncd\\x1b[31m', 0, 0, 0)\n"
        "print('named', flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline() == "named\n"
    mine = unixpeers.command(p.pid)
    python = os.path.basename(sys.executable)
    assert mine.startswith(f"{python} -c import ctypes, time ctypes.CDLL(None)"), mine
    assert "\n" not in mine
    theirs = unixpeers.command(p.pid, viewer=4242)
    assert theirs == f"ab cd [31m, user {pwd.getpwuid(os.getuid()).pw_name}", theirs


# Serves argv[1]: accepts one client, says so, and keeps it.
_SERVE = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(1)
print("listening", flush=True)
conn, _ = s.accept()
print("accepted", flush=True)
time.sleep(600)
"""


def test_a_client_outside_of_a_server_in_another_network_namespace_is_found(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    # The socket accept() gives the server lives in its client's namespace, not the server's:
    # looked for in this one too.
    path = tmp_path / "served.sock"
    p = subprocess.Popen(
        ["unshare", "--net", sys.executable, "-c", _SERVE, str(path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    started.append(p)
    assert p.stdout is not None and p.stdout.readline() == "listening\n"
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(str(path))
        assert p.stdout.readline() == "accepted\n"
        found = unixpeers.external_peers(p.pid)
        assert len(found) == 1, found
        assert found[0].address == str(path) and found[0].served_inside is True
        assert [h.pid for h in found[0].holders] == [os.getpid()]
        assert unixpeers.crosses_edge(p.pid)
