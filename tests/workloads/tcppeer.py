"""A job with one TCP connection to a peer outside it: ping, print the answer, again."""

import os
import socket
import sys
import time

port, hold_mib = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0
blob = os.urandom(hold_mib << 20)  # memory that makes the checkpoint this big
conn = socket.create_connection(("127.0.0.1", port))
reader = conn.makefile()
while True:
    conn.sendall(b"ping\n")
    print(reader.readline().strip(), flush=True)
    time.sleep(0.1)
