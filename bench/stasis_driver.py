"""A private stasis daemon (own socket, state and store) and the `stasis` CLI wired to it.

Every timed figure is the wall time of the `stasis` command a user would type, CLI start-up
included; the daemon's own `duration_s` (the CRIU part) is recorded beside it for diagnosis.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import BenchError

STASIS = str(Path(sys.executable).parent / "stasis")


@dataclass(frozen=True)
class Timed:
    wall_s: float
    answer: Any


class StasisDaemon:
    def __init__(
        self,
        root: Path,
        store: Path | None,
        stasis: str = STASIS,
        url: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`store` None: the default store, <state_dir>/checkpoints, on the disk under `root`.

        `stasis` is the command to run (a snapshot's, see bench.snapshot). Everything runs with
        `root` as its working directory: `python -m` (the job shims) would import stasis from
        the current directory first. `url`: how the daemon is to name `store` (dir::file://).
        """
        self.root = root
        self.stasis = stasis
        self.state_dir = root / "state"
        self.store_root = store if store is not None else self.state_dir / "checkpoints"
        self.env = {
            **os.environ,
            "STASIS_SOCKET": str(root / "stasis.sock"),
            "STASIS_STATE_DIR": str(self.state_dir),
            "STASIS_KEEP": "0",  # the bench deletes what it made; retention must not interfere
            "STASIS_CONFIG": "",
            **(env or {}),
        }
        if store is not None:
            self.env["STASIS_STORE"] = url or str(store)
        # Used by the encrypt mode only (`dump --encrypt`); the other modes store in the clear.
        self.env["STASIS_ENCRYPTION_KEY_FILE"] = str(root / "encryption.key")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def criu_work(self) -> Path:
        """Where the daemon's CRIU writes its logs and stats-dump / stats-restore."""
        return self.state_dir / "criu-logs"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        key = self.root / "encryption.key"
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, os.urandom(32))
            os.close(fd)
        with open(self.root / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen(
                [self.stasis, "daemon"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"stasis daemon exited; see {self.root / 'daemon.log'}")
            if self.cli("ps", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise BenchError("stasis daemon did not answer within 30 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [self.stasis, *args],
            env=self.env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=1800,
            cwd=self.root,
        )
        if check and done.returncode != 0:
            raise BenchError(
                f"stasis {' '.join(args)} failed ({done.returncode}): "
                f"{(done.stderr or done.stdout).strip()[-400:]}"
            )
        return done

    def timed_json(self, *args: str) -> Timed:
        start = time.monotonic()
        done = self.cli(*args)
        wall = time.monotonic() - start
        return Timed(wall, json.loads(done.stdout))

    def help_text(self, subcommand: str) -> str:
        return self.cli(*subcommand.split(), "--help", check=False).stdout

    def cli_floor_s(self) -> float:
        """The least any stasis command costs: CLI start-up plus one API round trip."""
        return self.timed_json("ps", "--json").wall_s

    # -- the steps the bench takes ---------------------------------------------------------

    def run(self, command: list[str], log: Path) -> dict[str, Any]:
        answer: dict[str, Any] = self.timed_json(
            "run", "--json", "--log", str(log), "--", *command
        ).answer
        return answer

    def dump(self, job: str, args: tuple[str, ...]) -> Timed:
        return self.timed_json("dump", job, "--json", *args)

    def restore(self, checkpoint: str, args: tuple[str, ...]) -> Timed:
        return self.timed_json("restore", checkpoint, "--json", *args)

    def kill(self, job: str) -> None:
        self.cli("kill", job, "--json", check=False)

    def remove_checkpoint(self, checkpoint: str) -> None:
        self.cli("checkpoints", "rm", checkpoint, check=False)
