"""Finding, in a job network's namespace, the TCP sockets a killed part left to the kernel, on
which CRIU's bind of a restored listener would fail ("Address already in use"): the rows of
/proc/net/tcp{,6} read exactly, the closing ones no process holds (inode 0) told from those a
live process holds, and a real TIME-WAIT found in a real namespace."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from stasis.engine import jobnetns

_HEAD4 = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
    "timeout inode\n"
)
_HEAD6 = (
    "  sl  local_address                         remote_address                        st "
    "tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
)
# 100.64.1.1 listening on 41000 (inode 306, a live rank's), an accepted connection of it
# established (held), one it closed (TIME-WAIT, no inode), one closing (FIN-WAIT-1) and one
# not yet accepted (established, inode 0: the live listener's).
_TCP = _HEAD4 + (
    "   0: 01014064:A028 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000 0 306 "
    "1 0000000000000000 100 0 0 10 0\n"
    "   1: 01014064:A028 02014064:C350 01 00000000:00000000 00:00000000 00000000  1000 0 307 "
    "1 0000000000000000 20 4 30 10 -1\n"
    "   2: 01014064:A028 02014064:C351 06 00000000:00000000 03:00000665 00000000     0 0 0 3 "
    "0000000000000000\n"
    "   3: 01014064:A028 02014064:C352 04 00000001:00000000 01:00000030 00000002     0 0 0 1 "
    "0000000000000000 20 4 0 10 -1\n"
    "   4: 01014064:A028 02014064:C353 01 00000000:00000000 00:00000000 00000000  1000 0 0 1 "
    "0000000000000000 20 4 30 10 -1\n"
)
# ::1 in LAST-ACK, no inode; ::ffff:100.64.1.1 listening.
_TCP6 = _HEAD6 + (
    "   0: 00000000000000000000000001000000:1F90 00000000000000000000000001000000:D431 09 "
    "00000000:00000000 01:00000020 00000000     0        0 0 1 0000000000000000 20 4 0 10 -1\n"
    "   1: 0000000000000000FFFF000001014064:1F91 00000000000000000000000000000000:0000 0A "
    "00000000:00000000 00:00000000 00000000  1000        0 412 1 0000000000000000 100 0 0 10 0\n"
)


def test_rows_are_read_as_ss_shows_them() -> None:
    rows = jobnetns.parse_proc_tcp(_TCP)
    assert [(s.local, s.remote, s.state, s.inode) for s in rows] == [
        ("100.64.1.1:41000", "0.0.0.0:0", "LISTEN", 306),
        ("100.64.1.1:41000", "100.64.1.2:50000", "ESTAB", 307),
        ("100.64.1.1:41000", "100.64.1.2:50001", "TIME-WAIT", 0),
        ("100.64.1.1:41000", "100.64.1.2:50002", "FIN-WAIT-1", 0),
        ("100.64.1.1:41000", "100.64.1.2:50003", "ESTAB", 0),
    ]
    six = jobnetns.parse_proc_tcp(_TCP6)
    assert [(s.local, s.remote, s.state) for s in six] == [
        ("[::1]:8080", "[::1]:54321", "LAST-ACK"),
        ("100.64.1.1:8081", "[::]:0", "LISTEN"),
    ]
    # Both tables one after the other (cat of both): each header skipped.
    assert jobnetns.parse_proc_tcp(_TCP + _TCP6) == rows + six
    assert jobnetns.parse_proc_tcp(_HEAD4) == []


def test_only_closing_sockets_no_process_holds_are_orphans() -> None:
    found = jobnetns.orphans(jobnetns.parse_proc_tcp(_TCP + _TCP6))
    assert [str(s) for s in found] == [
        "100.64.1.1:41000 TIME-WAIT",
        "100.64.1.1:41000 FIN-WAIT-1",
        "[::1]:8080 LAST-ACK",
    ]
    # A live part's sockets are none: a listener, its connections, one not yet accepted.
    assert jobnetns.orphans(jobnetns.parse_proc_tcp(_TCP.splitlines()[0] + "\n")) == []
    held = _TCP.replace(" 0 0 0 3 ", " 0 0 999 3 ").replace(" 0 0 0 1 ", " 0 0 998 1 ")
    assert jobnetns.orphans(jobnetns.parse_proc_tcp(held)) == []


def test_a_row_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="not a row of /proc/net/tcp"):
        jobnetns.parse_proc_tcp(_HEAD4 + "   0: 01014064:A028 garbage\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="entering a network namespace is root's")
def test_a_connection_closed_here_is_found_in_the_namespace() -> None:
    # The side that closes first sits in TIME-WAIT, held by no process: an orphan.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        port = listener.getsockname()[1]
        accepted.close()
        time.sleep(0.05)
        client.close()
        time.sleep(0.05)
        found = jobnetns.netns_orphans(Path(f"/proc/{os.getpid()}/ns/net"))
    assert f"127.0.0.1:{port} TIME-WAIT" in [str(s) for s in found]
