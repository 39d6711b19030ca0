"""runc, as stasis drives it: a container's bundle read for what stasis needs, and the runc
commands a checkpoint and a restore take (runc itself drives CRIU for containers: it knows
their mounts, namespaces and cgroups)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from stasis.config import interval_asked
from stasis.errors import ContainerError, UsageError

# The runtime's own names: what a container opts in with (Cedana's name is accepted too).
LABEL_VARIABLES = ("STASIS_CHECKPOINT", "CEDANA_CHECKPOINT")
INTERVAL_VARIABLE = "STASIS_INTERVAL"
# CRI's annotations on a container's bundle: the Kubernetes namespace and pod it belongs to.
_NS_ANNOTATION = "io.kubernetes.cri.sandbox-namespace"
_POD_ANNOTATION = "io.kubernetes.cri.sandbox-name"
_NAME_ANNOTATION = "io.kubernetes.cri.container-name"

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,1023}$")
# The owner uid a namespace's checkpoints are stored under: above 2**32 - 1, the kernel's
# largest uid_t, so that no account of any node (/etc/passwd, LDAP, subuid ranges, user
# namespaces) can ever be it: no local user lists or restores a namespace's checkpoints through
# the daemon's socket (SO_PEERCRED gives a 32-bit uid). A namespace never shares a label with
# another either (also checked by name on every restore).
NAMESPACE_UID_BASE = 1 << 32
# Before this release namespaces had uids in [2**30, 2**31 - 1): real uids could be those. Kept only
# to find a namespace's older checkpoints at restore (their namespace is checked by name).
_LEGACY_UID_BASE = 0x40000000


# In a container's bundle (containerd's directory, out of the container's reach): a stop was
# asked of it (the kubelet's SIGTERM, or its SIGKILL at the grace period's end). Its end is then
# never a success that retires its label, whatever its exit status (containers.ended).
STOP_MARKER = "stasis-stop-asked"


def mark_stop_asked(bundle: Path) -> None:
    try:
        fd = os.open(bundle / STOP_MARKER, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        os.close(fd)
    except OSError:
        pass  # the bundle is gone: so is the container, and `ended` keeps its label then


def validate_container_id(container_id: str) -> str:
    if not isinstance(container_id, str) or not _ID_RE.fullmatch(container_id):
        raise UsageError(f"invalid container id {container_id!r}")
    return container_id


def validate_abs_path(path: str, what: str) -> Path:
    p = Path(path)
    if not p.is_absolute() or ".." in p.parts or "\x00" in path:
        raise UsageError(f"invalid {what} {path!r}: expected an absolute path without '..'")
    return p


def namespace_uid(namespace: str) -> int:
    """The owner uid of namespace `namespace`'s checkpoints: never a kernel uid (>= 2**32)."""
    digest = hashlib.sha256(namespace.encode()).digest()
    return NAMESPACE_UID_BASE + int.from_bytes(digest[:4], "big") % 0x80000000


def legacy_namespace_uid(namespace: str) -> int:
    """The uid older stasis stored a namespace's checkpoints under (a real uid could be it)."""
    digest = hashlib.sha256(namespace.encode()).digest()
    return _LEGACY_UID_BASE + int.from_bytes(digest[:4], "big") % 0x3FFFFFFF


@dataclass(frozen=True)
class Bundle:
    """What stasis reads of a container's OCI bundle (its config.json)."""

    path: Path
    container_id: str
    label: str | None  # None: not opted in; the container is runc's alone
    namespace: str  # Kubernetes namespace (CRI annotation), else containerd's namespace
    pod: str | None
    name: str | None
    interval_s: int
    args: list[str]
    cwd: str
    rootfs: Path
    interval_auto: bool = False  # STASIS_INTERVAL=auto: Young/Daly's (stasis.k8s.intervals)
    # No STASIS_INTERVAL (or one that means nothing): the node's `interval` setting applies.
    interval_default: bool = False

    @property
    def uid(self) -> int:
        return namespace_uid(self.namespace)


