"""An established loopback TCP connection inside the job: a client pings a server process."""

import itertools
import os
import socket
import sys
import time

port = int(sys.argv[1])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen()
if os.fork() == 0:
    conn, _ = srv.accept()
    srv.close()
    n = 0
    while data := conn.recv(64):
        n += 1
        conn.sendall(f"pong {n}\n".encode())
    os._exit(0)
srv.close()
cli = socket.create_connection(("127.0.0.1", port))
reader = cli.makefile()
for _ in itertools.count():
    cli.sendall(b"ping\n")
    print(reader.readline().strip(), flush=True)
    time.sleep(0.1)
