"""The demo's job: counts once a second and holds 64 MiB of random bytes, printing their digest."""

import hashlib
import itertools
import os
import time

block = os.urandom(64 << 20)
for i in itertools.count():
    print(f"count {i} memory sha256 {hashlib.sha256(block).hexdigest()[:16]}", flush=True)
    time.sleep(0.5)
