"""What no checkpoint can carry, found in a live process tree (engine/obstacles.py): an io_uring
and an RDMA device. Real processes: tests/workloads/holdfd.c, built here.

There is no RDMA adapter on these machines, so no /dev/infiniband/uverbs* can be opened (a
device node made with mknod opens to ENXIO without its driver). The RDMA cases use stand-ins,
said as such: a regular file at /dev/infiniband/uverbs0 inside a mount namespace of the process's
own (the path /proc/PID/fd reads is the same a real device gives), and a file under a test-made
directory named like it, passed as the directory to look in."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from stasis.engine import obstacles, proctree


def _start(procs: list[subprocess.Popen[str]], *argv: str) -> subprocess.Popen[str]:
    """`argv` started; returns once holdfd (somewhere in it) holds what it was asked to."""
    p = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True
    )
    procs.append(p)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("holding fd "), line
    return p


def _holder(root: int) -> int:
    """The holdfd process of the tree under `root` (it may be `root`)."""
    for pid in proctree.tree(root):
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == "holdfd":
                return pid
    raise AssertionError(f"no holdfd under {root}")


def test_io_uring_is_found_and_named(holdfd: Path, started: list[subprocess.Popen[str]]) -> None:
    p = _start(started, str(holdfd), "io_uring")
    found = obstacles.unsupported_files(p.pid)
    assert found == [obstacles.UnsupportedFile(p.pid, 3, "anon_inode:[io_uring]", rdma=False)]
    why = obstacles.refusal(p.pid)
    assert why is not None and "\n" not in why
    assert why.startswith(f"pid {p.pid} (holdfd io_uring) holds an io_uring (fd 3), which CRIU ")
    assert "run it without io_uring" in why
    assert obstacles.find(p.pid).obstacles == [why]
    assert obstacles.explain(p.pid) == why


def test_found_deeper_in_the_tree(holdfd: Path, started: list[subprocess.Popen[str]]) -> None:
    # A shell that is not exec'd away: the holder is its child, and only the child is named.
    p = _start(started, "sh", "-c", f"{holdfd} io_uring; exit 0")
    child = _holder(p.pid)
    assert child != p.pid
    assert [f.pid for f in obstacles.unsupported_files(p.pid)] == [child]


def test_rdma_device_in_its_own_mount_namespace(
    holdfd: Path, started: list[subprocess.Popen[str]]
) -> None:
    """Stand-in: a regular file where the device would be, in a mount namespace of its own."""
    p = _start(
        started,
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        "mount -t tmpfs stand-in /dev && mkdir /dev/infiniband && : >/dev/infiniband/uverbs0 "
        f"&& exec {holdfd} /dev/infiniband/uverbs0",
    )
    holder = _holder(p.pid)
    assert not os.path.exists("/dev/infiniband/uverbs0")  # not on this machine: only in there
    found = obstacles.unsupported_files(p.pid)
    assert found == [obstacles.UnsupportedFile(holder, 3, "/dev/infiniband/uverbs0", rdma=True)]
    why = obstacles.refusal(p.pid)
    assert why is not None and "\n" not in why
    assert why.startswith(
        f"pid {holder} (holdfd /dev/infiniband/uverbs0) holds the RDMA device "
        "/dev/infiniband/uverbs0 (fd 3), which CRIU cannot checkpoint"
    )
    assert "run it over TCP" in why


def test_rdma_device_under_a_directory_named_like_it(
    holdfd: Path, started: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    """Stand-in: a file under a test-made .../dev/infiniband, named as the directory to look in."""
    ib = tmp_path / "dev" / "infiniband"
    ib.mkdir(parents=True)
    (ib / "uverbs1").touch()
    p = _start(started, str(holdfd), str(ib / "uverbs1"))
    assert obstacles.unsupported_files(p.pid) == []  # not the real directory
    found = obstacles.unsupported_files(p.pid, rdma_dirs=(f"{ib}/",))
    assert found == [obstacles.UnsupportedFile(p.pid, 3, str(ib / "uverbs1"), rdma=True)]
    # A file that merely starts like the directory is not in it.
    (tmp_path / "dev" / "infiniband-notes").touch()
    q = _start(started, str(holdfd), str(tmp_path / "dev" / "infiniband-notes"))
    assert obstacles.unsupported_files(q.pid, rdma_dirs=(f"{ib}/",)) == []


def test_nothing_held_nothing_said(holdfd: Path, started: list[subprocess.Popen[str]]) -> None:
    p = _start(started, str(holdfd), "/dev/null")
    assert obstacles.unsupported_files(p.pid) == []
    assert obstacles.refusal(p.pid) is None
    assert obstacles.explain(p.pid) is None
