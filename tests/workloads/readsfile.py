"""Counts, and reads its input file on every tick through a descriptor opened read-only at
start: what a restore depends on (the file must be there, as it was).

    readsfile.py FILE
"""
import itertools
import os
import sys
import time

fd = os.open(sys.argv[1], os.O_RDONLY)
for n in itertools.count():
    print(n, os.pread(fd, 8, 0).decode(errors="replace"), flush=True)
    time.sleep(0.1)
