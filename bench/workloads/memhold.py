"""Hold N bytes of resident memory of one kind, then idle; report a digest on SIGUSR1.

    python memhold.py KIND BYTES        KIND: random | float32 | zero

Prints `ready <digest> <hash_s>` once the memory is resident (hash_s: how long the digest took on
resident memory, so that a lazy restore's page-in time can be told apart from hashing), then
`digest <digest> <hash_s>` after each SIGUSR1. The digest is a CRC-32 of the whole buffer: it only
has to catch a restore that lost or mixed up pages, and at ~4 GB/s it barely delays the answer.
"""

from __future__ import annotations

import mmap
import os
import signal
import sys
import time
import zlib

CHUNK = 64 << 20
PAGE = mmap.PAGESIZE


def fill_random(buf: mmap.mmap, size: int) -> None:
    try:
        import numpy as np
    except ImportError:  # 4x slower, same bytes quality
        for off in range(0, size, CHUNK):
            buf[off : off + min(CHUNK, size - off)] = os.urandom(min(CHUNK, size - off))
        return
    # SFC64 raw output: incompressible and ~4x faster than os.urandom, so 4 GiB starts in seconds.
    gen = np.random.SFC64(int.from_bytes(os.urandom(8), "little"))
    view = np.frombuffer(buf, dtype=np.uint8)
    for off in range(0, size, CHUNK):
        n = min(CHUNK, size - off)
        raw = gen.random_raw((n + 7) // 8).view(np.uint8)
        view[off : off + n] = raw[:n]


def fill_float32(buf: mmap.mmap, size: int) -> None:
    import numpy as np

    # Like the weights of a freshly initialised model: normal, small, float32.
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
    floats = np.frombuffer(buf, dtype=np.float32, count=size // 4)
    for off in range(0, floats.size, CHUNK // 4):
        part = floats[off : off + CHUNK // 4]
        rng.standard_normal(dtype=np.float32, out=part)
        part *= 0.02
    if size % 4:
        buf[size - size % 4 : size] = os.urandom(size % 4)


def fill_zero(buf: mmap.mmap, size: int) -> None:
    # One byte per page: every page is resident and written once, the rest stays zero.
    for off in range(0, size, PAGE):
        buf[off] = 1


FILLERS = {"random": fill_random, "float32": fill_float32, "zero": fill_zero}


def digest(buf: mmap.mmap, size: int) -> tuple[str, float]:
    start = time.monotonic()
    crc = 0
    view = memoryview(buf)
    for off in range(0, size, CHUNK):
        crc = zlib.crc32(view[off : off + CHUNK], crc)
    view.release()
    return f"{crc:08x}", time.monotonic() - start


def main() -> None:
    kind, size = sys.argv[1], int(sys.argv[2])
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    FILLERS[kind](buf, size)
    # A handler and a wakeup pipe, not sigwait: a task dumped inside sigwait is restored with
    # the signal UNblocked (the kernel shows CRIU the mask sigtimedwait lowered for the wait),
    # so a request arriving before it waits again killed it (SIGUSR1's default action). Each
    # signal writes one byte to the pipe: none is missed, none can kill.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    value, took = digest(buf, size)
    print(f"ready {value} {took:.4f}", flush=True)
    while True:
        if os.read(wake_r, 1) != bytes([signal.SIGUSR1]):
            continue
        value, took = digest(buf, size)
        print(f"digest {value} {took:.4f}", flush=True)


if __name__ == "__main__":
    main()
