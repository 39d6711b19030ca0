"""Holds N MiB of random bytes; on SIGUSR1 prints the sha256 of what it holds."""

import hashlib
import os
import signal
import sys
import time
from types import FrameType

size = int(sys.argv[1]) << 20
block = bytearray(os.urandom(size))
print("digest", hashlib.sha256(block).hexdigest(), flush=True)
asked = False


def on_usr1(_sig: int, _frame: FrameType | None) -> None:
    global asked
    asked = True


signal.signal(signal.SIGUSR1, on_usr1)
print("ready", flush=True)
while True:
    time.sleep(0.05)
    if asked:
        asked = False
        print("digest", hashlib.sha256(block).hexdigest(), flush=True)
