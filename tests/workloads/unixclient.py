"""A client of a unix stream server: `unixclient.py PATH` connects to PATH and, every 0.1 s,
sends a number and prints what came back ("echo N"), for as long as the connection holds."""

import itertools
import socket
import sys
import time

conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(sys.argv[1])
f = conn.makefile("rwb", buffering=0)
for i in itertools.count():
    f.write(b"%d\n" % i)
    print("echo", f.readline().decode().strip(), flush=True)
    time.sleep(0.1)
