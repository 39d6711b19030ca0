"""Counts in memory and prints each value: after a restore it must go on, not start again."""
import itertools
import sys
import time

interval = float(sys.argv[1]) if len(sys.argv) > 1 else 0.1
for i in itertools.count():
    print(i, flush=True)
    time.sleep(interval)
