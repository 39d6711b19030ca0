"""A dump of a user's job refuses a tree holding credentials beyond its owner's (issue 27,
item 5): CRIU (root) gives a restored tree back the credentials its images record, so a user
who checkpoints a setuid-root program mid-run would get a root process back. The attacker is
the unprivileged test user, through the daemon's socket; the setuid program is a root-owned
copy of sleep with mode 4755 in a private directory."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stasis.engine import credentials, proctree
from tests.conftest import Daemon, wait_for, workload


@pytest.fixture(scope="module")
def setuid_sleep(world_tmp: Path) -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="setuid-", dir=world_tmp))
    os.chmod(where, 0o755)
    path = where / "setuid-sleep"
    shutil.copyfile(shutil.which("sleep") or "/bin/sleep", path)
    os.chown(path, 0, 0)
    os.chmod(path, 0o4755)
    yield path
    shutil.rmtree(where, ignore_errors=True)


def _numbers(d: Daemon, job: str) -> list[int]:
    return [int(n) for n in re.findall(r"^(\d+)$", d.log_of(job), re.M)]


def _pid_running(root: int, program: Path) -> int | None:
    for pid in proctree.tree(root):
        try:
            if os.readlink(f"/proc/{pid}/exe") == str(program):
                return pid
        except OSError:
            continue
    return None


def _job(d: Daemon, setuid_sleep: Path, user: str | None) -> tuple[str, int]:
    """A counting job that runs the setuid sleep in the background: (job id, the sleep's pid)."""
    command = f"{setuid_sleep} 600 & exec {' '.join(workload('counter.py', 0.1))}"
    job = d.run("sh", "-c", command, user=user)
    wait_for(lambda: len(_numbers(d, job["job"])) >= 3, what="the counter")
    sleeper = wait_for(lambda: _pid_running(job["pid"], setuid_sleep), what="the setuid sleep")
    return job["job"], sleeper


def test_a_users_job_running_a_setuid_program_is_not_checkpointed(
    daemon: Daemon, setuid_sleep: Path, test_user: pwd.struct_passwd
) -> None:
    user = test_user.pw_name
    job, sleeper = _job(daemon, setuid_sleep, user)
    status = Path(f"/proc/{sleeper}/status").read_text()
    assert re.search(rf"^Uid:\s+{test_user.pw_uid}\s+0\s+0\s+0$", status, re.M), status
    caps = re.search(r"^CapEff:\s+(\S+)$", status, re.M)
    assert caps is not None
    holds = (
        f"pid {sleeper} (setuid-sleep) holds effective, saved and fs uid 0 (root), "
        f"permitted and effective capabilities {int(caps.group(1), 16):#x}: more "
        f"than its owner {user} (uid {test_user.pw_uid}) has (a setuid program caught "
        "mid-run?), and a restore would give it back; checkpoint again once that program "
        "has ended"
    )

    for leave_running in (False, True):
        result = daemon.cli(
            "dump", *(["--leave-running"] if leave_running else []), job, user=user, check=False
        )
        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stderr == (
            f"stasis: error: checkpoint of job {job} refused, job still " f"running: {holds}\n"
        )
        # The job runs on, its counter moving; nothing was published.
        seen = len(_numbers(daemon, job))
        wait_for(lambda: len(_numbers(daemon, job)) >= seen + 3, what="more counting")
        assert daemon.job(job)["state"] == "running"
        assert [c for c in daemon.json("checkpoints", user=user) if c["job"] == job] == []
        assert [c for c in daemon.json("checkpoints") if c["job"] == job] == []

    # `dump --check` says it too.
    check = daemon.cli("dump", "--check", job, user=user, check=False)
    assert check.returncode == 1
    assert f"- {holds}" in check.stdout.splitlines()
    answer = json.loads(daemon.cli("dump", "--check", "--json", job, user=user, check=False).stdout)
    assert holds in answer["obstacles"]

    # Once the setuid program has ended, the same job checkpoints.
    os.kill(sleeper, 9)
    wait_for(
        lambda: _pid_running(daemon.job(job)["pid"], setuid_sleep) is None, what="the sleep to end"
    )
    cp = daemon.json("dump", "--leave-running", job, user=user)
    assert [c["id"] for c in daemon.json("checkpoints", user=user) if c["job"] == job] == [
        cp["checkpoint"]
    ]
    daemon.cli("kill", job, user=user)


def test_roots_job_running_the_same_is_checkpointed(daemon: Daemon, setuid_sleep: Path) -> None:
    job, _ = _job(daemon, setuid_sleep, None)
    assert "holds" not in daemon.cli("dump", "--check", job, check=False).stdout
    cp = daemon.json("dump", "--leave-running", job)
    assert cp["job"] == job
    daemon.cli("kill", job)


def test_capabilities_inside_the_users_own_user_namespace_are_theirs(
    daemon: Daemon, test_user: pwd.struct_passwd
) -> None:
    """`unshare -r` gives a process every capability inside a user namespace its user owns:
    confined there, nothing to refuse (whatever else CRIU thinks of user namespaces)."""
    user = test_user.pw_name
    job = daemon.run("unshare", "-r", "sleep", "600", user=user)
    sleeper = wait_for(
        lambda: next(
            (
                p
                for p in proctree.tree(job["pid"])
                if Path(f"/proc/{p}/comm").read_text() == "sleep\n"
            ),
            None,
        ),
        what="the sleep",
    )
    status = Path(f"/proc/{sleeper}/status").read_text()
    assert re.search(r"^CapEff:\s+0*[1-9a-f]", status, re.M), status  # it has capabilities
    groups = os.getgrouplist(user, test_user.pw_gid)
    assert credentials.tree_excess(job["pid"], test_user.pw_uid, groups) == []
    # ...while the same thread, were its namespace not the user's, would be refused for them.
    cred = credentials.read(sleeper, sleeper)
    assert cred is not None and credentials.excess(cred, test_user.pw_uid, groups)
    assert "holds" not in daemon.cli("dump", "--check", job["job"], user=user, check=False).stdout
    daemon.cli("kill", job["job"], user=user)


def test_credentials_from_a_status_file() -> None:
    status = (
        b"Name:\tx\nUid:\t1000\t1000\t0\t1000\nGid:\t1000\t1000\t1000\t1000\n"
        b"Groups:\t27 1000 \nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\n"
        b"CapEff:\t0000000000000000\nCapBnd:\t000001ffffffffff\n"
        b"CapAmb:\t0000000000000000\n"
    )
    cred = credentials.parse_status(status)
    assert cred.uids == (1000, 1000, 0, 1000) and cred.groups == (27, 1000)
    assert credentials.excess(cred, 1000, [1000, 27]) == ["saved uid 0 (root)"]
    saved, group = credentials.excess(cred, 1000, [1000])
    assert saved == "saved uid 0 (root)" and group.startswith("supplementary group 27 (")
    with pytest.raises(ValueError):
        credentials.parse_status(b"Name:\tx\nUid:\t1000\n")


@settings(max_examples=300, deadline=None, database=None)
@given(
    text=st.binary(max_size=300)
    | st.lists(
        st.sampled_from(
            [
                b"Name:\tx\x00\xff",
                b"State:\tZ (zombie)",
                b"Uid:\t1 2 3 4",
                b"Uid:\t-1 0 0 0",
                b"Uid:\t99999999999 0 0 0",
                b"Gid:\t1 2 3 4",
                b"Gid:\t5",
                b"Groups:\t",
                b"Groups:\t1 x",
                b"CapPrm:\tzz",
                b"CapEff:\t" + b"f" * 300,
                b"CapAmb:\t0",
            ]
        ),
        max_size=8,
    ).map(b"\n".join)
)
def test_fuzz_status_files(text: bytes) -> None:
    """A status file names what its process chose (Name): whatever it holds, the parser
    returns credentials within range or ValueError, nothing else."""
    try:
        cred = credentials.parse_status(text)
    except ValueError:
        return
    assert len(cred.uids) == len(cred.gids) == 4
    assert all(0 <= v <= 0xFFFFFFFF for v in (*cred.uids, *cred.gids, *cred.groups))


def test_the_frozen_tree_is_checked_again_at_criu_post_dump(
    daemon: Daemon, setuid_sleep: Path, test_user: pwd.struct_passwd
) -> None:
    """The handler a leave-running dump gives CRIU: at post-dump (the tree frozen as its images
    record it) a setuid program that started after the first check aborts the dump (False);
    without one it lists the open files and lets CRIU go on. Real processes, CRIU not run."""
    from stasis.daemon.dumping import _CredentialsAtPostDump
    from stasis.engine.nodefacts import OpenFilesAtDump
    from stasis.store import CheckpointInfo, new_checkpoint_id

    user = test_user.pw_name
    job, sleeper = _job(daemon, setuid_sleep, user)
    pid = daemon.job(job)["pid"]
    info = CheckpointInfo(
        id=new_checkpoint_id(),
        label="l",
        job=job,
        host="h",
        criu_version="4",
        command=["sh"],
        cwd="/",
        user=user,
        uid=test_user.pw_uid,
        gid=test_user.pw_gid,
    )
    opened = OpenFilesAtDump(pid)
    handler = _CredentialsAtPostDump(pid, info, opened)
    assert handler("pre-dump", pid) is True
    assert handler("post-dump", pid) is False
    assert handler.refused is not None and handler.refused.startswith(
        f"pid {sleeper} (setuid-sleep) holds effective, saved and fs uid 0 (root)"
    )
    assert opened.files is None  # refused before anything else was looked at
    os.kill(sleeper, 9)
    wait_for(lambda: _pid_running(pid, setuid_sleep) is None, what="the sleep to end")
    again = _CredentialsAtPostDump(pid, info, opened)
    assert again("post-dump", pid) is True and again.refused is None
    assert opened.files is not None
    daemon.cli("kill", job, user=user)


def test_images_of_a_setuid_program_say_what_a_restore_would_give_back(
    daemon: Daemon, setuid_sleep: Path, test_user: pwd.struct_passwd, tmp_path: Path
) -> None:
    """What the daemon now refuses to take, taken with CRIU directly (the engine has no such
    check): the core images record the setuid thread's root uids, which images_excess names
    (what a restore of such a checkpoint, taken before this check, would give back)."""
    from stasis.engine import CRIU, DumpOptions, find_criu

    user = test_user.pw_name
    job, sleeper = _job(daemon, setuid_sleep, user)
    pid = daemon.job(job)["pid"]
    images = tmp_path / "images"
    images.mkdir()
    CRIU(find_criu(), tmp_path / "logs").dump(
        pid, images, DumpOptions(leave_running=True), "dump.log"
    )
    groups = os.getgrouplist(user, test_user.pw_gid)
    found = credentials.images_excess(images, test_user.pw_uid, groups)
    sleeper_ns = Path(f"/proc/{sleeper}/status").read_text()
    ns_pid = re.search(r"^NSpid:.*\s(\d+)$", sleeper_ns, re.M)
    assert ns_pid is not None
    assert [line.split(" holds ")[0] for line in found] == [f"thread {ns_pid.group(1)}"], found
    assert found[0].startswith(
        f"thread {ns_pid.group(1)} holds effective, saved and fs uid 0 "
        "(root), permitted and effective capabilities 0x"
    )
    cred = credentials.image_credentials((images / f"core-{ns_pid.group(1)}.img").read_bytes())
    assert cred is not None and cred.uids == (test_user.pw_uid, 0, 0, 0)
    daemon.cli("kill", job, user=user)


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.binary(max_size=200))
def test_fuzz_core_images(data: bytes) -> None:
    try:
        cred = credentials.image_credentials(data)
    except ValueError:
        return
    assert cred is None or len(cred.uids) == 4


