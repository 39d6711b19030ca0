"""A server-like program for `stasis kill`: `stopper.py graceful MARKER` ends cleanly on TERM, INT
or HUP (writes "clean shutdown on SIGxxx" to MARKER, exits 0); `stopper.py stubborn MARKER`
ignores them all, so only SIGKILL ends it (and MARKER is never written)."""

import signal
import sys
import time

mode, marker = sys.argv[1], sys.argv[2]


def shut_down(signum: int, _frame: object) -> None:
    # What a real server does on TERM: finish, write its state, leave nothing half-done.
    with open(marker, "w") as f:
        f.write(f"clean shutdown on {signal.Signals(signum).name}\n")
    print("stopped", flush=True)
    sys.exit(0)


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, shut_down if mode == "graceful" else signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(0.05)
