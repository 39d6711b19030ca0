"""Holds N MiB of mostly-zero pages, each written once; prints "ready"."""

import sys
import time

size = int(sys.argv[1]) << 20
block = bytearray(size)
for i in range(0, size, 4096):
    block[i] = 1
print("ready", flush=True)
while True:
    time.sleep(1)
