"""A unix stream server (run outside a job): `unixserver.py PATH [DELAY_S]` accepts clients on
PATH and echoes each line back (DELAY_S later), as a database server's socket directory or a
multiplexer's socket would."""

import os
import socket
import sys
import threading
import time

path = sys.argv[1]
delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
os.chmod(path, 0o777)  # jobs of any user may connect
server.listen()
print("listening", flush=True)


def serve(conn: socket.socket) -> None:
    with conn, conn.makefile("rwb", buffering=0) as f:
        for line in f:
            time.sleep(delay)
            f.write(line)


while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
