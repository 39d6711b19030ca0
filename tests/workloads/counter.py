"""Counts in memory and prints each value: after a restore it must go on, not start again.

Arguments: the interval in seconds (0.1), and MiB of random memory to hold (0), which makes a
dump of it take a moment."""

import itertools
import os
import sys
import time

interval = float(sys.argv[1]) if len(sys.argv) > 1 else 0.1
held = os.urandom(int(sys.argv[2]) << 20) if len(sys.argv) > 2 else b""
for i in itertools.count():
    print(i, flush=True)
    time.sleep(interval)
