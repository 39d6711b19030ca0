"""A real containerd with the stasis runtime (`stasis-dev local-node up`) and a busybox image
built here from Debian's busybox-static as an OCI archive (no registry is reachable)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

from stasis.dev import k8snode
from stasis.k8s import oci
from tests.conftest import STASIS, STASIS_DEV

IMAGE = "stasis.test/busybox:1"
BUSYBOX = "/usr/bin/busybox"
APPLETS = ("sh", "cat", "echo", "sleep", "ls", "rm", "mkdir", "seq", "true", "head", "base64")


def add_busybox(tar: tarfile.TarFile, dirs: tuple[str, ...] = ("bin", "tmp", "data")) -> None:
    """busybox and its applets in /bin of an image layer, and the directories `dirs`
    (/tmp writable by all)."""
    for d in dirs:
        info = tarfile.TarInfo(d)
        info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
        tar.addfile(info)
    tar.add(BUSYBOX, arcname="bin/busybox")
    for applet in APPLETS:
        info = tarfile.TarInfo(f"bin/{applet}")
        info.type, info.linkname = tarfile.SYMTYPE, "busybox"
        tar.addfile(info)


def write_image(out: Path, layer: bytes, name: str) -> Path:
    """An OCI image archive of one layer that runs /bin/sh (written as stasis writes images)."""
    oci.write_archive(
        out,
        [layer],
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
        },
        {},
        name,
    )
    return out


def busybox_archive(out: Path) -> Path:
    """An OCI image archive of busybox with a few applets (written as stasis writes images)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        add_busybox(tar)
    return write_image(out, layer.getvalue(), IMAGE)


def numbers(log: Path) -> list[int]:
    """What a counting container logged (its `n=N` lines), in order."""
    return [int(m) for m in re.findall(r"^n=(\d+)$", log.read_text(), re.M)]


