"""A job's private /tmp that is a directory of the node's bound in its mount namespace (Slurm's
job_container/tmpfs binds BasePath/<jobid>/.<jobid> on /tmp): the whole directory travels in
the checkpoint, not only the files the job holds open (engine/nodelocal.py carries those),
and a requeued job finds it again in its new /tmp, on whatever node.

CRIU dumps such a mount as external (engine/privatetmp.py): its contents are ours to carry.
They go into one tar archive per directory in the images (`<key>.tar`: hashed, signed and
encrypted with them by the store), within what `node_local_limit` leaves after the node-local
files. Both ends run tar with the job user's own rights, never root's: the archive holds only
what the user could read, the restore writes only what the user could write, and no link the
user planted can take either further. tar reads the directory through the job's own view
(/proc/PID/root), stays on its filesystem (--one-file-system) and records links as links.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from stasis.engine import nodelocal, privatetmp
from stasis.errors import RestoreError
from stasis.fdio import write_all

_CHUNK = 1 << 20
_TAR = "tar"


def archive_name(mount: str) -> str:
    return privatetmp.key(mount) + ".tar"


class AtDumpWithTmp(nodelocal.AtDump):
    """nodelocal.AtDump (the node-local files the tree has open), then each of the tree's /tmp,
    /var/tmp bound from a node's directory, whole, at the same point of the dump (the tree
    frozen or stopped as its images record it)."""

    def __init__(
        self, pid: int, uid: int, images: Path, limit: int, gid: int = 0, groups: Sequence[int] = ()
    ) -> None:
        super().__init__(pid, uid, images, limit)
        self.gid = gid
        self.groups = list(groups)
        self.saved: list[str] = []  # the mounts whose directories went into the images

    def collect(self) -> bool:
        if not super().collect():
            return False
        room = self.limit - self.packed.size_bytes
        for mount in privatetmp.bound_from_node(self.pid):
            why = self._save(mount, room)
            if why is not None:
                self.refused = why
                (self.images / archive_name(mount)).unlink(missing_ok=True)
                return False
            room -= (self.images / archive_name(mount)).stat().st_size
            self.saved.append(mount)
        return True

    def _save(self, mount: str, room: int) -> str | None:
        """Archive the tree's `mount` into the images; None, or why it cannot travel."""
        path = self.images / archive_name(mount)
        where = f"/proc/{self.pid}/root{mount}"
        try:
            # Its entries, not the directory itself: the new one's owner and mode are Slurm's.
            names = os.listdir(where)
        except OSError as e:
            return f"its private {mount} cannot be read: {e.strerror}"
        out = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        tar = subprocess.Popen(
            # posix: mtimes to the nanosecond, as the restore's file facts compare them. The
            # names come NUL-separated on stdin, taken as names (never as options).
            [
                _TAR,
                "--create",
                "--format=posix",
                "--one-file-system",
                "--numeric-owner",
                "--sparse",
                "--file=-",
                "-C",
                where,
                "--null",
                "--verbatim-files-from",
                "--files-from=-",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            user=self.uid,
            group=self.gid,
            extra_groups=self.groups,
            close_fds=True,
        )
        assert tar.stdin is not None and tar.stdout is not None and tar.stderr is not None
        try:
            tar.stdin.write(b"".join(os.fsencode(n) + b"\0" for n in names))
            tar.stdin.close()
        except BrokenPipeError:
            pass  # tar failed at once: its stderr says why
        size = 0
        try:
            while chunk := tar.stdout.read(_CHUNK):
                size += len(chunk)
                if size > room:
                    tar.kill()
                    return (
                        f"its private {mount} holds more than node_local_limit leaves for "
                        f"it ({room} bytes): remove what it need not keep there, or raise "
                        "node_local_limit"
                    )
                write_all(out, chunk)
        finally:
            os.close(out)
            tar.stdout.close()
            errors = tar.stderr.read().decode(errors="replace").strip()
            tar.stderr.close()
            code = tar.wait()
        if code not in (0, 1):  # 1: a file changed as it was read (a live job's may)
            first = errors.splitlines()[0] if errors else f"tar exited with {code}"
            return f"its private {mount} cannot be saved with its owner's rights: {first}"
        return None


class Unpacked:
    """What `unpack` put into the caller's /tmp, /var/tmp: `undo` takes it out again (with the
    job user's rights) when the restore then fails, so that the job, run from the start
    instead, finds the empty /tmp it would have had."""

    def __init__(self, uid: int, gid: int, groups: Sequence[int]) -> None:
        self.uid, self.gid, self.groups = uid, gid, list(groups)
        self.made: list[str] = []

    def undo(self) -> None:
        if self.made:
            self.run(["rm", "-rf", "--", *self.made], subprocess.DEVNULL, subprocess.DEVNULL)
        self.made = []

    def run(
        self, command: list[str], stdin: int, stderr: int
    ) -> subprocess.CompletedProcess[bytes]:
        """`command` with the job user's rights, never root's; its stdout discarded."""
        return subprocess.run(
            command,
            stdin=stdin,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            user=self.uid,
            group=self.gid,
            extra_groups=self.groups,
            close_fds=True,
            timeout=600,
            check=False,
        )


def unpack(images: Path, uid: int, gid: int, groups: Sequence[int] = ()) -> Unpacked:
    """Before CRIU restores: each directory the checkpoint carries, unpacked into the same path
    of the caller's mount namespace (a requeued job's new private /tmp), with the job user's
    rights. RestoreError, in one line, if one cannot be (what was put back is taken out)."""
    done = Unpacked(uid, gid, groups)
    try:
        for mount in privatetmp.MOUNTS:
            _unpack_one(images, mount, done)
    except BaseException:
        done.undo()
        raise
    return done


def _unpack_one(images: Path, mount: str, done: Unpacked) -> None:
    archive = images / archive_name(mount)
    try:
        src = os.open(archive, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as e:
        raise RestoreError(f"cannot read the saved {mount} of the job: {e.strerror}") from e
    try:
        before = set(os.listdir(mount))
        ran = done.run(
            [
                _TAR,
                "--extract",
                "--preserve-permissions",
                "--no-overwrite-dir",
                "--file=-",
                "-C",
                mount,
            ],
            src,
            subprocess.PIPE,
        )
        done.made += [os.path.join(mount, n) for n in sorted(set(os.listdir(mount)) - before)]
    except OSError as e:
        raise RestoreError(f"cannot put the job's saved {mount} back: {e.strerror}") from e
    finally:
        os.close(src)
    if ran.returncode != 0:
        lines = ran.stderr.decode(errors="replace").strip().splitlines()
        first = lines[0] if lines else f"tar exited with {ran.returncode}"
        raise RestoreError(
            f"cannot put the job's saved {mount} back with its owner's " f"rights: {first}"
        )
