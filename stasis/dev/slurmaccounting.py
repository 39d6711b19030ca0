"""Slurm accounting for the local cluster: a private MariaDB and slurmdbd (`local-cluster up
--accounting`).

`start` is called by `cluster.up` after munged is up and before slurmctld starts. It owns:

    D/accounting/mariadb/       owned by mysql: db/ (the data directory), mysqld.sock, its log
                                and pid file; MariaDB also listens on a private loopback port
    D/accounting/slurmdbd.*     slurmdbd's log and pid files
    D/accounting/client.conf    a minimal slurm.conf for sacctmgr before slurmctld has one
    D/etc/slurmdbd.conf         slurmdbd's config (0600: it holds the database password); slurmdbd
                                reads it from beside SLURM_CONF

The cluster `stasis-local` is added to the database before slurmctld starts (which comes with
root in the account `root`), so slurmctld registers at once and every job is recorded. Other
users get an association with `sacctmgr -i add user NAME Account=ACCOUNT` (see `add_user`);
without one their jobs still run and are recorded (no AccountingStorageEnforce), with an empty
Account.
The pids go into `started` as "mariadb" and "slurmdbd"; `cluster.down` stops them.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
from pathlib import Path

from stasis.daemon import detached
from stasis.dev import commands
from stasis.dev.slurmdirs import SlurmClusterDirs
from stasis.errors import SlurmError, UsageError
from stasis.poll import poll

CLUSTER = "stasis-local"
ACCOUNT = "local"
_DB = "slurm_acct_db"
_START_TIMEOUT_S = 60.0
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _tail(path: Path) -> str:
    """The last 1500 bytes of a log (read from its end: a log may be large)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - 1500))
            return f.read(1500).decode(errors="replace")
    except OSError:
        return "(no log)"


def directory(lay: SlurmClusterDirs) -> Path:
    return lay.root / "accounting"


def client_conf(lay: SlurmClusterDirs) -> Path:
    return directory(lay) / "client.conf"


