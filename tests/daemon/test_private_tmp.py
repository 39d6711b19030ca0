"""`stasis run --private-tmp`: the job sees its own /tmp and /var/tmp, which travel in its
checkpoint (restored where nothing of them is left, as on another node), which no other job
sees, and which are gone when the job ends for good; links its user planted there never make
the restore (root) write through them.

The daemons here keep their state outside /tmp (the jobs' logs are there), as a node's does
(/var/lib/stasis)."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.engine import privatetmp, proctree
from tests.conftest import Daemon, new_daemon, wait_for, workload
from tests.daemon.test_restore_state import workload_pid

LINE = re.compile(r"^(\d+) a=(\S+) b=(\S+) held=(\d+)$", re.M)


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A scratch directory other users can traverse, not under /tmp or /var/tmp."""
    path = Path(tempfile.mkdtemp(prefix="stasis-tests-", dir="/var/lib"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon_outside(outside_tmp: Path) -> Iterator[Daemon]:
    d = new_daemon(outside_tmp, "daemon")
    d.start()
    yield d
    d.kill_all()
    d.stop()


def _lines(d: Daemon, job: str) -> list[tuple[int, str, str, int]]:
    return [(int(n), a, b, int(h)) for n, a, b, h in LINE.findall(d.log_of(job))]


def _last(d: Daemon, job: str) -> int:
    found = _lines(d, job)
    return found[-1][0] if found else -1


def _tmpfs_of(pid: int) -> tuple[str, str]:
    """The devices ("major:minor") of the job's /tmp and /var/tmp, as it sees them."""
    devs = []
    for mount in privatetmp.MOUNTS:
        st = os.stat(f"/proc/{pid}/root{mount}")
        devs.append(f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    return devs[0], devs[1]


def _mounted_anywhere(dev: str) -> list[int]:
    """The processes whose mount table still holds the filesystem `dev`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            table = (entry / "mountinfo").read_text()
        except OSError:
            continue
        if any(line.split()[2] == dev for line in table.splitlines()):
            found.append(int(entry.name))
    return found


def _start(
    d: Daemon, user: str, cwd: Path, token: str, victim: Path, *flags: str
) -> tuple[dict[str, object], int]:
    job = d.json(
        "run",
        "--cwd",
        str(cwd),
        "--user",
        user,
        *flags,
        "--",
        *workload("privatetmp.py", token, "/etc/shadow", victim),
        user=user,
    )
    wait_for(lambda: _last(d, str(job["job"])) >= 3, what="the job counting")
    return job, workload_pid(int(job["pid"]))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_private_tmp_travels_in_the_checkpoint_and_ends_with_the_job(
    daemon_outside: Daemon, outside_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    d, user = daemon_outside, test_user.pw_name
    victim = outside_tmp / "victim"  # root's, what the job's links point at
    victim.mkdir()
    shadow = _digest(Path("/etc/shadow"))
    token = secrets.token_hex(4)
    job, pid = _start(d, user, outside_tmp, token, victim, "--private-tmp")
    job_id = str(job["job"])
    assert d.job(job_id)["private_tmp"] is True
    assert "private" in d.cli("ps").stdout
    # Its files are its own: the node's /tmp and /var/tmp do not have them.
    assert not Path(f"/tmp/{token}-a").exists() and not Path(f"/var/tmp/{token}-b").exists()
    assert Path(f"/proc/{pid}/root/tmp/{token}-a").read_text() == f"a-{token}"
    devs = _tmpfs_of(pid)

    cp = d.json("dump", job_id, user=user)
    assert d.job(job_id)["state"] == "checkpointed"
    at = _last(d, job_id)
    # Stopped after its checkpoint: its /tmp and /var/tmp went with it (nothing of them is
    # left on this node, as on one that never ran it).
    for dev in devs:
        wait_for(lambda: not _mounted_anywhere(dev), what=f"tmpfs {dev} gone")

    restored = d.json("restore", cp["checkpoint"], user=user)
    new_id = str(restored["job"])
    assert d.job(new_id)["private_tmp"] is True
    wait_for(lambda: _last(d, new_id) > at + 3, what="the restored job counting on")
    numbers = [n for n, *_ in _lines(d, new_id)]
    assert numbers[numbers.index(at) + 1] == at + 1  # the count went on, not from 0
    n, a, b, held = _lines(d, new_id)[-1]
    assert (a, b) == (f"a-{token}", f"b-{token}") and held == n  # its files came back
    new_pid = workload_pid(int(restored["pid"]))
    assert not Path(f"/tmp/{token}-a").exists() and not Path(f"/var/tmp/{token}-b").exists()

    # The links the job planted came back as links, its own, and nothing went through them.
    root = Path(f"/proc/{new_pid}/root/tmp")
    for link, target in (
        (f"{token}-link-file", "/etc/shadow"),
        (f"{token}-link-dir", str(victim)),
        (f"{token}-sub/deeper/link-dir", str(victim)),
    ):
        assert (root / link).is_symlink() and os.readlink(root / link) == target, link
        assert (root / link).lstat().st_uid == test_user.pw_uid, link
    assert _digest(Path("/etc/shadow")) == shadow
    assert list(victim.iterdir()) == []

    # Its own tmpfs's again, as they were: no set-uid program or device node works there.
    new_devs = _tmpfs_of(new_pid)
    mounts = [
        line.split()
        for line in Path(f"/proc/{new_pid}/mountinfo").read_text().splitlines()
        if line.split()[2] in new_devs
    ]
    assert sorted(m[4] for m in mounts) == ["/tmp", "/var/tmp"]
    assert all({"nosuid", "nodev"} <= set(m[5].split(",")) for m in mounts), mounts

    # Checkpointed again after its restore (its log, reopened by the restorer outside the
    # namespace CRIU rebuilt, is declared external: engine/privatetmp.py), and restored again.
    at = _last(d, new_id)
    second = d.json("dump", new_id, user=user)["checkpoint"]
    # Its sandboxed trial restore (`stasis verify`) hands the log over the same way.
    verdict = d.cli("verify", "--json", second, user=user, check=False)
    assert json.loads(verdict.stdout)["ok"] is True, verdict.stdout + verdict.stderr
    again = d.json("restore", second, user=user)
    third = str(again["job"])
    wait_for(lambda: _last(d, third) > at + 3, what="the job restored twice counting on")
    numbers = [n for n, *_ in _lines(d, third)]
    assert numbers[numbers.index(at) + 1] == at + 1
    n, a, b, held = _lines(d, third)[-1]
    assert (a, b) == (f"a-{token}", f"b-{token}") and held == n
    new_devs = _tmpfs_of(workload_pid(int(again["pid"])))

    # Ended for good: its /tmp and /var/tmp are gone with it.
    d.cli("kill", third, user=user)
    for dev in new_devs:
        wait_for(lambda: not _mounted_anywhere(dev), what=f"tmpfs {dev} gone")


def test_two_jobs_do_not_see_each_others_tmp(
    daemon_outside: Daemon, outside_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    d, user = daemon_outside, test_user.pw_name
    victim = outside_tmp / "victim"
    victim.mkdir()
    one, two = secrets.token_hex(4), secrets.token_hex(4)
    job1, pid1 = _start(d, user, outside_tmp, one, victim, "--private-tmp")
    job2, pid2 = _start(d, user, outside_tmp, two, victim, "--private-tmp")
    assert Path(f"/proc/{pid1}/root/tmp/{one}-a").exists()
    assert not Path(f"/proc/{pid1}/root/tmp/{two}-a").exists()
    assert not Path(f"/proc/{pid2}/root/tmp/{one}-a").exists()
    assert not Path(f"/proc/{pid2}/root/var/tmp/{one}-b").exists()
    assert set(_tmpfs_of(pid1)).isdisjoint(_tmpfs_of(pid2))
    for job in (job1, job2):
        d.cli("kill", str(job["job"]), user=user)


def test_the_setting_is_the_default_and_the_flag_wins(
    outside_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    d = new_daemon(outside_tmp, "daemon", env={"STASIS_PRIVATE_TMP": "true"})
    d.start()
    try:
        user = test_user.pw_name
        victim = outside_tmp / "victim"
        victim.mkdir()
        token = secrets.token_hex(4)
        job, pid = _start(d, user, outside_tmp, token, victim)
        assert d.job(str(job["job"]))["private_tmp"] is True
        assert not Path(f"/tmp/{token}-a").exists()
        d.cli("kill", str(job["job"]), user=user)
        shared = secrets.token_hex(4)
        job, pid = _start(d, user, outside_tmp, shared, victim / "x", "--no-private-tmp")
        try:
            assert d.job(str(job["job"]))["private_tmp"] is False
            assert Path(f"/tmp/{shared}-a").exists()  # the node's /tmp, as without stasis
        finally:
            d.cli("kill", str(job["job"]), user=user)
            for leftover in (
                f"/tmp/{shared}-a",
                f"/var/tmp/{shared}-b",
                f"/tmp/{shared}-held",
                f"/tmp/{shared}-link-file",
                f"/tmp/{shared}-link-dir",
            ):
                Path(leftover).unlink(missing_ok=True)
            shutil.rmtree(f"/tmp/{shared}-sub", ignore_errors=True)
    finally:
        d.kill_all()
        d.stop()


def test_a_cwd_or_log_under_the_private_tmp_is_refused(
    daemon_outside: Daemon, test_user: pwd.struct_passwd
) -> None:
    d, user = daemon_outside, test_user.pw_name
    for flags in (["--cwd", "/tmp"], ["--cwd", "/"], ["--log", "/var/tmp/x/../job.log"]):
        if flags[1] == "/":
            flags += ["--log", "/tmp/job.log"]
        r = d.cli("run", "--private-tmp", *flags, "--", "true", user=user, check=False)
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "--private-tmp refused" in lines[0], r.stderr
        assert "--cwd, --log" in lines[0]
    assert d.json("ps", user=user) == []
    assert not Path("/tmp/job.log").exists() and not Path("/var/tmp/job.log").exists()
    assert proctree.alive(d.proc.pid, None)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "dump_flags,restore_flags",
    [
        (["--compress", "zstd"], []),  # decoded through CRIU's image streamer
        ([], ["--lazy"]),
    ],
)
def test_a_running_job_and_its_restore_each_have_their_own(
    daemon_outside: Daemon,
    outside_tmp: Path,
    test_user: pwd.struct_passwd,
    dump_flags: list[str],
    restore_flags: list[str],
) -> None:
    d, user = daemon_outside, test_user.pw_name
    victim = outside_tmp / "victim"
    victim.mkdir()
    token = secrets.token_hex(4)
    job, pid = _start(d, user, outside_tmp, token, victim, "--private-tmp")
    cp = d.json("dump", str(job["job"]), "--leave-running", *dump_flags, user=user)
    restored = d.json("restore", cp["checkpoint"], *restore_flags, user=user)
    new_id = str(restored["job"])
    new_pid = workload_pid(int(restored["pid"]))
    # Both count on, each in its own /tmp (the restore's log is the job's: read their files).
    held = [Path(f"/proc/{p}/root/tmp/{token}-held") for p in (pid, new_pid)]
    at = [int(h.read_text()) for h in held]
    wait_for(
        lambda: all(int(h.read_text()) > n + 3 for h, n in zip(held, at)), what="both counting"
    )
    assert set(_tmpfs_of(pid)).isdisjoint(_tmpfs_of(new_pid))
    assert Path(f"/proc/{new_pid}/root/var/tmp/{token}-b").read_text() == f"b-{token}"
    # What one writes in its /tmp, the other does not see.
    Path(f"/proc/{new_pid}/root/tmp/{token}-a").write_text("changed")
    wait_for(lambda: "a=changed" in d.log_of(new_id), what="the restore reading its own file")
    assert Path(f"/proc/{pid}/root/tmp/{token}-a").read_text() == f"a-{token}"
    for j in (str(job["job"]), new_id):
        d.cli("kill", j, user=user)
