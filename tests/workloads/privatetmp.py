"""Keeps its state in /tmp and /var/tmp (stasis run --private-tmp): files there, one held open,
and links the job's user planted to what they may not write (an attacker's attempt to have a
restore, which root runs, write through them). Prints "N a=... b=... held=..." every 0.1 s, N
counting in memory, the rest read back from the files: after a restore both must go on.

Arguments: a token naming the files, a file and a directory the links point at."""

import itertools
import os
import sys
import time

token, target_file, target_dir = sys.argv[1:4]
a, b = f"/tmp/{token}-a", f"/var/tmp/{token}-b"
with open(a, "w") as f:
    f.write(f"a-{token}")
with open(b, "w") as f:
    f.write(f"b-{token}")
os.symlink(target_file, f"/tmp/{token}-link-file")
os.symlink(target_dir, f"/tmp/{token}-link-dir")
os.makedirs(f"/tmp/{token}-sub/deeper")
os.symlink(target_dir, f"/tmp/{token}-sub/deeper/link-dir")
held = open(f"/tmp/{token}-held", "w+")
for i in itertools.count():
    held.seek(0)
    held.write(f"{i:08d}")
    held.flush()
    held.seek(0)
    with open(a) as fa, open(b) as fb:
        print(i, f"a={fa.read()}", f"b={fb.read()}", f"held={int(held.read())}", flush=True)
    time.sleep(0.1)
