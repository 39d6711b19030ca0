"""A job's own pseudo-terminals (engine/privatepts.py): a tree whose ranks talk through ptys is
dumped with real CRIU and restored while every one of its pty numbers is taken in the node's
/dev/pts; it goes on from where it was, through the same terminals.

Everything lives outside /tmp and /dev/pts' numbers are only held, never assumed free."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stasis.engine import CRIU, DumpOptions, find_criu, privatepts, proctree
from stasis.errors import CheckpointError
from tests.conftest import wait_for
from tests.engine.conftest import end_trees

ROOT = Path(__file__).resolve().parents[2]

# The namespace init: its own devpts (as root, in a fresh mount namespace), its files opened in
# there, then the job.
INIT = """
import os, sys
from stasis.engine import privatepts
privatepts.enter(new_namespace=True)
os.closerange(3, 1024)
null = os.open(os.devnull, os.O_RDONLY)
log = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
os.dup2(null, 0); os.dup2(log, 1); os.dup2(log, 2); os.close(null); os.close(log)
os.setsid()
os.execv(sys.executable, [sys.executable, "-c", sys.argv[2], sys.argv[3]])
"""

# Two terminals, as Open MPI gives two ranks: each round goes through both and is counted.
JOB = """
import os, pty, sys, time
terminals = [pty.openpty() for _ in range(2)]
print("terminals", *(os.ttyname(s) for _, s in terminals), flush=True)
count = open(sys.argv[1], "w")
n = 0
while True:
    n += 1
    for master, slave in terminals:
        os.write(slave, f"{n}\\n".encode())
        # A read returns what the line discipline has pushed so far: "5" now, "\\r\\n" later.
        line = b""
        while not line.endswith(b"\\n"):
            line += os.read(master, 64)
        assert line.split()[-1] == str(n).encode(), line
    count.seek(0); count.write(f"{n:08d}"); count.flush()
    if n % 10 == 0:
        print("round", n, flush=True)
    time.sleep(0.05)
"""

# A restorer as the daemon's supervisor and Slurm's task are: a devpts of its own, the job's new
# output opened in that namespace and handed to CRIU in place of the old one, the tree restored
# as its child.
RESTORER = """
import json, os, sys
from pathlib import Path
from stasis.engine import CRIU, RestoreOptions, privatepts
privatepts.enter(new_namespace=True)
output = os.open(sys.argv[5], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
criu = CRIU(sys.argv[1], Path(sys.argv[2]))
options = RestoreOptions(inherit_fds=[(sys.argv[4].lstrip("/"), output)])
result = criu.restore(Path(sys.argv[3]), options, "restore.log")
print(json.dumps({"pid": result.pid}), flush=True)
os.waitpid(result.pid, 0)
"""


def _count(path: Path) -> int:
    text = path.read_text() if path.exists() else ""
    return int(text) if text.strip() else -1


def _hold_node_numbers(up_to: int) -> list[int]:
    """Opens ptys in the node's /dev/pts until the kernel hands out `up_to`: every lower number
    is then held (by us or by anyone else). Returns the descriptors to close."""
    fds: list[int] = []
    while True:
        master, slave = pty.openpty()
        fds += [master, slave]
        if int(os.ttyname(slave).rsplit("/", 1)[1]) >= up_to:
            return fds


def test_a_tree_on_its_own_terminals_restores_where_their_numbers_are_taken(
    scratch: Path,
) -> None:
    log, count = scratch / "job.log", scratch / "count"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = subprocess.Popen(
        ["unshare", "--pid", "--ipc", "--fork", "--", sys.executable, "-c", INIT, str(log), JOB]
        + [str(count)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )
    job: subprocess.Popen[bytes] | None = started
    held: list[int] = []
    restorer: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: _count(count) > 3, what="counting through its terminals")
        (init,) = proctree.children(started.pid)
        # Numbered from 0 in a devpts of its own, whatever the node's hold.
        assert "terminals /dev/pts/0 /dev/pts/1" in log.read_text(), log.read_text()
        mounts = Path(f"/proc/{init}/mountinfo").read_text()
        assert re.search(rf" /dev/pts .* - devpts {privatepts.SOURCE} ", mounts), mounts
        criu = CRIU(find_criu(), scratch / "logs")
        # Its numbers, 0 and 1, held in the node's /dev/pts: no restore may need them.
        held = _hold_node_numbers(2)
        pid, output = init, log
        # Twice: a restored tree, its output re-pointed at another file, is dumped again.
        for n in (1, 2):
            images = scratch / f"images-{n}"
            images.mkdir(mode=0o700)
            assert privatepts.only_own_pts(pid)
            criu.dump(pid, images, DumpOptions(), f"dump-{n}.log")
            # Its namespace stays out of the images: CRIU ran inside it.
            assert not list(images.glob("mountpoints-*.img")), sorted(images.iterdir())
            end_trees(job, restorer)
            job = None
            at = _count(count)
            new_output = scratch / f"job-{n}.log"
            restorer = _restorer(criu, scratch, images, str(output), new_output, env)
            assert restorer.stdout is not None
            line = restorer.stdout.readline()
            assert line, (scratch / "restorer.log").read_text()
            # It goes on from its count, each round still through both of its terminals, its
            # output in the new file.
            wait_for(lambda: _count(count) > at + 12, what=f"counting on after restore {n}")
            assert restorer.poll() is None
            assert "round" in new_output.read_text()
            pid = int(line.split(b":")[1].strip(b" }\n"))
            assert os.readlink(f"/proc/{pid}/fd/4") == "/dev/pts/0"
            output = new_output
    finally:
        for fd in held:
            os.close(fd)
        end_trees(job, restorer)


def _restorer(
    criu: CRIU, scratch: Path, images: Path, old_output: str, output: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    with (scratch / "restorer.log").open("wb") as errors:
        return subprocess.Popen(
            [sys.executable, "-c", RESTORER, criu.path, str(scratch / "logs"), str(images)]
            + [old_output, str(output)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=errors,
        )


def test_criu_never_runs_in_a_mount_namespace_its_user_controls(scratch: Path) -> None:
    """The attacker: a job's process that made a user namespace of its own and in it a mount
    namespace that looks like stasis's (the node's mounts, a devpts named like ours), where it
    could bind anything over what CRIU runs once CRIU is inside. Its dump is refused before
    CRIU starts, and the job runs on."""
    count = scratch / "count"
    job = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--", "sh", "-c"]
        + [
            f"mount -t devpts -o {privatepts.OPTIONS.replace(',gid=5', '')} "
            f"{privatepts.SOURCE} /dev/pts && exec {sys.executable} -c \"$0\" \"$1\"",
            JOB,
            str(count),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _count(count) > 3, what="counting")
        (init,) = proctree.children(job.pid)
        assert privatepts.only_own_pts(init)  # what it looks like
        images = scratch / "images"
        images.mkdir(mode=0o700)
        with pytest.raises(CheckpointError, match="not the one stasis gave it"):
            CRIU(find_criu(), scratch / "logs").dump(init, images, DumpOptions(), "dump.log")
        assert not list(images.iterdir())
        at = _count(count)
        wait_for(lambda: _count(count) > at + 3, what="the job counting on")
    finally:
        end_trees(job)


def test_the_spank_plugin_mounts_the_same_devpts() -> None:
    source = (ROOT / "stasis/slurm/files/stasis_spank.c").read_text()
    assert f'#define PTS_SOURCE "{privatepts.SOURCE}"' in source
    assert f'#define PTS_OPTIONS "{privatepts.OPTIONS}"' in source
