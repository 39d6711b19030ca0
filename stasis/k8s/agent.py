"""`stasis k8s agent`: the node agent, one per node (the chart's DaemonSet).

At its start it puts the stasis runtime on the node (stasis.k8s.shim.install_node, into the
host's root as the pod mounts it) and starts the node's stasis daemon. Then it watches the
Kubernetes API for its node and the pods on it:

- readiness: every `k8s_check_interval_s` it asks the daemon for its check (CRIU, kernel,
  store, its database); while that fails, or the daemon does not answer within twice the
  interval (5 to 30 s), the node carries the taint stasis.dev/not-ready:NoSchedule, which
  comes off when it passes and goes back when it fails again (or the daemon dies; it is
  started again);
- cordon: when the node becomes unschedulable, a leave-running checkpoint of every container
  under stasis on it (what was taken goes into the node's stasis.dev/cordon-checkpoints);
- by hand: a new value of a pod's stasis.dev/checkpoint annotation (`stasis k8s checkpoint
  NS/POD` writes one) is a leave-running checkpoint of the pod's containers, answered by an
  event on the pod (reason StasisCheckpoint, the result in its annotations: kube.answer). The
  agent never writes to pods (that right would be a right to change any pod's image). Which
  requests it answered it keeps in the daemon's state directory (ANSWERED_FILE): an agent
  started again skips them. The daemon holds these requests to its floor (k8s_min_interval_s)
  after a container's last checkpoint: a refusal is the container's answer;
- interval: a pod's stasis.dev/interval annotation sets the seconds between its containers'
  leave-running checkpoints (over their STASIS_INTERVAL; removed: theirs again, else the
  node's `interval` setting), never below the daemon's floor (the k8s_min_interval_s setting);
  `auto`: Young/Daly's from each container's measured checkpoint cost (stasis.k8s.intervals);
  `off` (or 0): none.

Checkpoints at a container's stop need none of this: the runtime takes them (stasis-runc).

Uninstall: the chart's pre-delete hook (`stasis k8s uninstall-nodes`, stasis.k8s.uninstall)
writes a new value into its node's stasis.dev/uninstall annotation; the agent then takes the
runtime off the host (containerd's runtime entry, given back byte for byte, the shim, the
bundle; containerd restarted), takes its taint off the node and puts it on no more, and
answers in stasis.dev/uninstalled. A SIGTERM alone (a rolling update, a node drained) leaves
the runtime where it is: the pods that use it go on being protected while the agent is away.

What the agent remembers of pods is bounded (`MAX_PODS_REMEMBERED`, the oldest forgotten first,
in memory and in its file) and forgotten when a pod is deleted: a tenant who makes pods or
requests without end does not grow the memory or the disk of a process that runs as root on
every node.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stasis.client import Client
from stasis.config import Settings, interval_asked
from stasis.errors import ContainerError, StasisError
from stasis.k8s import kube
from stasis.k8s.uninstall import UNINSTALL_ANNOTATION, UNINSTALLED_ANNOTATION, answered_request
from stasis.wire import ContainerCheckpointReason, ContainerInfo

log = logging.getLogger("stasis.k8s.agent")

# The least time the daemon's check may take before the node counts as not ready (a check
# runs CRIU's and the store's; on a loaded node that takes a few seconds).
_CHECK_TIMEOUT_MIN_S = 5.0
# Pods whose last answered request the agent keeps (in memory and in ANSWERED_FILE).
MAX_PODS_REMEMBERED = 4096
# In the daemon's state directory (the host's, which outlives the agent's pod).
ANSWERED_FILE = "k8s-agent-answered.json"
_ANSWERED_MAX_BYTES = 4 << 20


class Recent(OrderedDict[str, str]):
    """A map that keeps its `limit` most recently set keys."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: str, value: str) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


def pod_key(pod: Any) -> str:
    meta = pod.metadata
    return f"{meta.namespace}/{meta.name}/{getattr(meta, 'uid', None) or ''}"