class Node:
    """The local node, driven with `ctr` the way the kubelet drives containerd's tasks."""

    def __init__(
        self,
        root: Path,
        bundle: bool = False,
        min_interval_s: int | None = None,
        kubeconfig: Path | None = None,
        node_name: str = "",
        separate: bool = False,
    ) -> None:
        """`separate`: a host of its own (`local-node up --separate`): its /tmp, /var/tmp,
        /dev/shm, /run (runc's state) and host name; `inside` runs a command there."""
        self.root = root
        self.bundle = bundle
        self.options = [
            *(["--bundle"] if bundle else []),
            *(["--separate"] if separate else []),
            *([f"--min-interval={min_interval_s}"] if min_interval_s is not None else []),
            *([f"--kubeconfig={kubeconfig}"] if kubeconfig else []),
            *([f"--node-name={node_name}"] if node_name else []),
        ]
        self.lay = k8snode.K8sNodeDirs(root)
        self.info: dict[str, Any] = {}

    def up(self) -> None:
        r = subprocess.run(
            [STASIS_DEV, "local-node", "up", "--dir", str(self.root), "--json", *self.options],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "STASIS_CONFIG": ""},
        )
        assert r.returncode == 0, r.stderr + r.stdout
        self.info = json.loads(r.stdout)
        archive = busybox_archive(self.root / "busybox.tar")
        r = self.ctr("images", "import", str(archive))
        assert r.returncode == 0, r.stderr

    def down(self) -> None:
        subprocess.run(
            [STASIS_DEV, "local-node", "down", "--dir", str(self.root)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    def restart_daemon(self) -> None:
        k8snode.start_daemon(self.lay)

    def configure(self, values: dict[str, object]) -> None:
        """More settings in the daemon's config file; the daemon started again with them."""
        from stasis.daemon import detached

        with self.lay.stasis_config.open("a") as out:
            for key, value in values.items():
                out.write(f"{key} = {json.dumps(value)}\n")
        detached.stop(detached.read_pid(self.lay.stasis / "daemon.pid"))
        self.restart_daemon()

    def ctr(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ctr", "-a", self.info["containerd_address"], "-n", self.info["namespace"], *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def read(self, cid: str, *paths: str) -> str:
        """What `cat paths` prints in the running container `cid` (`ctr tasks exec`). ctr lost
        the output of so short a process once under load (empty stdout, exit 0: its pipes were
        read after the process had ended), so an empty answer is asked again, twice at most:
        a file that is really empty stays empty."""
        for attempt in range(3):
            done = self.ctr("tasks", "exec", "--exec-id", f"cat-{attempt}", cid, "/bin/cat", *paths)
            assert done.returncode == 0, done.stderr
            if done.stdout:
                break
        return done.stdout

    def inside(self, *cmd: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
        """`cmd` run where the node's containerd runs (in its namespaces when separate)."""
        return subprocess.run(
            [*self.info["node_prefix"], *cmd], capture_output=True, text=True, timeout=timeout_s
        )

    def checkpoints(self, label: str) -> list[dict[str, Any]]:
        """The node's checkpoints of `label`, as `stasis checkpoints --json` lists them."""
        r = self.stasis("checkpoints", "--json")
        assert r.returncode == 0, r.stderr
        return [c for c in json.loads(r.stdout) if c["label"] == label]

    def checkpoint_ids(self, label: str) -> list[str]:
        return [str(c["id"]) for c in self.checkpoints(label)]

    def stasis(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [STASIS, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "STASIS_CONFIG": self.info["stasis_config"]},
        )

    def run(
        self,
        cid: str,
        script: str,
        env: dict[str, str] | None = None,
        runtime: str | None = None,
        options: list[str] | None = None,
    ) -> Path:
        """Create and start a container (detached); its log file. `options`: more of `ctr
        run`'s (--cap-add=CAP_X, --annotation=K=V: what a pod spec would give it)."""
        log = self.root / f"{cid}-{time.monotonic_ns()}.log"
        envs = [f"--env={k}={v}" for k, v in (env or {}).items()]
        r = self.ctr(
            "run",
            "-d",
            f"--log-uri=file://{log}",
            f"--runtime={runtime or self.info['runtime']}",
            *envs,
            *(options or []),
            IMAGE,
            cid,
            "/bin/sh",
            "-c",
            script,
        )
        assert r.returncode == 0, r.stderr
        return log

    def status(self, cid: str) -> str | None:
        for line in self.ctr("tasks", "ls").stdout.splitlines()[1:]:
            fields = line.split()
            if fields and fields[0] == cid:
                return fields[-1]
        return None

    def stop(self, cid: str, grace_s: float = 30) -> None:
        """As the kubelet stops a container: TERM, the grace period, then KILL."""
        self.ctr("tasks", "kill", "-s", "SIGTERM", cid, timeout_s=grace_s + 30)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.status(cid) != "STOPPED":
            time.sleep(0.1)
        if self.status(cid) != "STOPPED":
            self.ctr("tasks", "kill", "-s", "SIGKILL", cid)
            # Its exit reaches containerd's task list a moment later (seconds on a busy node).
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.status(cid) != "STOPPED":
                time.sleep(0.1)

    def remove(self, cid: str) -> None:
        self.ctr("tasks", "delete", "-f", cid)
        self.ctr("containers", "delete", cid)

    def run_attached(
        self,
        cid: str,
        script: str,
        env: dict[str, str] | None = None,
        runtime: str | None = None,
        timeout_s: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """`ctr run --rm` in the foreground: its exit code and output are the container's."""
        envs = [f"--env={k}={v}" for k, v in (env or {}).items()]
        return self.ctr(
            "run",
            "--rm",
            f"--runtime={runtime or self.info['runtime']}",
            *envs,
            IMAGE,
            cid,
            "/bin/sh",
            "-c",
            script,
            timeout_s=timeout_s,
        )
