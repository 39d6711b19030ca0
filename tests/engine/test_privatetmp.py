"""A tree in a mount namespace of its own, as Slurm's job_container/tmpfs makes one (its /tmp a
bind of a per-job directory of the node's, /dev/shm a tmpfs of its own), dumped and restored
with real CRIU inside another such namespace, as a requeued job's task restores it: its /tmp is
then the new one's, whatever directory that is bound from, refilled with what the old one held
(engine/boundtmp.py), and its /dev/shm comes back with its contents (engine/privatetmp.py).
What is saved and put back is read and written with the job user's rights only.

Everything lives outside /tmp: the namespaces hide the node's /tmp."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from stasis.engine import CRIU, DumpOptions, boundtmp, find_criu, privatetmp, proctree
from tests.conftest import wait_for
from tests.engine.conftest import end_trees

JOB = """
import os, time
os.setsid()
with open("/dev/shm/x", "w") as f:
    f.write("shm-data")
with open("/tmp/closed", "w") as f:
    f.write("closed-data")
os.makedirs("/tmp/d/e", exist_ok=True)
with open("/tmp/d/e/f", "w") as f:
    f.write("deep")
os.symlink("/etc/shadow", "/tmp/link")
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
mount -t tmpfs -o size=1m,mode=1777 stasis-test-shm /dev/shm
shift
exec </dev/null 2>>"$LOG"
[ -n "$ANSWER" ] || exec >>"$LOG"
exec "$@"
"""

# A requeued job's task restoring it: its new /tmp refilled, then CRIU.
RESTORER = """
import json, os, sys
from pathlib import Path
from stasis.engine import CRIU, RestoreOptions, boundtmp
uid, gid = int(sys.argv[4]), int(sys.argv[5])
boundtmp.unpack(Path(sys.argv[3]), uid, gid)
criu = CRIU(sys.argv[1], Path(sys.argv[2]))
result = criu.restore(Path(sys.argv[3]), RestoreOptions(own_mounts=True), "restore.log")
print(json.dumps({"pid": result.pid}), flush=True)
os.waitpid(result.pid, 0)
"""


def _in_container(
    tmp_dir: Path, log: Path, *command: str, answer: bool = False
) -> subprocess.Popen[bytes]:
    """`command` in a job container; its stdout a pipe to us if it `answer`s, else the log."""
    return subprocess.Popen(
        [
            "unshare",
            "--mount",
            "--propagation",
            "unchanged",
            "--",
            "sh",
            "-c",
            CONTAINER,
            "container",
            str(tmp_dir),
            *command,
        ],
        env={**os.environ, "LOG": str(log), "ANSWER": "1" if answer else ""},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if answer else subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )


def _count(path: Path) -> int:
    text = path.read_text()
    return int(text) if text.strip() else -1


def _job_dirs(scratch: Path, uid: int) -> tuple[Path, Path]:
    """The old job's /tmp and the requeued one's, each its user's (0700), as Slurm makes them."""
    dirs = scratch / "job-5" / "tmp", scratch / "job-9" / "tmp"
    for d in dirs:
        d.mkdir(parents=True)
        os.chmod(d.parent, 0o755)
        os.chown(d, uid, 0)
        os.chmod(d, 0o700)
    return dirs


def _start(
    scratch: Path, old_tmp: Path, user: pwd.struct_passwd | None
) -> tuple[subprocess.Popen[bytes], int]:
    """The job in its container (as `user`, else root), counting; its namespace init."""
    script = scratch / "job.py"
    script.write_text(JOB)
    as_user = (
        []
        if user is None
        else ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
    )
    job = _in_container(
        old_tmp,
        scratch / "job.log",
        "unshare",
        "--pid",
        "--fork",
        "--",
        *as_user,
        "/usr/bin/python3",
        str(script),
    )
    wait_for(
        lambda: (old_tmp / "count").exists() and _count(old_tmp / "count") > 3, what="counting"
    )
    # `unshare --pid --fork` (the container's process by now) and its child, the init.
    return job, next(iter(proctree.children(job.pid)))


