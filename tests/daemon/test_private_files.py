"""What the daemon writes is private, and it keeps no secret it does not need: a job's --env
values reach the job (and come back with a restore, from the job's memory) but no file of the
daemon's, and no other user can read the job table."""

from __future__ import annotations

import os
import pwd
import secrets
import stat
import subprocess
from pathlib import Path

from tests.conftest import Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_restore_state import last_number, workload_pid


def _environ(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


def test_env_values_are_not_kept_and_state_is_private(
    make_daemon: MakeDaemon, test_user: pwd.struct_passwd
) -> None:
    d: Daemon = make_daemon()
    user = test_user.pw_name
    secret = f"tok-{secrets.token_hex(8)}"
    job = d.json("run", "--env", f"API_TOKEN={secret}", "--", *workload("counter.py"), user=user)
    wait_for(lambda: last_number(d, job["job"]) >= 2, what="counting")
    assert f"API_TOKEN={secret}" in _environ(workload_pid(job["pid"]))  # the job has it
    # A checkpoint and a restore write staging, CRIU logs and another job row.
    cp = d.json("dump", job["job"], user=user)
    restored = d.json("restore", cp["checkpoint"], user=user)
    at = last_number(d, job["job"])
    wait_for(lambda: last_number(d, restored["job"]) > at, what="counting after the restore")
    # CRIU brings the environment back from the job's memory: the daemon need not keep it.
    assert f"API_TOKEN={secret}" in _environ(workload_pid(restored["pid"]))

    for listing in (
        d.cli("ps", "--json").stdout,
        d.cli("ps").stdout,
        d.cli("ps", "--json", user=user).stdout,
    ):
        assert secret not in listing
    state = d.state_dir
    for name in ("jobs.db", "jobs.db-wal", "jobs.db-shm"):
        assert (state / name).exists(), name  # the daemon is running: WAL mode keeps them
    holders = [p for p in _files(state) if secret.encode() in p.read_bytes()]
    assert holders == [], f"files holding an --env value: {holders}"

    logs = state / "logs"
    for path in _files(state):
        st = path.stat()
        if path.parent == logs:
            # The job's own output: its owner's, not the world's.
            assert st.st_uid == test_user.pw_uid, path
            assert stat.S_IMODE(st.st_mode) & 0o007 == 0, (path, oct(st.st_mode))
        else:
            assert st.st_uid == 0, path
            assert stat.S_IMODE(st.st_mode) & 0o077 == 0, (path, oct(st.st_mode))
    # And a real ordinary user cannot read the table, its WAL or its shared memory.
    for name in ("jobs.db", "jobs.db-wal", "jobs.db-shm"):
        read = subprocess.run(
            ["runuser", "-u", user, "--", "cat", str(state / name)], capture_output=True
        )
        assert read.returncode != 0 and read.stdout == b"", name
    d.cli("kill", restored["job"], user=user)


def test_job_keeps_the_umask_it_had(
    make_daemon: MakeDaemon, world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    # The daemon's own files are private; the files a job makes are the job's business.
    d: Daemon = make_daemon()
    out = world_tmp / f"made-{secrets.token_hex(3)}"
    out.mkdir()
    os.chown(out, test_user.pw_uid, test_user.pw_gid)
    job = d.json(
        "run", "--cwd", str(out), "--", "sh", "-c", "umask; touch made", user=test_user.pw_name
    )
    wait_for(
        lambda: (out / "made").exists() and d.job(job["job"])["state"] == "exited",
        what="the job's file",
    )
    started_with = os.umask(0)  # the daemon's, inherited from this process
    os.umask(started_with)
    assert d.log_of(job["job"]).strip() == f"{started_with:04o}"
    assert stat.S_IMODE((out / "made").stat().st_mode) == 0o666 & ~started_with


def test_env_values_an_older_daemon_kept_are_forgotten(tmp_path: Path) -> None:
    # A table written before values were dropped: its next start keeps the names only.
    from stasis.daemon.db import JobDB

    path = tmp_path / "jobs.db"
    db = JobDB(path)
    with db.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO jobs (id, state, label, command, cwd, env, user, uid, gid, log, created, "
            "job_dir) VALUES ('0123456789ab', 'exited', 'l', '[\"true\"]', '/', "
            "'{\"API_TOKEN\": \"old-secret-value\"}', 'root', 0, 0, '/x', 'now', '/y')"
        )
    db.engine.dispose()
    db = JobDB(path)
    row = db.get("0123456789ab")
    assert row is not None and row.env == ["API_TOKEN"]
    db.engine.dispose()
    for name in ("jobs.db", "jobs.db-wal", "jobs.db-shm"):
        if (tmp_path / name).exists():
            assert b"old-secret-value" not in (tmp_path / name).read_bytes(), name


def test_job_table_an_older_daemon_left_readable_is_made_private(make_daemon: MakeDaemon) -> None:
    d: Daemon = make_daemon()
    d.run("true")
    d.stop()
    state = d.state_dir
    # As an older daemon left them (killed: its WAL and shared memory stay behind).
    for name in ("jobs.db", "jobs.db-wal", "jobs.db-shm"):
        (state / name).touch()
        os.chmod(state / name, 0o644)
    d.start()
    d.run("true")
    for name in ("jobs.db", "jobs.db-wal", "jobs.db-shm"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
