"""A job whose state is in node-local files as well as in its memory (issue 29):
`keeplocal.py KIND DIR [BYTES]`, each tick counting on in memory and in the file, and printing
`count N` only when both agree (else `MISMATCH`, exit 3): after a restore the count goes on only
if the file came back with its content. KIND:

    tmp    a tempfile under DIR, kept open: the count is written to it and read back
    shm    a SQLite database under DIR (/dev/shm), kept open (WAL: its -wal and -shm files
           beside it, the latter mapped): a row updated each tick
    fifo   a FIFO DIR/fifo, kept open read-write: each count goes through it
    sock   a unix socket DIR/sock: a thread hands each client the next number of a count in
           memory (`next N`), as a server with its socket in /tmp does
    big    a tempfile of BYTES under DIR (for the limit), and a small one beside it
"""

import os
import socket
import sqlite3
import sys
import tempfile
import threading
import time
from typing import IO, Callable

kind, directory = sys.argv[1], sys.argv[2]
count = 0
kept: list[
    IO[bytes]
] = []  # open for as long as the job runs (a NamedTemporaryFile collected is deleted)


def file_kind() -> Callable[[int], int]:
    f = tempfile.NamedTemporaryFile(prefix="keep-", dir=directory)

    def tick(n: int) -> int:
        f.seek(0)
        text = f.read().decode()
        was = int(text) if text else 0  # an empty file (its content lost) fails the count
        f.seek(0)
        f.truncate()
        f.write(str(n).encode())
        f.flush()
        return was + 1

    return tick


def shm_kind() -> Callable[[int], int]:
    fd, path = tempfile.mkstemp(prefix="keep-", suffix=".db", dir=directory)
    os.close(fd)
    db = sqlite3.connect(path, isolation_level=None)
    # WAL, as most applications run it: in rollback-journal mode SQLite refuses to write a
    # database file whose inode number changed since it opened it (SQLITE_READONLY_DBMOVED),
    # which a file recreated on another node always has.
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE c (n INTEGER)")
    db.execute("INSERT INTO c VALUES (0)")

    def tick(n: int) -> int:
        db.execute("UPDATE c SET n = n + 1")
        return int(db.execute("SELECT n FROM c").fetchone()[0])

    return tick


def fifo_kind() -> Callable[[int], int]:
    path = os.path.join(directory, "fifo")
    os.mkfifo(path, 0o640)
    fd = os.open(path, os.O_RDWR)

    def tick(n: int) -> int:
        os.write(fd, f"{n}\n".encode())
        return int(os.read(fd, 64).decode())

    return tick


def sock_kind() -> Callable[[int], int]:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(os.path.join(directory, "sock"))
    server.listen()

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                conn.sendall(f"next {count}\n".encode())

    threading.Thread(target=serve, daemon=True).start()
    return lambda n: n


def big_kind() -> Callable[[int], int]:
    big = tempfile.NamedTemporaryFile(prefix="big-", dir=directory)
    big.write(b"b" * int(sys.argv[3]))
    big.flush()
    small = tempfile.NamedTemporaryFile(prefix="small-", dir=directory)
    small.write(b"s" * 100)
    small.flush()
    kept.extend((big, small))
    return lambda n: n


tick = {"tmp": file_kind, "shm": shm_kind, "fifo": fifo_kind, "sock": sock_kind, "big": big_kind}[
    kind
]()
print("ready", flush=True)
while True:
    got = tick(count + 1)
    if got != count + 1:
        print("MISMATCH", got, count + 1, flush=True)
        sys.exit(3)
    count += 1
    print(f"count {count}", flush=True)
    time.sleep(0.1)
