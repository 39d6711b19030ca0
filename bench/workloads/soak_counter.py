"""tests/workloads/counter.py with the wall-clock time of each count: `VALUE UNIXTIME` a line.

    python soak_counter.py INTERVAL MARKER

The counter is the job's state (in memory only: a restore must bring it back, a rerun starts at
0). The time tells the soak (bench/soak.py) which counts a process made after a fault: the lowest
value counted after it, minus one, is where the job resumed from, whichever node's log holds it.
MARKER (the soak's label for the job) is only there to be found in /proc/PID/cmdline: a second
copy of the job running outside the daemon's records shows up by it.
"""

import itertools
import sys
import time

interval = float(sys.argv[1]) if len(sys.argv) > 1 else 0.1
for i in itertools.count():
    print(i, f"{time.time():.3f}", flush=True)
    time.sleep(interval)
