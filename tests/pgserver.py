"""A real PostgreSQL server for the control plane's tests: Debian's, started as the `postgres`
user (it refuses root) in a private directory, on a loopback port, with password auth; one per
test session, a fresh database per test."""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
from pathlib import Path

from tests.s3server import free_ports


def _bin(tool: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))
    if not found:
        raise AssertionError(
            f"PostgreSQL's {tool} is missing: run `make install` "
            "(scripts/install-test-apps.sh installs postgresql)"
        )
    return found[-1]


class PostgresServer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.port = free_ports(1)[0]
        self.password = secrets.token_hex(12)

    def _as_postgres(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["runuser", "-u", "postgres", "--", *cmd],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self.root,
        )

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.chown(self.root, "postgres", "postgres")
        os.chmod(self.root, 0o700)
        pwfile = self.root / "pw"
        pwfile.write_text(self.password + "\n")
        shutil.chown(pwfile, "postgres", "postgres")
        r = self._as_postgres(
            _bin("initdb"),
            "-D",
            str(self.data),
            "-U",
            "stasis",
            "--auth=scram-sha-256",
            f"--pwfile={pwfile}",
            "-E",
            "UTF8",
            "--no-sync",
        )
        assert r.returncode == 0, r.stderr
        r = self._as_postgres(
            _bin("pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.root / "server.log"),
            "-w",
            "-o",
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1",
            "start",
        )
        assert r.returncode == 0, r.stderr + (self.root / "server.log").read_text()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://stasis:{self.password}@127.0.0.1:{self.port}/" f"{database}"

    def new_database(self) -> str:
        from sqlalchemy import create_engine, text

        name = "cp_" + secrets.token_hex(4)
        engine = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(text(f"CREATE DATABASE {name}"))
        finally:
            engine.dispose()
        return self.url(name)

    def stop(self) -> None:
        self._as_postgres(_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
