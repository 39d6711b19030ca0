"""Four threads each count; the main thread prints the total."""

import threading
import time

counts = [0, 0, 0, 0]


def work(n: int) -> None:
    while True:
        counts[n] += 1
        time.sleep(0.05)


for n in range(4):
    threading.Thread(target=work, args=(n,), daemon=True).start()
while True:
    print("threads", threading.active_count(), "total", sum(counts), flush=True)
    time.sleep(0.1)
