"""A hostile Slurm job: in its own IPC namespace it plants a SysV segment under the key of
stasis's step book (stasis.slurm.steps), then counts like counter.py.

    hostile_book.py [INTERVAL] [STOP] [STEPS]

Without STEPS: a one-page segment whose header claims 256 KiB of records; a node daemon that
believed the header would read past the page and die. With STEPS: a well-formed book listing
that many steps, all ended, each of which the daemon records in Slurm with an srun of its own.

Prints "planted <shmid>" once, then 0, 1, 2, ... (STOP: then "done" and exit 0; 0: no end).
"""

import ctypes
import itertools
import os
import struct
import sys
import time

KEY = 0x53544550  # the book's key ("STEP")
MAGIC = 0x53545331
CLAIMED = (1 << 18) - 16  # all of a book's records
IPC_CREAT, IPC_EXCL = 0o1000, 0o2000

libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
libc.shmdt.argtypes = (ctypes.c_void_p,)

interval = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
stop = int(sys.argv[2]) if len(sys.argv) > 2 else 0
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 0
size = 1 << 18 if steps else os.sysconf("SC_PAGE_SIZE")
shm = libc.shmget(KEY, size, IPC_CREAT | IPC_EXCL | 0o600)
if shm < 0:
    sys.exit(f"shmget: {os.strerror(ctypes.get_errno())}")
address = libc.shmat(shm, None, 0)
if steps:
    records = b"".join(
        b'{"step":%d,"where":"stasis"}\n{"step":%d,"exit":0}\n' % (i, i) for i in range(steps)
    )[:CLAIMED]
    data = struct.pack("=4I", MAGIC, steps, len(records), 0) + records
else:
    record = b'{"step": 0, "where": "stasis", "argv": ["x"], "name": "x", "ntasks": 1}\n'
    data = struct.pack("=4I", MAGIC, 1, CLAIMED, 0) + record
ctypes.memmove(address, data, len(data))
libc.shmdt(address)
print(f"planted {shm}", flush=True)
for i in itertools.count():
    if stop and i >= stop:
        print("done", flush=True)
        break
    print(i, flush=True)
    time.sleep(interval)
