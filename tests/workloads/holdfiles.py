"""Counts, holding files open without touching them: one read-only, one write-only with
O_APPEND (as a log is), one read-write. A restore must reopen each by path.

    holdfiles.py READ APPEND READWRITE
"""

import itertools
import os
import sys
import time

read_path, append_path, rw_path = sys.argv[1:4]
held = [
    os.open(read_path, os.O_RDONLY),
    os.open(append_path, os.O_WRONLY | os.O_APPEND),
    os.open(rw_path, os.O_RDWR),
]
for n in itertools.count():
    print(n, flush=True)
    time.sleep(0.1)
