"""A job that keeps its state in node-local files (issue 29): `nodelocal.py KINDS TAG INTERVAL`,
KINDS a comma-separated choice of

    tmp     a tempfile.NamedTemporaryFile under /tmp, kept open: the count is read back from it
    vartmp  the same under /var/tmp
    sock    a unix socket under /tmp, served by a child process that holds the count in its
            memory: each tick connects to the PATH again and asks for the next number
    shm     a SQLite database in /dev/shm (WAL), kept open: the count is a row updated each tick

Each tick every kind gives its next number; all must agree (the job says MISMATCH and exits 3
when they do not, and ends with an error when a file's content is gone). It prints
`count N` once they agree: N goes on across a checkpoint and restore only if each store's state
came along, on whatever node the job is restored on.
"""

import os
import socket
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable

kinds = sys.argv[1].split(",")
tag = sys.argv[2]
interval = float(sys.argv[3])


class FileCount:
    def __init__(self, directory: str) -> None:
        self.f = tempfile.NamedTemporaryFile(prefix=f"{tag}-", dir=directory)
        self.f.write(b"0")
        self.f.flush()

    def next(self) -> int:
        self.f.seek(0)
        n = int(self.f.read().decode()) + 1  # an empty file (content lost) fails here
        self.f.seek(0)
        self.f.truncate()
        self.f.write(str(n).encode())
        self.f.flush()
        return n


class SocketCount:
    def __init__(self) -> None:
        self.path = os.path.join(tempfile.mkdtemp(prefix=f"{tag}-", dir="/tmp"), "count.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self.path)
        server.listen()
        if os.fork() == 0:
            count = 0
            while True:
                conn, _ = server.accept()
                with conn:
                    count += 1
                    conn.sendall(f"{count}\n".encode())
        server.close()

    def next(self) -> int:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(self.path)
            return int(c.makefile().readline())


class SqliteCount:
    def __init__(self) -> None:
        fd, path = tempfile.mkstemp(prefix=f"{tag}-", suffix=".db", dir="/dev/shm")
        os.close(fd)
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None)
        # WAL (its -wal and -shm files mapped, carried too), as most applications run it: in
        # rollback-journal mode SQLite refuses to write to a database whose inode number
        # changed since it opened it (SQLITE_READONLY_DBMOVED), as any file recreated on
        # another node has.
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("CREATE TABLE c (n INTEGER)")
        self.db.execute("INSERT INTO c VALUES (0)")

    def next(self) -> int:
        self.db.execute("UPDATE c SET n = n + 1")
        return int(self.db.execute("SELECT n FROM c").fetchone()[0])


Store = FileCount | SocketCount | SqliteCount
makers: dict[str, Callable[[], Store]] = {
    "tmp": lambda: FileCount("/tmp"),
    "vartmp": lambda: FileCount("/var/tmp"),
    "sock": SocketCount,
    "shm": SqliteCount,
}
stores = {k: makers[k]() for k in kinds}
print(
    "ready",
    " ".join(f"{k}={s.f.name if isinstance(s, FileCount) else s.path}" for k, s in stores.items()),
    flush=True,
)
while True:
    got = {k: s.next() for k, s in stores.items()}
    if len(set(got.values())) != 1:
        print("MISMATCH", got, flush=True)
        sys.exit(3)
    print("count", next(iter(got.values())), flush=True)
    time.sleep(interval)
