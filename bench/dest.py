"""Destinations: a private tmpfs (mounted for the run, unmounted after) and a directory on /.

On `disk` stasis uses its default store (<state_dir>/checkpoints, on /); the plain CRIU images and
the raw copy go to a sibling directory on the same filesystem. On `tmpfs` all three go to the
tmpfs; stasis' state (database, logs) stays on disk either way.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import BenchError

# "remote": a tmpfs too, but the store is reached as `dir::file://` (fsspec, the code path of an
# object store: images fetched, or served to a lazy restore by the daemon's page server).
# "s3": a real S3 server (SeaweedFS, started here, its data on disk) as the store; the raw
# baseline is s3fs uploading and downloading the same bytes, the CRIU one `criu dump` to the tmpfs
# then that upload (and the download before `criu restore`).
DESTS = ("tmpfs", "disk", "remote", "s3")
GiB = 1 << 30


@dataclass
class Destination:
    name: str
    scratch: Path  # plain CRIU images and the raw copy
    store: Path | None  # stasis' store; None: the daemon's default store on disk
    mounted: Path | None = None
    url: str | None = None  # how the daemon names `store`, when not by its path
    env: dict[str, str] = field(default_factory=dict)  # for the daemon (S3 keys, endpoint)
    s3: Any = None  # the S3Server of an "s3" destination
    bucket: str = ""

    def filesystem(self) -> Any:
        """An s3fs filesystem on the destination's S3 server (s3 only)."""
        return self.s3.filesystem()

    def teardown(self) -> None:
        if self.s3 is not None:
            self.s3.stop()
            self.s3 = None
        if self.mounted is not None:
            subprocess.run(["umount", str(self.mounted)], check=False)
            self.mounted = None


def make_destination(name: str, root: Path, tmpfs_bytes: int) -> Destination:
    base = root / name
    base.mkdir(parents=True, exist_ok=True)
    if name == "disk":
        scratch = base / "scratch"
        scratch.mkdir(exist_ok=True)
        return Destination(name, scratch, None)
    if name in ("tmpfs", "remote", "s3"):
        mnt = base / "mnt"
        mnt.mkdir(exist_ok=True)
        # A tmpfs takes memory only for what is in it; the size cap is a guard against runaway.
        done = subprocess.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size={tmpfs_bytes},mode=0755",
                "stasis-bench",
                str(mnt),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise BenchError(f"cannot mount a tmpfs at {mnt}: {done.stderr.strip()}")
        scratch = mnt / "scratch"
        scratch.mkdir()
        store = mnt / "store"
        if name == "s3":
            from tests.s3server import S3Server  # the tests' server: bench needs the dev extra

            # On disk: the server frees deleted objects only when it compacts its volumes, so a
            # suite's worth of them would fill a tmpfs.
            server = S3Server(base / "s3")
            server.start()
            bucket = server.make_bucket("stasis-bench")
            return Destination(
                name,
                scratch,
                store,
                mounted=mnt,
                url=f"s3://{bucket}/ckpt",
                env=server.env(),
                s3=server,
                bucket=bucket,
            )
        url = f"dir::file://{store}" if name == "remote" else None
        return Destination(name, scratch, store, mounted=mnt, url=url)
    raise ValueError(f"unknown destination {name!r}; known: {', '.join(DESTS)}")


def available_bytes() -> int:
    """MemAvailable: free memory plus what the kernel can reclaim (clean page cache)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise BenchError("no MemAvailable in /proc/meminfo")


def bytes_needed(size: int, dest: str) -> int:
    """Peak memory of one step of a case, with a margin.

    At most one workload runs at a time (a leave-running original is killed before the restore),
    but on tmpfs its image lives in memory beside it, and the raw read holds file + copy.
    """
    images = size if dest in ("tmpfs", "remote", "s3") else 0
    return int(max(size + images, 2 * size) * 1.15) + 2 * GiB


def clear_dir(path: Path) -> None:
    for entry in path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
