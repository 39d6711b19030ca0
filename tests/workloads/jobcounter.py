"""Two parts of a job passing a counter over one TCP connection: `serve ADDRESS PORT` answers each
number with the next and the host name it runs on, its listening socket kept open; `count ADDRESS PORT` sends 1, then each
answer, printing what came back ("N on HOST"). The counter lives in both processes: a restore
that lost or repeated anything shows as a gap or a repeat in the client's lines."""

import socket
import sys
import time

mode, address, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "serve":
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((address, port))
    srv.listen()
    print("listening", flush=True)
    conn, _ = srv.accept()  # still listening on the job address, as MPI ranks do
    with conn, conn.makefile() as lines:
        for line in lines:
            conn.sendall(f"{int(line) + 1} on {socket.gethostname()}\n".encode())
else:
    conn = socket.create_connection((address, port), timeout=10)
    conn.settimeout(None)
    reader = conn.makefile()
    n = 1
    while True:
        conn.sendall(f"{n}\n".encode())
        answer = reader.readline()
        if not answer:
            sys.exit("the connection closed")
        print(answer.strip(), flush=True)
        n = int(answer.split()[0])
        time.sleep(0.05)
