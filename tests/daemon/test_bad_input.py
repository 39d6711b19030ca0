"""Bad input: one readable error line, the right exit code, and nothing lost or half-listed."""

from __future__ import annotations

import grp
import pwd
import subprocess
from pathlib import Path

import pytest

from stasis.engine import proctree
from tests.conftest import STASIS, Daemon, MakeDaemon, new_daemon, wait_for, workload
from tests.daemon.test_restore_state import last_number

SOCKET_GROUP = "stasis-sock-test"


def one_line_error(result: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    assert result.returncode == code, result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("stasis: error: ")
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_unknown_job_and_checkpoint(daemon: Daemon) -> None:
    one_line_error(daemon.cli("dump", "0123456789ab", check=False), 2, "no job 0123456789ab")
    one_line_error(daemon.cli("kill", "0123456789ab", check=False), 2, "no job")
    one_line_error(daemon.cli("dump", "../../etc", check=False), 2, "not a job id")
    one_line_error(
        daemon.cli("restore", "20990101T000000Z-abcdef", check=False), 2, "no checkpoint"
    )
    one_line_error(daemon.cli("restore", "../x", check=False), 2)
    one_line_error(daemon.cli("restore", "--label", "never-used", check=False), 2, "never-used")
    one_line_error(daemon.cli("checkpoints", "rm", "20990101T000000Z-abcdef", check=False), 2)
    one_line_error(daemon.cli("run", "--label", "bad/label", "--", "true", check=False), 2, "label")


def test_command_that_does_not_exist(daemon: Daemon) -> None:
    one_line_error(daemon.cli("run", "--", "/no/such/program", check=False), 2, "/no/such/program")


def _images(daemon: Daemon, checkpoint: str) -> Path:
    return Path(daemon.store) / checkpoint


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_checkpoint_is_refused(daemon: Daemon, damage: str) -> None:
    job = daemon.run(*workload("memhold.py", 4), label=f"corrupt-{damage}")
    wait_for(lambda: "ready" in daemon.log_of(job["job"]), what="ready")
    cp = daemon.json("dump", job["job"])
    pages = max(
        _images(daemon, cp["checkpoint"]).glob("pages-*.img"), key=lambda p: p.stat().st_size
    )
    data = bytearray(pages.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        pages.write_bytes(data)
    else:
        pages.write_bytes(data[: len(data) // 2])
    jobs_before = daemon.json("ps")
    err = one_line_error(
        daemon.cli("restore", cp["checkpoint"], check=False), 1, "corrupt", pages.name
    )
    assert "stasis checkpoints rm" in err
    assert daemon.json("ps") == jobs_before  # nothing restored
    # Nothing else harmed: another job still checkpoints and restores.
    other = daemon.run(*workload("counter.py"))
    wait_for(lambda: last_number(daemon, other["job"]) >= 2, what="other job")
    cp2 = daemon.json("dump", other["job"])
    restored = daemon.json("restore", cp2["checkpoint"])
    daemon.cli("kill", restored["job"])


def test_full_store_fails_cleanly_and_job_keeps_running(
    make_daemon: MakeDaemon, world_tmp: Path
) -> None:
    mnt = world_tmp / "small-store"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=755", "tmpfs", str(mnt)], check=True
    )
    try:
        d: Daemon = make_daemon(store=str(mnt))
        job = d.run(*workload("memhold.py", 32))
        wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
        result = d.cli("dump", job["job"], check=False)
        one_line_error(result, 1, "still running")
        assert "space" in result.stderr.lower()
        assert d.job(job["job"])["state"] == "running"
        assert proctree.alive(job["pid"], None)
        assert d.json("checkpoints") == []
        # Nothing of the dump; the label index's marker (index.py) and the store's own
        # (.stasis-store, written as the first publish begins) are the store's.
        leftovers = [
            p
            for p in mnt.rglob("*")
            if p.is_file()
            and p.relative_to(mnt).parts[-2:] != (".index", "format")
            and p.name != ".stasis-store"
        ]
        assert leftovers == []
        # It is not frozen either: it still answers a signal.
        import os
        import signal

        child = proctree.children(job["pid"])[0]
        os.kill(child, signal.SIGUSR1)
        wait_for(lambda: d.log_of(job["job"]).count("digest") == 2, what="job answers")
    finally:
        d.kill_all()
        d.stop()
        subprocess.run(["umount", str(mnt)], check=True)


def test_daemon_not_running(world_tmp: Path) -> None:
    env = {
        "STASIS_SOCKET": str(world_tmp / "nothing.sock"),
        "PATH": "/usr/bin:/bin",
        "STASIS_CONFIG": "",
    }
    result = subprocess.run([STASIS, "ps"], env=env, capture_output=True, text=True)
    one_line_error(result, 1, "cannot reach the stasis daemon", "stasis daemon")


def test_user_cannot_touch_another_users_job(daemon: Daemon) -> None:
    job = daemon.run(*workload("counter.py"))
    result = daemon.cli("dump", job["job"], user="stasis-test", check=False)
    one_line_error(result, 2, "permission denied")
    one_line_error(
        daemon.cli("kill", job["job"], user="stasis-test", check=False), 2, "permission denied"
    )
    one_line_error(
        daemon.cli("run", "--user", "root", "--", "true", user="stasis-test", check=False),
        2,
        "permission denied",
    )
    assert job["job"] not in [j["job"] for j in daemon.json("ps", user="stasis-test")]
    assert daemon.job(job["job"])["state"] == "running"
    daemon.cli("kill", job["job"])


def test_every_local_user_reaches_the_daemon_by_default(daemon: Daemon) -> None:
    # No group chores for a site with thousands of directory users: peer credentials, not the
    # socket's mode, decide what each may do (test_user_cannot_touch_another_users_job).
    assert daemon.socket.stat().st_mode & 0o777 == 0o666
    user = pwd.getpwnam("stasis-test")
    assert user.pw_gid != daemon.socket.stat().st_gid
    job = daemon.json("run", "--", *workload("counter.py"), user="stasis-test")
    try:
        assert [j["job"] for j in daemon.json("ps", user="stasis-test")] == [job["job"]]
    finally:
        daemon.cli("kill", job["job"], user="stasis-test")


def test_socket_group_restricts_the_socket_to_its_members(make_daemon: MakeDaemon) -> None:
    if subprocess.run(["getent", "group", SOCKET_GROUP], capture_output=True).returncode:
        subprocess.run(["groupadd", SOCKET_GROUP], check=True)
    d = make_daemon(env={"STASIS_SOCKET_GROUP": SOCKET_GROUP})
    st = d.socket.stat()
    assert (st.st_mode & 0o777, st.st_gid) == (0o660, grp.getgrnam(SOCKET_GROUP).gr_gid)
    line = one_line_error(
        d.cli("ps", user="stasis-test", check=False),
        1,
        "permission denied",
        str(d.socket),
        SOCKET_GROUP,
    )
    assert "start it with" not in line  # the daemon runs: starting one is not the advice
    assert d.cli("ps").returncode == 0  # root still is


def test_a_socket_group_that_does_not_exist_stops_the_daemon(world_tmp: Path) -> None:
    d = new_daemon(world_tmp, "nogroup", env={"STASIS_SOCKET_GROUP": "no-such-group-xyz"})
    result = subprocess.run(
        [STASIS, "daemon"], env=d.env, capture_output=True, text=True, timeout=60
    )
    one_line_error(result, 2, "no-such-group-xyz", "does not exist", "groupadd")
    assert not d.socket.exists() and not d.state_dir.exists()