def _digest(token: str) -> str:
    # A request's value is the tenant's string (up to an annotation's size): kept as a digest.
    return hashlib.sha256(token.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class HostInstall:
    """Where the runtime goes, as host paths (the agent sees the host's root at `root`), and
    the command that makes containerd read its config again."""

    root: Path
    containerd_config: Path = Path("/etc/containerd/config.toml")
    bin_dir: Path = Path("/usr/local/bin")
    # stasis-runc and CRIU with everything they need (stasis.k8s.hostbundle).
    bundle: Path = Path("/usr/local/lib/stasis")
    # What the host's stasis-runc reads: the daemon's socket, the bundle's CRIU, the runc.
    runtime_config: Path = Path("/etc/stasis/runtime.toml")
    restart_containerd: tuple[str, ...] = ()
    # 2 or 3 (containerd 2.x); 0: the config file's own `version` (stasis.k8s.shim).
    containerd_config_version: int = 0

    def on_host(self, path: Path) -> Path:
        return self.root / path.relative_to("/")

    def node_runc(self) -> str:
        for candidate in (
            "/usr/sbin/runc",
            "/usr/bin/runc",
            "/usr/local/sbin/runc",
            "/usr/local/bin/runc",
        ):
            if self.on_host(Path(candidate)).exists():
                return candidate
        raise ContainerError(
            f"no runc on the node (looked in {self.root}/usr/sbin, "
            "/usr/bin, /usr/local/sbin, /usr/local/bin)"
        )


@dataclass
class Agent:
    settings: Settings
    api: Any  # kubernetes.client.CoreV1Api
    node: str
    install: HostInstall | None = None
    start_daemon: bool = True
    taint: tuple[str, str] = (kube.TAINT_KEY, kube.TAINT_EFFECT)
    stop: threading.Event = field(default_factory=threading.Event)
    ready: bool | None = None  # None: not checked yet (the taint is left as it is)
    why_not_ready: str = ""
    _daemon: subprocess.Popen[bytes] | None = None
    _unschedulable: bool | None = None
    _node_obj: Any = None
    remember_pods: int = MAX_PODS_REMEMBERED
    # pod -> the digest of its last request answered (bounded; kept in ANSWERED_FILE too).
    _answered: Recent = field(init=False)
    # container id -> the interval the agent asked for it (the daemon may have raised it).
    _interval_set: dict[str, int | str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Set once the node's uninstall was asked: the taint is never put back, nothing installed.
    uninstalling: bool = False
    _taint_lock: threading.Lock = field(default_factory=threading.Lock)
    _uninstall_seen: str = ""  # the last request taken up (each new one is answered)

    def __post_init__(self) -> None:
        self._answered = Recent(self.remember_pods)
        for key, digest in _read_answered(self.answered_file)[-self.remember_pods :]:
            self._answered.put(key, digest)

    @property
    def answered_file(self) -> Path:
        return self.settings.state_dir / ANSWERED_FILE

    def _keep_answered(self) -> None:
        """Written whole, atomically: at most `remember_pods` short lines."""
        path = self.answered_file
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump({"pods": list(self._answered.items())}, out)
            tmp.replace(path)
        except OSError as e:
            log.warning(
                "cannot keep the requests answered in %s: %s (an agent started "
                "again may run them again, held to the node's floor)",
                path,
                e,
            )

    # -- running ---------------------------------------------------------------------------

    def run(self) -> None:
        """Until `stop` is set (SIGTERM)."""
        if self.install is not None and not self._uninstall_pending():
            install_runtime(self.install, self.settings)
        threads = [
            threading.Thread(target=self._readiness, name="readiness", daemon=True),
            threading.Thread(target=self._watch_node, name="node", daemon=True),
            threading.Thread(target=self._watch_pods, name="pods", daemon=True),
        ]
        for t in threads:
            t.start()
        log.info("agent of node %s running", self.node)
        try:
            self.stop.wait()
        finally:
            self._stop_daemon()

    def _client(self, timeout_s: float | None = 30) -> Client:
        return Client(self.settings.socket, timeout_s=timeout_s)

    def _keep_daemon(self) -> None:
        if not self.start_daemon:
            return
        if self._daemon is not None and self._daemon.poll() is None:
            return
        if self._daemon is not None:
            log.warning("the stasis daemon exited (%s); starting it again", self._daemon.returncode)
        from stasis.daemon.detached import stasis_command

        self._daemon = subprocess.Popen([*stasis_command(), "daemon"])

    def _stop_daemon(self) -> None:
        if self._daemon is not None and self._daemon.poll() is None:
            self._daemon.terminate()
            try:
                self._daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._daemon.kill()

    # -- readiness and the taint -----------------------------------------------------------

    def check(self) -> tuple[bool, str]:
        # A daemon that takes connections but answers none (hung, stopped, its database
        # locked) is not ready either, and is found so within this bound, not the client's
        # 30 s.
        timeout = min(30.0, max(_CHECK_TIMEOUT_MIN_S, 2 * self.settings.k8s_check_interval_s))
        try:
            with self._client(timeout_s=timeout) as c:
                report = c.check()
        except StasisError as e:
            return False, str(e)
        if report["ok"]:
            return True, ""
        problems = "; ".join(f"{p['what']} ({p['fix']})" for p in report["problems"])
        return False, problems or "the daemon's check failed"

    def _readiness(self) -> None:
        while not self.stop.is_set():
            try:
                self._keep_daemon()
                ok, why = self.check()
            except Exception as e:  # never let this thread die: the taint would stay as is
                ok, why = False, f"the agent cannot check the daemon: {type(e).__name__}: {e}"
            with self._lock:
                changed = ok != self.ready or why != self.why_not_ready
                self.ready, self.why_not_ready = ok, why
            if changed:
                if ok:
                    log.info("node %s: stasis is ready", self.node)
                else:
                    log.warning("node %s: stasis is not ready: %s", self.node, why)
            try:
                self._taint()
            except Exception as e:
                log.warning("node %s: cannot set its taint: %s: %s", self.node, type(e).__name__, e)
            self.stop.wait(self.settings.k8s_check_interval_s)

    def _taint(self, node: Any = None) -> None:
        if self.ready is None:
            return
        with self._taint_lock:
            if self.uninstalling:
                return
            try:
                node = node or kube.call(f"read node {self.node}", self.api.read_node, self.node)
                if kube.set_taint(self.api, node, not self.ready, *self.taint):
                    log.info(
                        "node %s: taint %s %s",
                        self.node,
                        self.taint[0],
                        "removed" if self.ready else "put on",
                    )
            except kube.KubeError as e:
                log.warning("node %s: cannot set its taint: %s", self.node, e)

    # -- uninstall -------------------------------------------------------------------------

    def _uninstall_pending(self) -> bool:
        """Whether the node's uninstall was asked and not answered yet (an agent started
        while the chart's hook waits must not install the runtime first)."""
        try:
            node = kube.call(f"read node {self.node}", self.api.read_node, self.node)
        except kube.KubeError as e:
            log.warning("node %s: cannot read it: %s", self.node, e)
            return False
        return self._uninstall_asked(node) is not None

    @staticmethod
    def _uninstall_asked(node: Any) -> str | None:
        ann = kube.annotations_of(node)
        asked = ann.get(UNINSTALL_ANNOTATION)
        if not asked or answered_request(ann.get(UNINSTALLED_ANNOTATION)) == asked:
            return None
        return asked

    def on_uninstall(self, asked: str) -> dict[str, Any]:
        """The chart is being uninstalled: the runtime off the host, the taint off the node,
        the answer on the node (stasis.dev/uninstalled)."""
        log.info("node %s: uninstall asked (%s): taking stasis off the node", self.node, asked)
        with self._taint_lock:
            self.uninstalling = True
        result: dict[str, Any] = {"request": asked}
        errors = []
        if self.install is not None:
            try:
                result["removed"] = remove_runtime(self.install)
            except (StasisError, OSError, subprocess.SubprocessError) as e:
                errors.append(f"cannot take the runtime off the host: {e}")
        try:
            node = kube.call(f"read node {self.node}", self.api.read_node, self.node)
            if kube.set_taint(self.api, node, False, *self.taint):
                log.info("node %s: taint %s removed", self.node, self.taint[0])
        except kube.KubeError as e:
            errors.append(f"cannot take the taint {self.taint[0]} off: {e}")
        if errors:
            result["error"] = "; ".join(errors)
            log.warning("node %s: uninstall: %s", self.node, result["error"])
        try:
            kube.annotate(
                self.api, "node", node_ref(self.node), {UNINSTALLED_ANNOTATION: json.dumps(result)}
            )
        except kube.KubeError as e:
            log.warning("node %s: cannot answer the uninstall: %s", self.node, e)
        return result

    # -- the node: taint kept, cordon ------------------------------------------------------

    def _watch_node(self) -> None:
        for kind, node in kube.watch(
            self.api, self.api.list_node, self.stop, field_selector=f"metadata.name={self.node}"
        ):
            if node.metadata.name != self.node or kind == "DELETED":
                continue
            asked = self._uninstall_asked(node)
            if asked is not None and asked != self._uninstall_seen:
                self._uninstall_seen = asked
                threading.Thread(
                    target=self.on_uninstall, args=(asked,), name="uninstall", daemon=True
                ).start()
            self._taint(node)
            cordoned = bool(node.spec.unschedulable)
            was, self._unschedulable = self._unschedulable, cordoned
            # Only a change is a cordon: a node found cordoned at the agent's start was
            # cordoned before (its containers' stops still checkpoint them).
            if was is False and cordoned:
                threading.Thread(
                    target=self.on_cordon, args=(node,), name="cordon", daemon=True
                ).start()

    def on_cordon(self, node: Any) -> dict[str, Any]:
        log.info("node %s cordoned: checkpointing its containers under stasis", self.node)
        results: dict[str, Any] = {}
        try:
            containers = self._containers()
        except StasisError as e:
            containers = []
            results["error"] = str(e)
        for c in containers:
            results[c["container_id"]] = self._checkpoint(c["container_id"], "cordon")
        done = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "containers": results}
        try:
            kube.annotate(self.api, "node", node, {kube.CORDON_ANNOTATION: json.dumps(done)})
        except kube.KubeError as e:
            log.warning("node %s: cannot record its cordon checkpoints: %s", self.node, e)
        return done

    def _containers(self) -> list[ContainerInfo]:
        with self._client() as c:
            return c.k8s_containers()

    def _checkpoint(self, container_id: str, reason: ContainerCheckpointReason) -> dict[str, Any]:
        try:
            with self._client(timeout_s=None) as c:
                a = c.k8s_checkpoint(container_id, reason=reason)
        except StasisError as e:
            log.warning("checkpoint of container %s (%s) failed: %s", container_id, reason, e)
            return {"error": str(e)}
        return {"checkpoint": a["checkpoint"], "label": a["label"]}

    # -- pods: by hand, intervals ----------------------------------------------------------

    def _watch_pods(self) -> None:
        for kind, pod in kube.watch(
            self.api,
            self.api.list_pod_for_all_namespaces,
            self.stop,
            field_selector=f"spec.nodeName={self.node}",
        ):
            if kind == "DELETED":
                self.forget_pod(pod)
                continue
            if getattr(pod.spec, "node_name", None) != self.node:
                continue
            try:
                self.on_pod(pod)
            except StasisError as e:
                log.warning("pod %s/%s: %s", pod.metadata.namespace, pod.metadata.name, e)

    def forget_pod(self, pod: Any) -> None:
        """A deleted pod: nothing of it is kept."""
        self._answered.pop(pod_key(pod), None)
        for cid in kube.container_ids(pod).values():
            self._interval_set.pop(cid, None)

    def on_pod(self, pod: Any) -> None:
        ann = kube.annotations_of(pod)
        ids = kube.container_ids(pod)
        asked = ann.get(kube.CHECKPOINT_ANNOTATION)
        # Answered: by this agent or one before it on this node (ANSWERED_FILE), or by an
        # agent of stasis 0.1.0 (in the pod's annotations).
        wants_checkpoint = (
            bool(asked)
            and asked != ann.get(kube.CHECKPOINTED_ANNOTATION)
            and self._answered.get(pod_key(pod)) != _digest(asked or "")
        )
        if (
            not wants_checkpoint
            and kube.INTERVAL_ANNOTATION not in ann
            and not set(self._interval_set).intersection(ids.values())
        ):
            return  # the common case: nothing asked of this pod (no call to the daemon)
        ours = {c["container_id"]: c for c in self._containers()}
        # Containers the daemon no longer has (their pods gone while the agent was away).
        for cid in set(self._interval_set) - set(ours):
            del self._interval_set[cid]
        self._intervals(pod, ann, ids, ours)
        if wants_checkpoint:
            assert asked is not None
            self._checkpoint_pod(pod, asked, ids, ours)

    def _checkpoint_pod(
        self, pod: Any, asked: str, ids: dict[str, str], ours: dict[str, ContainerInfo]
    ) -> None:
        name = f"{pod.metadata.namespace}/{pod.metadata.name}"
        result: dict[str, Any] = {"containers": {}}
        for container, cid in sorted(ids.items()):
            if cid in ours:
                # Held to the node's floor by the daemon: the pod's owner asks for it.
                result["containers"][container] = self._checkpoint(cid, "annotation")
        if not result["containers"]:
            result["error"] = (
                f"no container of pod {name} is under stasis on node "
                f"{self.node} (runtimeClassName: stasis and STASIS_CHECKPOINT "
                "on the container)"
            )
        log.info("pod %s: checkpoint asked (%s): %s", name, asked[:80], json.dumps(result))
        self._answered.put(pod_key(pod), _digest(asked))
        self._keep_answered()
        kube.answer(self.api, pod, asked, result, _said(result), self.node)

    def _intervals(
        self, pod: Any, ann: dict[str, str], ids: dict[str, str], ours: dict[str, ContainerInfo]
    ) -> None:
        raw = ann.get(kube.INTERVAL_ANNOTATION)
        wanted: int | str | None = None  # seconds, "auto", or None: the container's own
        if raw is not None:
            asked, _ = interval_asked(raw)  # off (or 0): none, whatever the node's default
            if asked == "auto":
                wanted = "auto"
            elif asked == "off":
                wanted = 0
            elif asked is not None and float(asked).is_integer():
                wanted = int(float(asked))
            else:
                log.warning(
                    "pod %s/%s: %s=%r is neither a whole number of seconds, auto nor off; "
                    "ignored",
                    pod.metadata.namespace,
                    pod.metadata.name,
                    kube.INTERVAL_ANNOTATION,
                    raw,
                )
                return
        for cid in ids.values():
            info = ours.get(cid)
            if info is None:
                continue
            # What the container has now, as the annotation would say it.
            has: int | str = "auto" if info.get("interval_auto") else info["interval_s"]
            # Asked once per value: the daemon raises an interval below its floor, so the
            # container's may differ from the annotation's for good.
            if (
                wanted is not None
                and self._interval_set.get(cid) != wanted
                and (cid in self._interval_set or has != wanted)
            ):
                self._set_interval(cid, wanted)
                self._interval_set[cid] = wanted
            elif wanted is None and cid in self._interval_set:
                self._set_interval(cid, None)
                del self._interval_set[cid]

    def _set_interval(self, container_id: str, seconds: int | str | None) -> None:
        with self._client() as c:
            if seconds == "auto":
                c.k8s_interval(container_id, None, auto=True)
            else:
                c.k8s_interval(container_id, seconds if isinstance(seconds, int) else None)
        log.info(
            "container %s: checkpoint interval %s",
            container_id,
            "its own STASIS_INTERVAL"
            if seconds is None
            else f"{seconds}" + ("" if seconds == "auto" else " s"),
        )


def _said(result: dict[str, Any]) -> str:
    """The answer in words, as `kubectl describe pod` shows it: a line per container."""
    if result.get("error"):
        return str(result["error"])
    return "; ".join(
        f"container {c}: "
        + (r["error"] if "error" in r else f"checkpoint {r['checkpoint']} (label {r['label']})")
        for c, r in sorted(result["containers"].items())
    )


def _read_answered(path: Path) -> list[tuple[str, str]]:
    """What an earlier agent kept; nothing when it is missing, too large or not its own."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_size > _ANSWERED_MAX_BYTES:
            log.warning(
                "%s is not this agent's or too large (owner %d, %d bytes): ignored",
                path,
                st.st_uid,
                st.st_size,
            )
            return []
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = json.loads(f.read(_ANSWERED_MAX_BYTES))
        pods = data["pods"]
        if not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pods
        ):
            raise ValueError("not a list of [pod, request digest] pairs")
        return [(k, v) for k, v in pods]
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("cannot read the requests answered from %s: %s; ignored", path, e)
        return []
    finally:
        if fd >= 0:
            os.close(fd)


def node_ref(name: str) -> Any:
    """Enough of a node object for kube.annotate."""
    from types import SimpleNamespace

    return SimpleNamespace(metadata=SimpleNamespace(name=name))


def install_runtime(where: HostInstall, settings: Settings) -> list[str]:
    """The stasis runtime on the host; containerd restarted when its config was changed."""
    from stasis.engine.criu import find_criu
    from stasis.k8s import hostbundle, shim

    runc = where.node_runc()
    changes = []
    if hostbundle.install(
        where.on_host(where.bundle), Path(find_criu(settings.criu)), seen_as=where.bundle
    ):
        changes.append(f"install stasis-runc and CRIU into {where.bundle}")
    config = where.on_host(where.runtime_config)
    config.parent.mkdir(parents=True, exist_ok=True)
    q = json.dumps  # TOML basic strings
    tmp = config.with_name(config.name + ".tmp")
    tmp.write_text(
        f"socket = {q(str(settings.socket))}\n"
        f"criu = {q(str(where.bundle / 'bin' / 'criu'))}\n"
        f"runc = {q(runc)}\n"
    )
    tmp.replace(config)
    changes += shim.install_node(
        where.on_host(where.containerd_config),
        where.on_host(where.bin_dir),
        where.runtime_config,
        wrapper=str(where.bundle / "bin" / "stasis-runc"),
        node_runc=runc,
        seen_as=where.bin_dir,
        config_version=where.containerd_config_version,
    )
    for change in changes:
        log.info("host: %s", change)
    _restart_containerd(where, changes)
    return changes


def remove_runtime(where: HostInstall) -> list[str]:
    """What install_runtime put on the host, taken off: containerd's config as it was before
    (byte for byte; containerd restarted), the shim, the bundle, the runtime's config. The
    daemon's state (<state_dir>: its database, the node key, a local store) stays."""
    import shutil

    from stasis.k8s import shim

    changes = shim.uninstall_node(
        where.on_host(where.containerd_config), where.on_host(where.bin_dir)
    )
    bundle = where.on_host(where.bundle)
    for leftover in (
        bundle.with_name(bundle.name + ".new"),
        bundle.with_name(bundle.name + ".old"),
    ):
        shutil.rmtree(leftover, ignore_errors=True)
    if bundle.is_dir() and not bundle.is_symlink():
        shutil.rmtree(bundle)
        changes.append(f"remove {where.bundle}")
    config = where.on_host(where.runtime_config)
    if config.exists() or config.is_symlink():
        config.unlink()
        changes.append(f"remove {where.runtime_config}")
        try:
            config.parent.rmdir()  # /etc/stasis, when nothing else is in it
        except OSError:
            pass
    for change in changes:
        log.info("host: %s", change)
    _restart_containerd(where, changes)
    return changes


def _restart_containerd(where: HostInstall, changes: list[str]) -> None:
    if not where.restart_containerd or not any("runtime entry" in c for c in changes):
        return
    done = subprocess.run(
        list(where.restart_containerd), capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise ContainerError(
            f"restarting containerd ({' '.join(where.restart_containerd)}) "
            f"failed: {done.stderr.strip() or done.returncode}"
        )
    changes.append("restart containerd")
    log.info("host: containerd restarted")
