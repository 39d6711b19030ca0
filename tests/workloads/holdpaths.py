"""Holds what a restore must reopen by path: an open file, a shared file mapping, a cwd and a
listening unix socket. Every tick prints its counter and what it reads through each of them, and
writes the counter through the file and the mapping (so a restore that reopened the wrong file
would show it, and would write into it).

    holdpaths.py FILE MAPPED SOCKET CWD
"""

import itertools
import mmap
import os
import socket
import sys
import time

path, mapped, sock_path, cwd = sys.argv[1:5]
fd = os.open(path, os.O_RDWR)
map_fd = os.open(mapped, os.O_RDWR)
view = mmap.mmap(map_fd, 0)
os.close(map_fd)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.bind(sock_path)
sock.listen()
os.chdir(cwd)
for n in itertools.count():
    seen = os.pread(fd, 16, 0)
    print(f"{n} file={seen!r} map={view[:16]!r} cwd={sorted(os.listdir('.'))}", flush=True)
    os.pwrite(fd, f"{n:08d}".encode(), 16)
    view[24:32] = f"{n:08d}".encode()
    time.sleep(0.1)
