"""The engine: drives CRIU through its RPC protocol (`criu swrk`). Nothing else in stasis starts
`criu`. It knows processes and image directories, not jobs, stores or users: callers hand it a pid
and a local directory.

    rpc       one swrk session: protobuf messages over a SOCK_SEQPACKET pair, NOTIFY answered
    criu      dump / restore / version / feature check on top of rpc
    criulog   the first real error line of a CRIU log
    proctree  walking a process tree in /proc (resume stopped trees, resident memory)
    kdat      keeping CRIU's kernel-probe cache usable (a stale .tmp blocks it for good)
    check     the `stasis check` report
    unixpeers unix stream connections between a process tree and processes outside it
    obstacles what a dump of a tree would fail on, or not bring back as it was (`dump --check`)
    restoring the one way a job's tree is restored: its outputs and paths with its owner's rights
    netlock   CRIU's network lock: the firewall rules a dump leaves, lifting them
    pageserver CRIU's page-server protocol served from a page reader (lazy restore from a store)
    streamer  CRIU's image-streamer protocol: images handed to a restore through pipes
    nodefacts what a restore depends on (CPU, kernel, CRIU, user, open files), recorded at
              dump time and compared with the restoring node before CRIU runs
    nodelocal a job's node-local files (/tmp, /var/tmp, /dev/shm, $TMPDIR...) carried in its
              images and recreated before CRIU restores, never following a link
    jobnetns  a tree in its job's network namespace (daemon/jobnet.py): left out of the images,
              restored into the one the restoring node made
"""

from stasis.engine.criu import (
    CRIU,
    DumpOptions,
    DumpResult,
    Owner,
    RestoreOptions,
    RestoreResult,
    find_criu,
)

__all__ = [
    "CRIU",
    "DumpOptions",
    "DumpResult",
    "Owner",
    "RestoreOptions",
    "RestoreResult",
    "find_criu",
]