def read_bundle(path: Path, container_id: str) -> Bundle:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ContainerError(
            f"cannot read the bundle of container {container_id} " f"({path}/config.json): {e}"
        ) from e
    process = config.get("process") or {}
    env = dict(item.split("=", 1) for item in process.get("env") or [] if "=" in item)
    label = next((env[v] for v in LABEL_VARIABLES if env.get(v)), None)
    asked, _ = interval_asked(env.get(INTERVAL_VARIABLE) or "")
    auto = asked == "auto"
    try:
        interval = 0 if auto else int(env.get(INTERVAL_VARIABLE) or 0)
    except ValueError:
        interval = 0
    annotations = config.get("annotations") or {}
    # The bundle of containerd's shim is <state>/io.containerd.runtime.v2.task/<namespace>/<id>.
    namespace = annotations.get(_NS_ANNOTATION) or path.parent.name
    root = Path((config.get("root") or {}).get("path") or "rootfs")
    return Bundle(
        path=path,
        container_id=container_id,
        label=label,
        namespace=namespace,
        pod=annotations.get(_POD_ANNOTATION),
        name=annotations.get(_NAME_ANNOTATION),
        interval_s=max(0, interval),
        args=list(process.get("args") or []),
        cwd=process.get("cwd") or "/",
        rootfs=root if root.is_absolute() else path / root,
        interval_auto=auto,
        interval_default=asked is None,
    )


def real_runc(configured: str) -> str:
    """The runc binary: the configured one, else the first `runc` on PATH that is not ours."""
    if configured:
        return configured
    for candidate in ("/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc"):
        if Path(candidate).exists():
            return candidate
    found = shutil.which("runc")
    if not found:
        raise ContainerError(
            "runc is not installed: install it (apt-get install runc) or set "
            "`runc` in the stasis config"
        )
    return found


class Runc:
    """runc with the `--root` of the shim that runs the container, and our CRIU."""

    def __init__(self, binary: str, root: Path, criu: str) -> None:
        self.binary = binary
        self.root = root
        self.criu = criu

    def argv(self, *args: str) -> list[str]:
        return [self.binary, "--root", str(self.root), "--criu", self.criu, *args]

    def run(self, *args: str, timeout_s: float = 60.0) -> str:
        try:
            r = subprocess.run(
                self.argv(*args),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as e:
            raise ContainerError(f"runc {args[0]} did not finish in {timeout_s:.0f} s") from e
        except OSError as e:
            raise ContainerError(f"cannot run {self.binary}: {e}") from e
        if r.returncode != 0:
            raise ContainerError(f"runc {args[0]} failed: {_runc_message(r.stderr or r.stdout)}")
        return r.stdout

    def state(self, container_id: str) -> dict[str, object]:
        out = self.run("state", container_id, timeout_s=10)
        try:
            state: dict[str, object] = json.loads(out)
        except ValueError as e:
            raise ContainerError(f"runc state {container_id}: unexpected output {out!r}") from e
        return state

    def checkpoint(self, container_id: str, images: Path, work: Path, timeout_s: float) -> None:
        """Dump the container, which stays as it was (paused: `pause` it first)."""
        self.run(
            "checkpoint",
            "--leave-running",
            "--image-path",
            str(images),
            "--work-path",
            str(work),
            container_id,
            timeout_s=timeout_s,
        )

    def restore_argv(
        self,
        container_id: str,
        bundle: Path,
        images: Path,
        work: Path,
        pid_file: str | None,
        console_socket: str | None,
        no_pivot: bool,
    ) -> list[str]:
        args = [
            "restore",
            "--detach",
            "--image-path",
            str(images),
            "--work-path",
            str(work),
            "--bundle",
            str(bundle),
        ]
        if pid_file:
            args += ["--pid-file", pid_file]
        if console_socket:
            args += ["--console-socket", console_socket]
        if no_pivot:
            args.append("--no-pivot")
        return self.argv(*args, container_id)


def _runc_message(text: str) -> str:
    """The message of runc's last error line (`time=.. level=error msg="..."`), else the text."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        m = re.search(r'msg="((?:[^"\\]|\\.)*)"', line)
        if m:
            return m.group(1).replace('\\"', '"')
    return lines[-1] if lines else "no output"
