"""Two processes joined by a pipe: the child counts, the parent prints what arrives."""

import itertools
import os
import time

r, w = os.pipe()
if os.fork() == 0:
    os.close(r)
    for i in itertools.count():
        os.write(w, f"{i}\n".encode())
        time.sleep(0.1)
os.close(w)
with os.fdopen(r) as pipe:
    for line in pipe:
        print("got", line.strip(), flush=True)
