"""Two processes sharing a SysV shared memory segment, as database servers and many HPC codes do:
the parent counts into the segment, the child reads the count from it and prints it. After a
restore the printed count must go on from the checkpointed value: the segment came back, with
its contents, still shared.

    sysvshm.py [INTERVAL]
"""

import ctypes
import os
import sys
import time

IPC_PRIVATE, IPC_CREAT = 0, 0o1000
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)

interval = float(sys.argv[1]) if len(sys.argv) > 1 else 0.1
shm_id = libc.shmget(IPC_PRIVATE, 4096, IPC_CREAT | 0o600)
if shm_id < 0:
    sys.exit(f"shmget: {os.strerror(ctypes.get_errno())}")
address = libc.shmat(shm_id, None, 0)
counter = ctypes.c_long.from_address(address)
print(f"segment {shm_id}", flush=True)
if os.fork() == 0:
    last = -1
    while True:
        value = counter.value
        if value != last:
            print(f"shm {value}", flush=True)
            last = value
        time.sleep(interval / 4)
while True:
    counter.value += 1
    time.sleep(interval)