def test_a_job_containers_tree_restores_in_another_container(
    scratch: Path, test_user: pwd.struct_passwd
) -> None:
    uid, gid = test_user.pw_uid, test_user.pw_gid
    old_tmp, new_tmp = _job_dirs(scratch, uid)
    victim = scratch / "victim"  # root's: the requeued /tmp holds a link to it, planted
    victim.mkdir()
    (new_tmp / "d").symlink_to(victim)
    os.lchown(new_tmp / "d", uid, gid)
    job, init = _start(scratch, old_tmp, test_user)
    restorer = None
    try:
        criu = CRIU(find_criu(), scratch / "logs")
        images = scratch / "images"
        images.mkdir(mode=0o700)
        criu.dump(init, images, DumpOptions(leave_stopped=True), "dump.log")
        # As the daemon does once CRIU left the tree stopped: its /tmp, whole, as its user.
        saved = boundtmp.AtDumpWithTmp(init, uid, images, 1 << 20, gid)
        assert saved.collect(), saved.refused
        assert saved.saved == ["/tmp"]
        end_trees(job)
        at = _count(old_tmp / "count")
        assert list(images.glob("tmpfs-dev-*.tar.gz.img"))  # /dev/shm, its own: in the images
        # Requeued elsewhere: the old directory is gone, the new one is another.
        shutil.rmtree(old_tmp.parent)
        restorer = _in_container(
            new_tmp,
            scratch / "restorer.log",
            sys.executable,
            "-c",
            RESTORER,
            criu.path,
            str(scratch / "logs"),
            str(images),
            str(uid),
            str(gid),
            answer=True,
        )
        assert restorer.stdout is not None
        line = restorer.stdout.readline()
        assert line, (scratch / "restorer.log").read_text()
        wait_for(lambda: _count(new_tmp / "count") > at + 3, what="counting on in the new /tmp")
        pid = int(line.split(b":")[1].strip(b" }\n"))
        assert Path(f"/proc/{pid}/root/dev/shm/x").read_text() == "shm-data"
        # The files it had closed came back too, its link as a link, all its user's.
        assert (new_tmp / "closed").read_text() == "closed-data"
        assert (new_tmp / "d" / "e" / "f").read_text() == "deep"
        assert os.readlink(new_tmp / "link") == "/etc/shadow"
        for path in (new_tmp / "closed", new_tmp / "d", new_tmp / "link"):
            assert path.lstat().st_uid == uid, path
        # The link planted where a directory came back was not followed.
        assert not (new_tmp / "d").is_symlink() and list(victim.iterdir()) == []
    finally:
        end_trees(job, restorer)


def test_what_its_user_cannot_read_or_over_the_limit_does_not_travel(
    scratch: Path, test_user: pwd.struct_passwd
) -> None:
    uid, gid = test_user.pw_uid, test_user.pw_gid
    old_tmp, _ = _job_dirs(scratch, uid)
    job, init = _start(scratch, old_tmp, test_user)
    try:
        images = scratch / "images"
        images.mkdir(mode=0o700)
        # A file of root's in the job's /tmp (a prolog's, or a hard link): root could read it,
        # its user cannot, and the checkpoint is the user's.
        secret = old_tmp / "root-only"
        secret.write_text("root's secret")
        os.chmod(secret, 0o600)
        saved = boundtmp.AtDumpWithTmp(init, uid, images, 1 << 20, gid)
        assert not saved.collect()
        assert (
            saved.refused
            and "with its owner's rights" in saved.refused
            and "root-only" in saved.refused
        ), saved.refused
        assert not (images / boundtmp.archive_name("/tmp")).exists()
        secret.unlink()
        (old_tmp / "big").write_bytes(os.urandom(64 << 10))
        again = scratch / "images-again"
        again.mkdir(mode=0o700)
        small = boundtmp.AtDumpWithTmp(init, uid, again, 32 << 10, gid)
        assert not small.collect()
        assert small.refused and "node_local_limit" in small.refused, small.refused
        assert not (again / boundtmp.archive_name("/tmp")).exists()
    finally:
        end_trees(job)


def test_a_manifests_external_files_are_read_back_only_in_criu_s_form() -> None:
    """What a restore hands to CRIU as inherit_fd keys comes from the signed manifest, and
    still only keys of CRIU's external-file form and regular files' modes pass."""
    good = {"key": "file[1f:2a]", "mode": 0o100640}
    extra = {
        privatetmp.EXTERNAL_FILES_KEY: {
            "/var/log/job.log": good,
            "/a": {"key": "net[123]:x", "mode": 0o100640},  # another kind of external
            "/b": {"key": "file[1f:2a]\n--evil", "mode": 0o100640},
            "/c": {"key": "file[1f:2a]", "mode": 0o20666},  # a character device
            "/d": "file[1f:2a]",
            "/e": {"key": "file[1f:2a]"},
        }
    }
    assert privatetmp.external_files(extra) == {"/var/log/job.log": good}
    assert privatetmp.external_files({privatetmp.EXTERNAL_FILES_KEY: ["x"]}) == {}
    assert privatetmp.external_files({}) == {}


def test_an_external_output_is_handed_over_by_key_with_its_mode(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.fchmod(fd, 0o644)
        external = {"/old/job.log": privatetmp.ExternalFile(key="file[1f:2a]", mode=0o100640)}
        assert privatetmp.hand_over("/old/job.log", fd, external, 0) == "file[1f:2a]"
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o640
        # Not declared external: CRIU's name for it, its path without the leading '/'.
        assert privatetmp.hand_over("/other/job.log", fd, external, 0) == "other/job.log"
        # Someone else's file keeps its mode (CRIU then refuses it, naming the mode).
        os.fchmod(fd, 0o644)
        assert privatetmp.hand_over("/old/job.log", fd, external, 4242) == "file[1f:2a]"
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o644
    finally:
        os.close(fd)
