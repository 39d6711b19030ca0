"""`stasis verify` (issue 29): a checkpoint restored in a sandbox with real CRIU, its tree checked
and removed. Each test looks at state: the job's files by checksum, the processes, mounts and
files under /tmp, CRIU's firewall rules, what the store's catalog holds, which job comes back."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stasis import wire
from stasis.store.store import VERDICT_NOTE
from tests.conftest import TEST_USER, Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error
from tests.daemon.test_restore_state import last_number
from tests.test_wire import conforms

PRIVATE = ("/tmp", "/var/tmp", "/dev/shm", "/run")


@pytest.fixture
def job_dir() -> Iterator[Path]:
    """The job's own files, outside the directories a sandbox makes private (as a home or
    project directory is): what verify must leave exactly as it was."""
    path = Path(tempfile.mkdtemp(prefix="stasis-verify-", dir="/var/lib"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _files_job(d: Daemon, job_dir: Path, label: str) -> Any:
    paths = [job_dir / n for n in ("read.dat", "append.dat", "rw.dat")]
    for i, p in enumerate(paths):
        p.write_bytes(os.urandom(4096 + i))
    job = d.run(*workload("holdfiles.py", *paths), label=label)
    wait_for(lambda: last_number(d, job["job"]) >= 3, what="the job counting")
    return job


def _checksums(job_dir: Path) -> dict[str, tuple[str, int]]:
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(job_dir.iterdir())
    }


def _ours(job_dir: Path) -> list[int]:
    """The processes whose command line names the job's directory (the job's, or a restored
    copy of it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(job_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return sorted(found)


def _mounts_on_private_dirs() -> list[str]:
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    # Exactly on them: other tests of the machine mount below /run (network namespaces).
    return sorted(line.split()[4] for line in lines if line.split()[4] in PRIVATE)


def _criu_rules() -> list[str]:
    """CRIU's network-lock rules (its chains are named CRIU), in iptables and nft."""
    rules = []
    for cmd in (["iptables-save"], ["ip6tables-save"], ["nft", "list", "ruleset"]):
        if shutil.which(cmd[0]):
            out = subprocess.run(cmd, capture_output=True, text=True).stdout
            rules += [line for line in out.splitlines() if "CRIU" in line.upper()]
    return rules


def _leftovers() -> list[str]:
    return sorted(str(p) for d in PRIVATE for p in Path(d).glob(".stasis-verify-*"))


def _verify(d: Daemon, checkpoint: str, user: str | None = None) -> Any:
    result = d.cli("verify", "--json", checkpoint, user=user, check=False)
    verdict = json.loads(result.stdout)
    assert conforms(verdict, wire.VerifyVerdict), verdict
    assert (result.returncode == 0) == verdict["ok"], result.stderr
    return verdict


def _listed(d: Daemon, checkpoint: str) -> Any:
    return next(c for c in d.json("checkpoints") if c["id"] == checkpoint)


def test_a_good_checkpoint_verifies_and_leaves_nothing(daemon: Daemon, job_dir: Path) -> None:
    job = _files_job(daemon, job_dir, "verify-good")
    cp = daemon.json("dump", "--leave-running", job["job"])["checkpoint"]
    before = (
        _checksums(job_dir),
        _ours(job_dir),
        _mounts_on_private_dirs(),
        _criu_rules(),
        _leftovers(),
    )
    counted = last_number(daemon, job["job"])

    verdict = _verify(daemon, cp)

    assert verdict["ok"] and verdict["reason"] == "" and verdict["checkpoint"] == cp, verdict[
        "reason"
    ]
    assert verdict["processes"] == 2  # stasis-init and the workload
    assert (
        _checksums(job_dir),
        _ours(job_dir),
        _mounts_on_private_dirs(),
        _criu_rules(),
        _leftovers(),
    ) == before
    # The job itself ran on, untouched; the verdict is in the catalog, shown by the list.
    wait_for(lambda: last_number(daemon, job["job"]) > counted + 2, what="the job counting on")
    assert daemon.job(job["job"])["state"] == "running"
    assert _listed(daemon, cp)["verdict"] == verdict
    table = daemon.cli("checkpoints", "--label", "verify-good").stdout
    assert re.search(rf"^{cp} .* ok\s*$", table, re.M), table
    daemon.cli("kill", job["job"])


def test_a_checkpoint_whose_file_is_gone_fails_naming_it(daemon: Daemon, job_dir: Path) -> None:
    job = _files_job(daemon, job_dir, "verify-gone")
    cp = daemon.json("dump", job["job"])["checkpoint"]
    (job_dir / "rw.dat").unlink()
    before = (_checksums(job_dir), _ours(job_dir), _mounts_on_private_dirs(), _leftovers())

    result = daemon.cli("verify", cp, check=False)
    line = one_line_error(result, 1, f"checkpoint {cp} failed verification", "rw.dat")

    assert (_checksums(job_dir), _ours(job_dir), _mounts_on_private_dirs(), _leftovers()) == before
    assert not (job_dir / "rw.dat").exists()  # not recreated by the restore either
    verdict = _listed(daemon, cp)["verdict"]
    assert not verdict["ok"] and "rw.dat" in verdict["reason"], line
    assert re.search(rf"^{cp} .* failed\s*$", daemon.cli("checkpoints").stdout, re.M)


def test_damaged_images_fail_with_the_reason(daemon: Daemon) -> None:
    job = daemon.run(*workload("counter.py", 0.1, 2), label="verify-damaged")
    wait_for(lambda: last_number(daemon, job["job"]) >= 2, what="the counter")
    cp = daemon.json("dump", job["job"])["checkpoint"]
    stored = max(
        (p for p in (Path(daemon.store) / cp).iterdir() if p.name.startswith("pages")),
        key=lambda p: p.stat().st_size,
    )
    with open(stored, "r+b") as f:
        f.seek(stored.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    before = _ours(Path(daemon.store)), _mounts_on_private_dirs()

    verdict = _verify(daemon, cp)

    assert not verdict["ok"] and cp in verdict["reason"] and "pages" in verdict["reason"], verdict
    assert (_ours(Path(daemon.store)), _mounts_on_private_dirs()) == before
    assert _listed(daemon, cp)["verdict"]["ok"] is False


def test_only_who_may_restore_it_verifies_it(daemon: Daemon) -> None:
    job = daemon.run(*workload("counter.py"), label="verify-root-only")
    cp = daemon.json("dump", job["job"])["checkpoint"]

    result = daemon.cli("verify", cp, user=TEST_USER, check=False)

    one_line_error(result, 2, cp)
    assert not (Path(daemon.store) / cp / VERDICT_NOTE).exists()
    assert "verdict" not in _listed(daemon, cp)


def test_verified_restore_takes_the_newest_verified_and_no_forged_verdict(daemon: Daemon) -> None:
    job = daemon.run(*workload("counter.py"), label="verify-pick")
    wait_for(lambda: last_number(daemon, job["job"]) >= 3, what="the counter")
    older = daemon.json("dump", "--leave-running", job["job"])["checkpoint"]
    assert _verify(daemon, older)["ok"]
    newer = daemon.json("dump", job["job"])["checkpoint"]
    store = Path(daemon.store)

    # A writer of the store without the site key: a verdict of its own making, and the genuine
    # verdict of the older checkpoint copied onto the newer one.
    genuine = json.loads((store / older / VERDICT_NOTE).read_bytes())
    forged = {**genuine, "verdict": {**genuine["verdict"], "checkpoint": newer}}
    (store / newer / VERDICT_NOTE).write_text(json.dumps(forged))
    assert "verdict" not in _listed(daemon, newer)
    jobs = len(daemon.json("ps"))

    restored = daemon.json("restore", "--label", "verify-pick", "--verified")

    assert restored["checkpoint"] == older
    assert len(daemon.json("ps")) == jobs + 1
    daemon.cli("kill", restored["job"])

    # Without any genuine ok verdict, nothing is restored: one line says why.
    (store / older / VERDICT_NOTE).write_text(
        json.dumps({**genuine, "signature": {"key_id": "0" * 32, "hmac_sha256": "0" * 64}})
    )
    result = daemon.cli("restore", "--label", "verify-pick", "--verified", check=False)
    one_line_error(result, 2, "no verified checkpoint with label verify-pick", "stasis verify")
    assert len(daemon.json("ps")) == jobs + 1
    assert "verdict" not in _listed(daemon, older)


def test_new_checkpoints_are_verified_in_the_background(make_daemon: MakeDaemon) -> None:
    d = make_daemon(env={"STASIS_VERIFY_NEW_CHECKPOINTS": "true"})
    job = d.run(*workload("counter.py"), label="verify-background")
    cp = d.json("dump", job["job"])["checkpoint"]

    verdict: Any = wait_for(lambda: _listed(d, cp).get("verdict"), 60, "the background verdict")

    assert verdict["ok"] and verdict["checkpoint"] == cp
    assert d.json("restore", "--label", "verify-background", "--verified")["checkpoint"] == cp


def _echo(path: Path) -> bytes:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(b"hello\n")
        return s.recv(100)


def test_a_running_jobs_unix_socket_outside_tmp_keeps_serving(
    daemon: Daemon, job_dir: Path
) -> None:
    sock = job_dir / "server.sock"
    job = daemon.run(*workload("unixserver.py", sock), label="verify-unix")
    wait_for(lambda: "listening" in daemon.log_of(job["job"]), what="the server")
    cp = daemon.json("dump", "--leave-running", job["job"])["checkpoint"]
    inode = sock.stat().st_ino

    verdict = _verify(daemon, cp)

    # CRIU rebinds a socket's address by removing what is there: here, only in the sandbox.
    assert verdict["ok"], verdict["reason"]
    assert sock.stat().st_ino == inode
    assert _echo(sock) == b"hello\n"
    assert sorted(p.name for p in job_dir.iterdir()) == ["server.sock"]
    daemon.cli("kill", job["job"])


TICKS = """import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
n = 0
while True:
    os.write(fd, b"%d\\n" % n)
    n += 1
    time.sleep(0.01)
"""


def test_not_one_instruction_of_the_job_runs(daemon: Daemon, job_dir: Path) -> None:
    ticks = job_dir / "ticks"  # the job writes a line to it every 10 ms, as long as it runs
    job = daemon.run("python3", "-c", TICKS, str(ticks), label="verify-ticks")
    wait_for(lambda: ticks.exists() and ticks.stat().st_size > 30, what="the job ticking")
    cp = daemon.json("dump", job["job"])["checkpoint"]  # the job stops with it
    before = _checksums(job_dir)

    assert _verify(daemon, cp)["ok"]

    assert _checksums(job_dir) == before and _ours(job_dir) == []


def test_a_sandbox_killed_with_the_tree_restored_leaves_nothing(
    make_daemon: MakeDaemon, job_dir: Path
) -> None:
    # SIGKILLed once CRIU restored the tree (stopped), before it is compared and killed.
    d = make_daemon(env={"STASIS_TEST_FAULT_POINTS": "verify.sandbox.restored"})
    job = _files_job(d, job_dir, "verify-cut")
    cp = d.json("dump", job["job"])["checkpoint"]
    before = (_checksums(job_dir), _ours(job_dir), _mounts_on_private_dirs(), _leftovers())

    verdict = _verify(d, cp)

    assert not verdict["ok"] and "without a verdict" in verdict["reason"], verdict
    # The kernel ended the tree with the sandbox's PID namespace: nothing is left stopped.
    assert (_checksums(job_dir), _ours(job_dir), _mounts_on_private_dirs(), _leftovers()) == before
    assert d.json("restore", cp)["checkpoint"] == cp  # the daemon goes on


KEEP_TMP = """import os, sys, time
f = open(sys.argv[1], "w+")
f.write("kept on the node " * 100)
f.flush()
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_node_local_file_travels_into_the_sandbox_only(daemon: Daemon) -> None:
    # The job keeps a file open in the node's /tmp; its checkpoint carries it (nodelocal).
    kept = Path(f"/tmp/stasis-verify-kept-{os.urandom(4).hex()}.txt")
    job = daemon.run("python3", "-c", KEEP_TMP, str(kept), label="verify-nodelocal")
    wait_for(lambda: "ready" in daemon.log_of(job["job"]), what="the job's file")
    cp = daemon.json("dump", job["job"])["checkpoint"]
    kept.unlink()  # as on a node that never ran it (or after the job removed it on its way out)

    verdict = _verify(daemon, cp)

    # Recreated from the checkpoint in the sandbox's own /tmp, never on the node.
    assert verdict["ok"], verdict["reason"]
    assert not kept.exists() and _ours(kept) == []


def test_a_job_with_a_private_tmp_verifies(daemon: Daemon, job_dir: Path) -> None:
    job = daemon.json(
        "run",
        "--private-tmp",
        "--label",
        "verify-private-tmp",
        "--log",
        str(job_dir / "out.log"),
        "--",
        "python3",
        "-c",
        KEEP_TMP,
        "/tmp/private.txt",
    )
    wait_for(lambda: "ready" in daemon.log_of(job["job"]), what="the job's file")
    cp = daemon.json("dump", "--leave-running", job["job"])["checkpoint"]
    before = _mounts_on_private_dirs()

    verdict = _verify(daemon, cp)

    assert verdict["ok"], verdict["reason"]
    assert not Path("/tmp/private.txt").exists() and _mounts_on_private_dirs() == before
    daemon.cli("kill", job["job"])


def test_node_local_files_outside_tmp_are_recreated_in_the_sandbox_only(
    daemon: Daemon, job_dir: Path
) -> None:
    # $TMPDIR outside /tmp (a site's scratch directory): its files travel too (nodelocal), and
    # a restore replaces one that differs; a verify must do that in the sandbox only.
    tmpdir = job_dir / "scratch"
    tmpdir.mkdir()
    kept = tmpdir / "kept.txt"
    job = d_run_env(daemon, {"TMPDIR": str(tmpdir)}, "python3", "-c", KEEP_TMP, str(kept))
    wait_for(lambda: "ready" in daemon.log_of(job["job"]), what="the job's file")
    cp = daemon.json("dump", job["job"])["checkpoint"]
    assert str(kept) in json.dumps(_listed(daemon, cp)["extra"])  # it travels
    kept.write_text("changed on the node since")
    (tmpdir / "other.txt").write_text("the node's own")
    before = _checksums(tmpdir)

    verdict = _verify(daemon, cp)

    assert verdict["ok"], verdict["reason"]
    assert _checksums(tmpdir) == before and kept.read_text() == "changed on the node since"


def d_run_env(d: Daemon, env: dict[str, str], *command: str) -> Any:
    opts = [arg for k, v in env.items() for arg in ("--env", f"{k}={v}")]
    return d.json("run", *opts, "--label", "verify-env", "--", *command)


GHOST = """import os, sys, time
f = open(sys.argv[1], "w+")
f.write("deleted but held " * 100)
f.flush()
os.unlink(sys.argv[1])
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


class _Creations:
    """What is created in a directory while it is watched (inotify, IN_CREATE | IN_MOVED_TO):
    also what exists for a moment only."""

    def __init__(self, path: Path) -> None:
        import ctypes

        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0
        assert self._libc.inotify_add_watch(self.fd, str(path).encode(), 0x100 | 0x80) >= 0

    def names(self) -> list[str]:
        import struct

        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        finally:
            os.close(self.fd)
        names, at = [], 0
        while at + 16 <= len(data):
            size = struct.unpack_from("iIII", data, at)[3]
            names.append(data[at + 16 : at + 16 + size].rstrip(b"\0").decode())
            at += 16 + size
        return names


def test_a_deleted_file_the_job_holds_is_never_recreated_on_the_node(
    daemon: Daemon, job_dir: Path
) -> None:
    held = job_dir / "deleted.dat"
    job = daemon.run("python3", "-c", GHOST, str(held), label="verify-ghost")
    wait_for(lambda: "ready" in daemon.log_of(job["job"]), what="the job's deleted file")
    cp = daemon.json("dump", "--leave-running", job["job"])["checkpoint"]
    watched = _Creations(job_dir)

    verdict = _verify(daemon, cp)

    # CRIU recreates a ghost beside its old path for the restore: here, in the sandbox only.
    assert verdict["ok"], verdict["reason"]
    assert watched.names() == [] and list(job_dir.iterdir()) == []
    daemon.cli("kill", job["job"])


LOCKS = """import fcntl, sys, time
a = open(sys.argv[1], "a+")
fcntl.flock(a, fcntl.LOCK_EX)
b = open(sys.argv[2], "a+")
fcntl.lockf(b, fcntl.LOCK_EX)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_running_job_keeps_its_file_locks(make_daemon: MakeDaemon, job_dir: Path) -> None:
    # A short limit: a sandbox that waited on the job's own locks would fail here, not hang.
    d = make_daemon(env={"STASIS_VERIFY_TIMEOUT_S": "30"})
    flocked, posix = job_dir / "flock.lock", job_dir / "posix.lock"
    job = d.run("python3", "-c", LOCKS, str(flocked), str(posix), label="verify-locks")
    wait_for(lambda: "ready" in d.log_of(job["job"]), what="the job's locks")
    cp = d.json("dump", "--leave-running", job["job"])["checkpoint"]

    verdict = _verify(d, cp)

    assert verdict["ok"], verdict["reason"]
    # The job holds them still: another process cannot take either.
    probe = (
        "import fcntl, sys\n"
        "try:\n"
        "    fcntl.flock(open(sys.argv[1]), fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
        "except OSError: print('held')\n"
        "try:\n"
        "    fcntl.lockf(open(sys.argv[2], 'a'), fcntl.LOCK_EX | fcntl.LOCK_NB); "
        "print('free')\n"
        "except OSError: print('held')\n"
    )
    out = subprocess.run(
        ["python3", "-c", probe, str(flocked), str(posix)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["held", "held"]
    d.cli("kill", job["job"])
