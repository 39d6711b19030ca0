"""`stasis-dev local-node up|down --dir D`: a private containerd with the stasis runtime
installed as the node agent installs it (stasis.k8s.shim), and a stasis daemon for it.

    D/containerd/   config.toml, root, state, containerd.sock, containerd.log
    D/bin/          containerd-shim-stasis-v2, runc-wrapper/runc (first on containerd's PATH)
    D/stasis/       config.toml, daemon socket, state, checkpoint store, daemon log
    D/runtime/      with --bundle: stasis-runc and CRIU as the node agent puts them on a host

Containers are started with `ctr -a D/containerd/containerd.sock -n stasis run --runtime
io.containerd.stasis.v2 ...`. Nothing outside D is touched, except runc's state under
/run/containerd/runc/<namespace> (the shim puts it there) and the mounts of running containers.

With `separate` (`--separate`) the node is a host of its own (stasis.dev.nodehost): containerd, the
daemon, the shims, runc, CRIU and the containers run in the node's own mount and UTS namespaces,
with fresh /tmp, /var/tmp, /dev/shm and /run (runc's state, CRIU's cache /run/stasis-criu), D,
this Python and the stasis package bound back, the node's name as host name, and a network
namespace of its own with an address on the local nodes' bridge (`LOCAL_NET`: 10.213.252.0/24,
this machine .254; made by the first such node, removed with the last). The machine's cgroups
stay shared (container ids must still differ between two local nodes). D/node.holder holds the
pid of the process that keeps the namespaces, D/node.address the node's address; `node_prefix`
runs a command inside them (`runc --root /run/containerd/runc/stasis ...`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stasis.daemon import detached
from stasis.dev import nodehost
from stasis.errors import ContainerError, UsageError
from stasis.k8s import shim

NAMESPACE = "stasis"
# The network separate local nodes share (the local Slurm clusters take theirs from 20..219,
# test sessions' nodes 220..251).
LOCAL_NET = nodehost.Net(252)


@dataclass(frozen=True)
class K8sNodeDirs:
    """Where a local node keeps what (the tree in this module's docstring)."""

    root: Path

    @property
    def containerd(self) -> Path:
        return self.root / "containerd"

    @property
    def address(self) -> Path:
        return self.containerd / "containerd.sock"

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def stasis(self) -> Path:
        return self.root / "stasis"

    @property
    def stasis_config(self) -> Path:
        return self.stasis / "config.toml"

    @property
    def stasis_socket(self) -> Path:
        return self.stasis / "stasis.sock"

    @property
    def holder_file(self) -> Path:
        """With --separate: the pid of the process holding the node's namespaces."""
        return self.root / "node.holder"

    @property
    def address_file(self) -> Path:
        """With --separate: the node's address on LOCAL_NET."""
        return self.root / "node.address"

    def describe(self) -> dict[str, Any]:
        return {
            "containerd_address": str(self.address),
            "runtime": shim.RUNTIME_TYPE,
            "namespace": NAMESPACE,
            "stasis_socket": str(self.stasis_socket),
            "stasis_config": str(self.stasis_config),
            "dir": str(self.root),
            "node_prefix": node_prefix(self),
            "address": _address(self),
        }


def _address(lay: K8sNodeDirs) -> str | None:
    try:
        return lay.address_file.read_text().strip() or None
    except OSError:
        return None


def _holder(lay: K8sNodeDirs) -> int | None:
    pid = detached.read_pid(lay.holder_file)
    return pid if detached.alive(pid) else None


def node_prefix(lay: K8sNodeDirs) -> list[str]:
    """How to run a command inside the node (nothing unless it was made --separate)."""
    if not lay.holder_file.exists():
        return []
    holder = _holder(lay)
    if holder is None:
        raise ContainerError(
            f"the local node in {lay.root} has lost its namespaces (their "
            "holder process is gone): `stasis-dev local-node down`, then `up` "
            "again"
        )
    return nodehost.prefix(holder)


def _q(value: str) -> str:
    return json.dumps(value)  # a TOML basic string


def containerd_config(lay: K8sNodeDirs) -> str:
    c = lay.containerd
    return (
        "version = 2\n"
        f"root = {_q(str(c / 'root'))}\n"
        f"state = {_q(str(c / 'state'))}\n"
        # No kubelet talks CRI here; the runtime entry is written as on a node all the same.
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        "[grpc]\n"
        f"  address = {_q(str(lay.address))}\n"
        "[ttrpc]\n"
        f"  address = {_q(str(lay.address) + '.ttrpc')}\n"
        "[debug]\n"
        f"  address = {_q(str(c / 'debug.sock'))}\n" + shim.cri_runtime_entry()
    )


def up(
    root: Path,
    store: str = "",
    bundle: bool = False,
    kubeconfig: str = "",
    node_name: str = "",
    min_interval_s: int | None = None,
    separate: bool = False,
) -> K8sNodeDirs:
    """`bundle`: stasis-runc and CRIU run from a host bundle (stasis.k8s.hostbundle, in
    D/runtime), as on a node the agent installed, instead of from this venv. `kubeconfig` and
    `node_name`: the Kubernetes API and the node in it the daemon drains (none: no drain).
    `min_interval_s`: the floor on containers' checkpoint intervals (default: the daemon's).
    `separate`: a host of its own (the module's docstring), its host name `node_name` or D's
    name."""
    if separate and kubeconfig:
        _check_reachable(Path(kubeconfig))
    if os.geteuid() != 0:
        raise UsageError("local-node up must run as root (it starts containerd)")
    for tool in ("containerd", "ctr", "containerd-shim-runc-v2", "runc"):
        if not shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin:/usr/local/bin"):
            raise UsageError(
                f"{tool} is not installed; run `make install` " "(scripts/install-containers.sh)"
            )
    lay = K8sNodeDirs(root.absolute())
    if detached.alive(detached.read_pid(lay.containerd / "containerd.pid")):
        raise UsageError(
            f"a local node is already running in {lay.root}; " "`stasis-dev local-node down` first"
        )
    for d in (lay.root, lay.containerd, lay.bin, lay.stasis):
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
    wrapper = None
    config = (
        f"socket = {_q(str(lay.stasis_socket))}\n"
        f"state_dir = {_q(str(lay.stasis / 'state'))}\n"
        f"store = {_q(store or str(lay.stasis / 'store'))}\n"
        f"containerd_address = {_q(str(lay.address))}\n"
    )
    if kubeconfig:
        config += f"kubeconfig = {_q(str(Path(kubeconfig).absolute()))}\n"
    if node_name:
        config += f"node_name = {_q(node_name)}\n"
    if min_interval_s is not None:
        config += f"k8s_min_interval_s = {int(min_interval_s)}\n"
    if bundle:
        from stasis.engine.criu import find_criu
        from stasis.k8s import hostbundle

        hostbundle.install(lay.root / "runtime", Path(find_criu()))
        wrapper = str(lay.root / "runtime" / "bin" / "stasis-runc")
        config += f"criu = {_q(str(lay.root / 'runtime' / 'bin' / 'criu'))}\n"
    lay.stasis_config.write_text(config)
    shim.install(lay.bin, lay.stasis_config, wrapper=wrapper)
    (lay.containerd / "config.toml").write_text(containerd_config(lay))
    env = _env(lay)
    stale = _holder(lay)
    if stale is not None:  # namespaces of an earlier `up` whose node is gone
        nodehost.end_holder(stale)
    lay.holder_file.unlink(missing_ok=True)
    lay.address_file.unlink(missing_ok=True)
    try:
        if separate:
            holder = nodehost.start_holder(
                node_name or lay.root.name, lay.holder_file, _shared_paths(lay, store)
            )
            lay.address_file.write_text(nodehost.join_net(LOCAL_NET, holder) + "\n")
        clog = lay.containerd / "containerd.log"
        pid = detached.start(
            [*node_prefix(lay), "containerd", "--config", str(lay.containerd / "config.toml")],
            lay.containerd / "containerd.pid",
            clog,
            env,
        )
        detached.wait_listening(
            pid,
            lay.address,
            clog,
            20,
            lambda why: ContainerError(f"containerd did not start: {why}"),
        )
        # After containerd, as on a node: the daemon follows its events from the start (one
        # started first looks for containerd's socket again only 5 s later, and a container
        # that ended meanwhile went unseen).
        start_daemon(lay)
    except BaseException:
        down(lay.root)
        raise
    return lay


def _check_reachable(kubeconfig: Path) -> None:
    """A separate node has a network of its own: an API on this machine's loopback is not on it."""
    try:
        text = kubeconfig.read_text()
    except OSError as e:
        raise UsageError(f"--kubeconfig {kubeconfig}: cannot read it ({e.strerror})") from e
    for match in re.finditer(r"^\s*server:\s*['\"]?(\S+?)['\"]?\s*$", text, re.M):
        host = urllib.parse.urlsplit(match.group(1)).hostname or ""
        if host == "localhost" or _loopback(host):
            raise UsageError(
                f"--separate: the node has a network of its own, where the Kubernetes API at "
                f"{match.group(1)} (this machine's loopback) cannot be reached; serve it on "
                f"{LOCAL_NET.host_addr} (this machine on the nodes' network), or leave out "
                "--separate"
            )


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _shared_paths(lay: K8sNodeDirs, store: str) -> list[str]:
    """What stays visible inside a separate node where it lies under a private directory (a
    node made in /tmp, a test root's venv in /tmp): D, a store given as a path, this Python and
    the stasis package; what a real site shares with its nodes."""
    package = Path(__file__).resolve().parents[1]
    paths = {str(lay.root), sys.prefix, sys.base_prefix, str(package.parent)}
    if store.startswith("/"):
        paths.add(store)
    return sorted(paths)


def _env(lay: K8sNodeDirs) -> dict[str, str]:
    return {
        "PATH": f"{lay.bin}:" + os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "LANG": "C.UTF-8",
        "STASIS_CONFIG": str(lay.stasis_config),
    }


def start_daemon(lay: K8sNodeDirs) -> None:
    """Start the node's stasis daemon (again, after it was stopped)."""
    log = lay.stasis / "daemon.log"
    pid = detached.start(
        [*node_prefix(lay), *detached.stasis_command(), "daemon"],
        lay.stasis / "daemon.pid",
        log,
        _env(lay),
    )
    detached.wait_listening(
        pid,
        lay.stasis_socket,
        log,
        20,
        lambda why: ContainerError(f"the stasis daemon did not start: {why}"),
    )


def _ctr(lay: K8sNodeDirs, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ctr", "-a", str(lay.address), "-n", NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def down(root: Path) -> None:
    """Kill and delete every container, stop containerd and the daemon. D stays (logs)."""
    lay = K8sNodeDirs(root.absolute())
    cpid = detached.read_pid(lay.containerd / "containerd.pid")
    if detached.alive(cpid):
        for task in _ctr(lay, "tasks", "ls", "-q").stdout.split():
            _ctr(lay, "tasks", "delete", "-f", task)  # -f: SIGKILL first
        for c in _ctr(lay, "containers", "ls", "-q").stdout.split():
            _ctr(lay, "containers", "delete", c)
    detached.stop(cpid)
    detached.stop(detached.read_pid(lay.stasis / "daemon.pid"))
    holder = _holder(lay)
    if holder is not None:
        # The node's mounts (containers' root file systems), /run and /tmp, its network and
        # address go with it once the last process in its namespaces has ended.
        nodehost.end_holder(holder)
    if lay.holder_file.exists():
        nodehost.leave_net(LOCAL_NET)
    lay.holder_file.unlink(missing_ok=True)
    lay.address_file.unlink(missing_ok=True)
    _unmount_under(lay.root)


def _unmount_under(root: Path) -> None:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return
    points = [line.split(" ")[4] for line in lines]
    prefix = str(root) + "/"
    for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
