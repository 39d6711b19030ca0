"""Run inside a node (tests/e2e/test_jobnet.py): dump the tree of PID from a job's network
namespace with the engine, or restore one into the namespace that the node made for it, as the
node's daemon would. `dump PID IMAGES LOGS FREEZER` / `restore IMAGES LOGS NETNS_FILE`; prints
the restored tree's pid."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from stasis.daemon import jobnet
from stasis.engine import CRIU, DumpOptions, Owner, find_criu
from stasis.engine.restoring import restore_tree


def main(argv: list[str]) -> None:
    if argv[0] == "dump":
        pid, images, logs, freezer = int(argv[1]), Path(argv[2]), Path(argv[3]), argv[4]
        if jobnet.vni_of(pid) is None:
            sys.exit(f"pid {pid} is in no job network's namespace")
        CRIU(find_criu(), logs).dump(
            pid, images, DumpOptions(job_netns=True, freeze_cgroup=freezer), "dump.log"
        )
        return
    images, logs, netns = Path(argv[1]), Path(argv[2]), argv[3]
    fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = restore_tree(
            CRIU(find_criu(), logs), images, Owner(0, 0), [], "restore.log", job_netns_fd=fd
        )
    finally:
        os.close(fd)
    print(done.pid)


if __name__ == "__main__":
    main(sys.argv[1:])
