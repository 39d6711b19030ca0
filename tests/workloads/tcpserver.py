"""A listening TCP server on 127.0.0.1:PORT that answers each connection with a hit counter."""

import socket
import sys

srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1])))
srv.listen()
print("listening", flush=True)
hits = 0
while True:
    conn, _ = srv.accept()
    hits += 1
    conn.sendall(f"hit {hits}\n".encode())
    conn.close()