def test_images_holding_more_than_their_owner_are_not_restored_for_them(
    daemon: Daemon, world_tmp: Path
) -> None:
    """The restore side: root's checkpoint whose manifest a trusted signer made say it is the
    test user's (what an older stasis, which let a setuid tree through, or a node this one
    trusts, could publish). Restoring it for the user would give them a root process (its
    log is one they may write, so that nothing else stops the restore)."""
    from tests.conftest import TEST_USER
    from tests.daemon.test_bad_input import one_line_error
    from tests.daemon.test_restore_facts import _manifest, _resign

    log = Path(tempfile.mkdtemp(dir=world_tmp)) / "root-job.log"
    os.chmod(log.parent, 0o777)
    log.touch()
    os.chmod(log, 0o666)
    job = daemon.json(
        "run", "--label", "creds-restore", "--log", str(log), "--", *workload("counter.py")
    )
    wait_for(lambda: re.findall(r"^\d+$", log.read_text(), re.M), what="counting")
    ckpt = daemon.json("dump", job["job"])["checkpoint"]
    user = pwd.getpwnam(TEST_USER)
    document = _manifest(daemon, ckpt)
    document.update(user=TEST_USER, uid=user.pw_uid, gid=user.pw_gid)
    _resign(daemon, ckpt, document)
    running = [j["job"] for j in daemon.json("ps") if j["state"] == "running"]

    line = one_line_error(
        daemon.cli("restore", ckpt, user=TEST_USER, check=False),
        1,
        f"checkpoint {ckpt} refused",
        "uid 0 (root)",
        "only root",
    )
    assert "thread" in line
    assert [j["job"] for j in daemon.json("ps") if j["state"] == "running"] == running
