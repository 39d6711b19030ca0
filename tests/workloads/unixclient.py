"""A client of a unix stream server: `unixclient.py PATH` connects to PATH and, every 0.1 s,
sends a number and prints what came back ("echo N"), for as long as the connection holds.
`unixclient.py PATH per-call [PAUSE_S]`: a connection for each number, closed once answered,
then PAUSE_S (0.2) without one (a job asking a node's service now and then: a credential, a
name lookup)."""

import itertools
import socket
import sys
import time


def connected() -> socket.SocketIO:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sys.argv[1])
    return conn.makefile("rwb", buffering=0)


per_call = sys.argv[2:3] == ["per-call"]
pause_s = float(sys.argv[3]) if per_call and len(sys.argv) > 3 else 0.2
f = None if per_call else connected()
for i in itertools.count():
    call = f or connected()
    call.write(b"%d\n" % i)
    print("echo", call.readline().decode().strip(), flush=True)
    if per_call:
        call.close()
    time.sleep(pause_s if per_call else 0.1)
