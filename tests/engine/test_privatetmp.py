"""A tree in a mount namespace of its own, as Slurm's job_container/tmpfs makes one (its /tmp a
bind of a per-job directory of the node's, /dev/shm a tmpfs of its own), dumped and restored
with real CRIU inside another such namespace, as a requeued job's task restores it: its /tmp is
then the new one's, whatever directory that is bound from, and its /dev/shm comes back with its
contents (engine/privatetmp.py).

Everything lives outside /tmp: the namespaces hide the node's /tmp."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.engine import CRIU, DumpOptions, find_criu, proctree
from tests.conftest import wait_for

JOB = """
import os, time
os.setsid()
with open("/dev/shm/x", "w") as f:
    f.write("shm-data")
count = open("/tmp/count", "w")
n = 0
while True:
    n += 1
    count.seek(0); count.write(f"{n:08d}"); count.flush()
    time.sleep(0.05)
"""

# The namespace a job container gives its job: the node's mounts as slaves, /tmp bound from
# the job's directory, a /dev/shm of its own; every file opened inside it.
CONTAINER = """
set -e
mount --make-rslave /
mount --bind "$1" /tmp
mount -t tmpfs -o size=1m stasis-test-shm /dev/shm
shift
exec </dev/null 2>>"$LOG"
[ -n "$ANSWER" ] || exec >>"$LOG"
exec "$@"
"""

RESTORER = """
import json, os, sys, time
from pathlib import Path
from stasis.engine import CRIU, RestoreOptions
criu = CRIU(sys.argv[1], Path(sys.argv[2]))
result = criu.restore(Path(sys.argv[3]), RestoreOptions(own_mounts=True), "restore.log")
print(json.dumps({"pid": result.pid}), flush=True)
os.waitpid(result.pid, 0)
"""


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="stasis-tests-", dir="/var/lib"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _in_container(tmp_dir: Path, log: Path, *command: str,
                  answer: bool = False) -> subprocess.Popen[bytes]:
    """`command` in a job container; its stdout a pipe to us if it `answer`s, else the log."""
    return subprocess.Popen(
        ["unshare", "--mount", "--propagation", "unchanged", "--", "sh", "-c", CONTAINER,
         "container", str(tmp_dir), *command],
        env={**os.environ, "LOG": str(log), "ANSWER": "1" if answer else ""},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if answer else subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        close_fds=True)


def _count(path: Path) -> int:
    text = path.read_text()
    return int(text) if text.strip() else -1


def test_a_job_containers_tree_restores_in_another_container(scratch: Path) -> None:
    old_tmp, new_tmp = scratch / "job-5" / "tmp", scratch / "job-9" / "tmp"
    for d in (old_tmp, new_tmp):
        d.mkdir(parents=True)
        os.chmod(d, 0o1777)
    script = scratch / "job.py"
    script.write_text(JOB)
    job = _in_container(old_tmp, scratch / "job.log", "unshare", "--pid", "--fork", "--",
                        "python3", str(script))
    restorer = None
    try:
        wait_for(lambda: (old_tmp / "count").exists() and _count(old_tmp / "count") > 3,
                 what="counting")
        # `unshare --pid --fork` (the container's process by now) and its child, the init.
        init = next(iter(proctree.children(job.pid)))
        criu = CRIU(find_criu(), scratch / "logs")
        images = scratch / "images"
        images.mkdir()
        criu.dump(init, images, DumpOptions(), "dump.log")  # killed after the dump
        job.wait(timeout=10)
        at = _count(old_tmp / "count")
        assert list(images.glob("tmpfs-dev-*.tar.gz.img"))  # /dev/shm, its own: in the images
        # Its /tmp was the node's directory: bound again from the restorer's /tmp, which the
        # node-local files (engine/nodelocal.py) refill; here by hand, then the old one goes.
        shutil.copy2(old_tmp / "count", new_tmp / "count")
        shutil.rmtree(old_tmp.parent)
        restorer = _in_container(new_tmp, scratch / "restorer.log", sys.executable, "-c",
                                 RESTORER, criu.path, str(scratch / "logs"), str(images),
                                 answer=True)
        assert restorer.stdout is not None
        line = restorer.stdout.readline()
        assert line, (scratch / "restorer.log").read_text() + \
            (scratch / "logs" / "restore.log").read_text()[-3000:]
        wait_for(lambda: _count(new_tmp / "count") > at + 3, what="counting on in the new /tmp")
        pid = int(line.split(b":")[1].strip(b" }\n"))
        assert Path(f"/proc/{pid}/root/dev/shm/x").read_text() == "shm-data"
    finally:
        for proc in (job, restorer):
            if proc is not None and proc.poll() is None:
                proctree.signal_tree(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc is not None and proc.stdout is not None:
                proc.stdout.close()
