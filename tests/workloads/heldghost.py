"""Holds a file it deleted: writes TEXT to PATH, unlinks it, keeps it open, and prints
"N TEXT" every 0.1 s, N counting in memory and TEXT read back from the deleted file (a
restore must bring both back: CRIU recreates the file as a ghost for it).

    heldghost.py PATH TEXT [MIB]

MIB: that many MiB of memory held besides (random: a dump and a restore copy each page).
"""

import itertools
import os
import sys
import time

path, text = sys.argv[1:3]
ballast = os.urandom(int(sys.argv[3]) << 20) if len(sys.argv) > 3 else b""  # MiB of memory
held = open(path, "w+")
held.write(text)
held.flush()
os.unlink(path)
for n in itertools.count():
    held.seek(0)
    print(n, held.read(), flush=True)
    time.sleep(0.1)
