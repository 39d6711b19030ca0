"""A job with a connection to a peer outside it (reconnecting when it is closed) beside one between
two of its processes (over loopback, or the address given); each line: the round (the job's
state), the in-job peer's count, the outside peer's count, the host name.
`tcpmixed.py PEER_HOST PEER_PORT INNER_PORT [INNER_HOST]`"""

import os
import socket
import sys
import time
from typing import TextIO

peer_host, peer_port, inner_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
inner_host = sys.argv[4] if len(sys.argv) > 4 else "127.0.0.1"
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1" if inner_host == "127.0.0.1" else "0.0.0.0", inner_port))
srv.listen()
if os.fork() == 0:
    conn, _ = srv.accept()
    srv.close()
    n = 0
    while conn.recv(64):
        n += 1
        conn.sendall(f"{n}\n".encode())
    os._exit(0)
srv.close()
inner = socket.create_connection((inner_host, inner_port))
inner_r = inner.makefile()


def connect() -> tuple[socket.socket, TextIO]:
    c = socket.create_connection((peer_host, peer_port))
    return c, c.makefile()


outer, outer_r = connect()
i = 0
while True:
    i += 1
    try:
        inner.sendall(b"x\n")
        inside = inner_r.readline().strip() or "closed"
    except OSError:
        inside = "closed"
    try:
        outer.sendall(b"ping\n")
        line = outer_r.readline()
        if not line:
            raise ConnectionError("end of file")
    except OSError as e:
        print(f"{i} inner {inside} reconnect after: {e}", flush=True)
        outer.close()
        outer, outer_r = connect()
        continue
    print(f"{i} inner {inside} peer {line.strip()} host {socket.gethostname()}", flush=True)
    time.sleep(0.1)