def start(lay: SlurmClusterDirs, started: dict[str, int]) -> str:
    """Start MariaDB and slurmdbd under `lay.root` (their pids go into `started`, by name);
    returns the slurm.conf lines that make slurmctld use them."""
    for tool in ("mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "sacctmgr"):
        if not shutil.which(tool, path=_PATH):
            raise UsageError(
                f"{tool} is not installed; run `make install` " "(scripts/install-slurm.sh)"
            )
    acct = directory(lay)
    acct.mkdir(parents=True, exist_ok=True)
    os.chmod(acct, 0o755)
    db_port = _start_mariadb(lay, acct, started)
    password = secrets.token_hex(16)
    # The database exists before slurmdbd first connects: slurmdbd would otherwise create it
    # itself, then reconnect on the MYSQL handle whose connect failed (unknown database), and
    # with MariaDB Connector/C 3.4 (Debian 13) every result on that handle fails with 5027
    # "Number of columns in result ... exceeds maximum allowed number of columns (=0)":
    # slurmdbd 24.11 exits at its first query.
    _sql(
        acct,
        f"CREATE DATABASE IF NOT EXISTS {_DB};"
        f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
        f"ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
        f"GRANT ALL ON {_DB}.* TO 'slurm'@'127.0.0.1';",
    )
    dbd_port = commands.free_port()
    munge_sock = lay.munge / "munge.sock"
    conf = lay.etc / "slurmdbd.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.touch(mode=0o600)
    os.chmod(conf, 0o600)
    conf.write_text(f"""\
# slurmdbd of the local cluster (`stasis-dev local-cluster up --accounting`).
AuthType=auth/munge
AuthInfo=socket={munge_sock}
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort={dbd_port}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser=slurm
StoragePass={password}
StorageLoc={_DB}
LogFile={acct}/slurmdbd.log
PidFile={acct}/slurmdbd.pid
""")
    lines = (
        f"AccountingStorageType=accounting_storage/slurmdbd\n"
        f"AccountingStorageHost=127.0.0.1\n"
        f"AccountingStoragePort={dbd_port}\n"
        # Clients (sacct, sacctmgr) take the munge socket from this key, not AuthInfo.
        f"AccountingStoragePass={munge_sock}\n"
        f"AccountingStorageTRES=gres/gpu\n"
        f"AccountingStoreFlags=job_script,job_env\n"
        f"JobAcctGatherType=jobacct_gather/linux\n"
        f"JobAcctGatherFrequency=task=5"
    )
    # sacctmgr needs a slurm.conf naming the cluster and slurmdbd before slurmctld's exists.
    client_conf(lay).write_text(
        f"ClusterName={CLUSTER}\n"
        f"SlurmctldHost=localhost(127.0.0.1)\n"
        f"AuthType=auth/munge\nAuthInfo=socket={munge_sock}\n"
        f"{lines}\n"
    )
    env = {"PATH": _PATH, "SLURM_CONF": str(lay.slurm_conf), **commands.session_mark()}
    log = acct / "slurmdbd.log"
    pid = _start(["slurmdbd", "-D"], acct / "slurmdbd.run.pid", acct / "slurmdbd.out", env)
    started["slurmdbd"] = pid or 0

    def up() -> bool:
        if not detached.alive(pid):
            raise SlurmError(
                "slurmdbd exited at start: " + _tail(log) + _tail(acct / "slurmdbd.out")
            )
        return _answers(dbd_port)

    if not poll(up, _START_TIMEOUT_S, 0.1):
        raise SlurmError(
            f"slurmdbd did not listen on port {dbd_port} in "
            f"{_START_TIMEOUT_S:.0f} s: {_tail(log)}"
        )
    _add(lay, "cluster", CLUSTER)
    return lines


def _start_mariadb(lay: SlurmClusterDirs, acct: Path, started: dict[str, int]) -> int:
    mysql = pwd.getpwnam("mysql")
    run = acct / "mariadb"
    data = run / "db"
    run.mkdir(exist_ok=True)
    os.chown(run, mysql.pw_uid, mysql.pw_gid)
    if not (data / "mysql").is_dir():
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir()
        os.chown(data, mysql.pw_uid, mysql.pw_gid)
        commands.slurm(
            [
                "mariadb-install-db",
                "--no-defaults",
                "--user=mysql",
                f"--datadir={data}",
                "--auth-root-authentication-method=socket",
                "--skip-test-db",
            ]
        )
    port = commands.free_port()
    sock = _mysql_socket(acct)
    log = run / "mysqld.log"
    pid = _start(
        [
            "mariadbd",
            "--no-defaults",
            "--user=mysql",
            f"--datadir={data}",
            f"--socket={sock}",
            f"--pid-file={run}/mysqld.pid",
            f"--port={port}",
            "--bind-address=127.0.0.1",
            "--skip-name-resolve",
            "--innodb-buffer-pool-size=64M",
            "--innodb-lock-wait-timeout=900",
            f"--log-error={log}",
        ],
        acct / "mariadb.run.pid",
        acct / "mariadb.out",
        {"PATH": _PATH, **commands.session_mark()},
    )
    started["mariadb"] = pid or 0

    def up() -> bool:
        if not detached.alive(pid):
            raise SlurmError("MariaDB exited at start: " + _tail(log))
        return sock.exists() and _answers(port)

    if not poll(up, _START_TIMEOUT_S, 0.1):
        raise SlurmError(f"MariaDB did not listen in {_START_TIMEOUT_S:.0f} s: {_tail(log)}")
    return port


def _start(argv: list[str], pid_file: Path, log: Path, env: dict[str, str]) -> int | None:
    """detached.start, but a daemon whose start is cut short (`up` ended by a signal before
    its pid came back) is stopped, not left running unrecorded."""
    pid_file.unlink(missing_ok=True)  # what it names below is this start's
    try:
        return detached.start(argv, pid_file, log, env)
    except BaseException:
        detached.stop(detached.read_pid(pid_file))
        raise


def _mysql_socket(acct: Path) -> Path:
    return acct / "mariadb" / "mysqld.sock"


def _sql(acct: Path, statements: str) -> None:
    commands.slurm(
        ["mariadb", "--no-defaults", f"--socket={_mysql_socket(acct)}", "-u", "root"],
        {"PATH": _PATH},
        input_text=statements,
    )


def _sacctmgr(lay: SlurmClusterDirs, *args: str) -> str:
    # Not lay.slurm_conf: at start it is not written yet, or an earlier `up`'s (other ports).
    env = {"PATH": _PATH, "SLURM_CONF": str(client_conf(lay))}
    return commands.slurm(["sacctmgr", "-i", *args], env).stdout


def _add(lay: SlurmClusterDirs, *args: str) -> None:
    """`sacctmgr add ...`, idempotent: what exists already is not an error."""
    try:
        _sacctmgr(lay, "add", *args)
    except SlurmError as e:
        # sacctmgr's words for "already there" (exit status 1 all the same).
        if "Nothing new added" not in str(e) and "already exists" not in str(e):
            raise


def add_user(lay: SlurmClusterDirs, user: str, account: str = ACCOUNT) -> None:
    """Give `user` an association in `account` (both created if needed) on the local cluster;
    the first account a user gets is its default one."""
    _add(lay, "account", account, f"Description={account}", f"Organization={account}")
    _add(lay, "user", user, f"Account={account}")
