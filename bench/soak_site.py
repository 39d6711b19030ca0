"""The site bench/soak.py torments: an S3 server behind a cutting proxy, a control plane, two
node daemons sharing the store and a site key; each part a real process that can be SIGKILLed,
stalled or cut off, and started again as an operator would."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stasis.engine import proctree
from tests.conftest import STASIS, Daemon, ensure_test_user
from tests.controlplane.conftest import ControlPlane
from tests.faultproxy import CutProxy
from tests.faults.kit import stopped
from tests.s3server import S3Server

ROOT = Path(__file__).resolve().parent.parent
COUNTER = Path(__file__).resolve().parent / "workloads" / "soak_counter.py"
# A point's name as the code spells it: faults.point("a.b"), or handed on (point=f"a.{mode}.b").
POINT = re.compile(r"""(?:faults\.point\(|\bpoint=)\s*f?["']([A-Za-z0-9_.:{}-]+)["']""")
PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
# Points on paths the soak does not take (no Slurm, no Kubernetes here).
ELSEWHERE = ("slurm.", "k8s.", "runtime.")


def fault_points(src: Path = ROOT / "stasis") -> dict[str, tuple[str, list[str]]]:
    """The named fault points in the code as it is (stasis/faults.py), read from its source: each
    with the process it is in ("controlplane": the server; "daemon": a node's daemon, its
    control-plane agent included) and the names to arm. A name made from a template
    (restore.{mode}.recorded) is one point, "restore.*.recorded", armed in every mode: the step
    is the same, and the soak does not choose the mode a restore takes."""
    found: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(src.rglob("*.py")):
        area = path.relative_to(src).parts[0]
        if area in ("slurm", "k8s"):
            continue
        where = "controlplane" if area == "controlplane" and path.name != "node.py" else "daemon"
        text = path.read_text(errors="replace")
        for template in POINT.findall(text):
            names = [n for n in _expand(template, text) if not n.startswith(ELSEWHERE)]
            if names:
                found[PLACEHOLDER.sub("*", template)] = (where, names)
    return dict(sorted(found.items()))


def _expand(template: str, text: str) -> list[str]:
    """`template`'s names: each {var} replaced by every literal the file assigns to var
    (restore.{mode}.recorded: mode = "fetched", "inplace", ...)."""
    names = [template]
    for var in PLACEHOLDER.findall(template):
        values = sorted(set(re.findall(rf"\b{var}\s*=\s*[\"']([A-Za-z0-9_-]+)[\"']", text)))
        names = [n.replace("{" + var + "}", v) for n in names for v in values]
    return [n for n in names if "{" not in n]


def points_for(action: str, points: dict[str, tuple[str, list[str]]]) -> list[str]:
    """The points `action` may reach, by their names (all of them when none names it)."""
    words = {
        "dump-leave": ("dump", "checkpoint", "publish", "criu", "freeze"),
        "dump-stop": ("dump", "checkpoint", "publish", "criu", "freeze", "stop"),
        "restore-label": ("restore",),
        "kill-job": ("kill",),
        "migrate": (
            "dump",
            "checkpoint",
            "publish",
            "criu",
            "restore",
            "lease",
            "command",
            "migrat",
            "cp.",
            "controlplane.",
        ),
    }[action]
    # A node's control-plane agent (cp.*) only acts on the control plane's commands.
    mine = [p for p in points if action == "migrate" or not p.startswith("cp.")]
    fit = [p for p in mine if any(w in p for w in words)]
    return fit or mine or list(points)


def counter_pids(marker: str) -> list[int]:
    """The soak's counters (whose label starts with `marker`), by their command line."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (
                len(argv) > 2
                and argv[-2 if argv[-1] == b"" else -1].startswith(marker.encode())
                and any(a.endswith(b"soak_counter.py") for a in argv)
            ):
                found.append(int(name))
    return found


class Site:
    def __init__(self, root: Path, s3: bool, nodes: Iterable[str]) -> None:
        self.root = root
        self.s3: S3Server | None = S3Server(root / "s3") if s3 else None
        self.proxy: CutProxy | None = None
        self.names = list(nodes)
        self.nodes: dict[str, Daemon] = {}
        self.cp = ControlPlane(root / "cp", str(root / "cp" / "controlplane.db"))
        self._stall: threading.Timer | None = None
        self._stall_lock = threading.Lock()
        self._stalled = False
        self.cp_armed = False
        # In every label, hence on every counter's command line: strays are found by it.
        self.marker = f"soak{os.getpid()}"

    # -- start and stop ---------------------------------------------------------------------

    def start(self) -> None:
        ensure_test_user()  # the daemons' socket group
        env: dict[str, str] = {}
        store = str(self.root / "store")
        if self.s3 is not None:
            self.s3.start()
            bucket = self.s3.make_bucket("soak")
            self.proxy = CutProxy(("127.0.0.1", self.s3.port))
            env = self.s3.env(AWS_ENDPOINT_URL=self.proxy.endpoint)
            store = f"s3://{bucket}/ckpt"
        else:
            Path(store).mkdir()
        key = self.root / "site.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32))
        os.close(fd)
        (self.root / "cp").mkdir()
        # A lease short enough that a command whose node died is leased again within the soak's
        # settle time; nodes lost after 3 s (the control plane's test setting).
        self.cp.start("--command-lease", "5")
        cluster = self.cp.json("clusters", "add", "soak", "--kind", "slurm")
        for name in self.names:
            node_root = self.root / name
            node_root.mkdir()
            os.chmod(node_root, 0o755)
            d = Daemon(
                node_root,
                store=store,
                keep=3,
                env={
                    **env,
                    "STASIS_CONTROLPLANE_URL": self.cp.url,
                    "STASIS_CLUSTER_ID": cluster["cluster_id"],
                    "STASIS_AUTH_TOKEN": cluster["token"],
                    "STASIS_NODE_NAME": name,
                    "STASIS_CONTROLPLANE_HEARTBEAT_S": "0.5",
                    "STASIS_SITE_KEY": str(key),
                    "STASIS_TEST_FAULT_POINTS": "",
                },
            )
            d.start()
            self.nodes[name] = d

    def stop(self) -> None:
        try:
            self.heal()
        except (AssertionError, OSError) as e:  # a daemon that will not start: its jobs below
            print(f"soak: site not healed at the end: {e}")
        for name, d in self.nodes.items():
            if d.proc is not None and d.proc.poll() is None:
                for j in self.ps(name):
                    if j["state"] in ("running", "restored", "restoring"):
                        self.cli(name, "kill", "--timeout", "0", j["job"])
                d.stop()
        self.cp.stop()
        for pid in counter_pids(self.marker):
            self.kill_pid(pid)
        if self.proxy is not None:
            self.proxy.close()
        if self.s3 is not None:
            self.s3.stop()

    # -- the CLI -----------------------------------------------------------------------------

    def cli_env(self, node: str) -> dict[str, str]:
        return self.nodes[node].env

    def cli_argv(self, node: str, *args: str) -> list[str]:
        return [STASIS, *args]

    def cli(
        self, node: str, *args: str, timeout_s: float = 120
    ) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [STASIS, *args],
                env=self.cli_env(node),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(
                [STASIS, *args], 124, "", f"timed out after {timeout_s} s"
            )

    def json(self, node: str, *args: str) -> Any:
        r = self.cli(node, args[0], "--json", *args[1:], timeout_s=30)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def ps(self, node: str) -> list[dict[str, Any]]:
        return list(self.json(node, "ps") or [])

    def logs(self, node: str, job: str) -> str:
        r = self.cli(node, "logs", job, timeout_s=30)
        return r.stdout if r.returncode == 0 else ""

    def checkpoints(self, node: str, label: str) -> list[dict[str, Any]]:
        return list(self.json(node, "checkpoints", "--label", label) or [])

    def run_job(self, node: str, label: str, interval: float) -> str:
        r = self.cli(
            node,
            "run",
            "--json",
            "--label",
            label,
            "--",
            "python3",
            "-u",
            str(COUNTER),
            str(interval),
            label,
        )
        if r.returncode != 0:
            raise RuntimeError(f"stasis run on {node} failed: {r.stderr}")
        return str(json.loads(r.stdout)["job"])

    def cp_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "STASIS_CONFIG": "",
            "STASIS_CONTROLPLANE_URL": self.cp.url,
            "STASIS_AUTH_TOKEN": self.cp.admin,
        }

    def cp_argv(self, *args: str) -> list[str]:
        return [STASIS, "controlplane", *args]

    def wait_reported(self, job: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = subprocess.run(
                self.cp_argv("jobs", "--json"),
                env=self.cp_env(),
                capture_output=True,
                text=True,
                timeout=30,
            )
            if r.returncode == 0 and job in {j["job"] for j in json.loads(r.stdout)}:
                return True
            time.sleep(0.3)
        return False

    def pending_commands(self) -> int:
        """Commands the control plane still has queued or leased (-1: it does not answer)."""
        try:
            r = subprocess.run(
                self.cp_argv("actions", "--json"),
                env=self.cp_env(),
                capture_output=True,
                text=True,
                timeout=30,
            )
        except subprocess.TimeoutExpired:
            return -1
        if r.returncode != 0:
            return -1
        return sum(1 for a in json.loads(r.stdout) if a.get("state") in ("queued", "leased"))

    # -- faults ------------------------------------------------------------------------------

    def kill_daemon(self, node: str) -> bool:
        """SIGKILL `node`'s daemon; whether it was alive to be killed."""
        d = self.nodes[node]
        if d.proc is None or d.proc.poll() is not None:
            return False
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        return True

    def daemon_died(self, node: str) -> bool:
        d = self.nodes[node]
        return d.proc is None or d.proc.poll() is not None

    def restart_daemon(self, node: str, points: list[str]) -> None:
        """Start `node`'s daemon again (SIGTERM first if it runs), with `points` armed."""
        d = self.nodes[node]
        if d.proc is not None and d.proc.poll() is None:
            d.stop()
        elif d.proc is not None:
            d.proc = None
            d.log.close()
        d.env["STASIS_TEST_FAULT_POINTS"] = ":".join(points)
        d.start()

    def kill_controlplane(self) -> bool:
        p = self.cp.proc
        if p is None or p.poll() is not None:
            return False
        p.send_signal(signal.SIGKILL)
        p.wait()
        return True

    def controlplane_died(self) -> bool:
        return self.cp.proc is None or self.cp.proc.poll() is not None

    def restart_controlplane(self, points: list[str]) -> None:
        self.cp.stop()
        # ControlPlane.start passes this process's environment on.
        os.environ["STASIS_TEST_FAULT_POINTS"] = ":".join(points)
        self.cp_armed = bool(points)
        try:
            self.cp.start("--command-lease", "5")
        finally:
            os.environ.pop("STASIS_TEST_FAULT_POINTS", None)

    def stall_store(self, seconds: float) -> None:
        """The S3 server stops answering (SIGSTOP: connections open, nothing comes back) for
        `seconds`."""
        assert self.s3 is not None and self.s3.proc is not None
        with self._stall_lock:
            os.killpg(self.s3.proc.pid, signal.SIGSTOP)
            self._stalled = True
            self._stall = threading.Timer(seconds, self._cont)
            self._stall.start()

    def _cont(self) -> None:
        with self._stall_lock:
            if self._stalled and self.s3 is not None and self.s3.proc is not None:
                os.killpg(self.s3.proc.pid, signal.SIGCONT)
            self._stalled = False

    def unstall_store(self, wait: bool) -> None:
        t = self._stall
        if t is not None:
            if wait:
                t.join()
            else:
                t.cancel()
                self._cont()
            self._stall = None

    @contextmanager
    def supervised(self, restart_after_s: float = 1.0) -> Iterator[list[str]]:
        """While the body runs, start again whatever dies, `restart_after_s` after its death
        (disarmed), as a service manager does (systemd's Restart=always): a node is down for
        seconds, not for as long as a command waits on it. Yields the list of what it started."""
        restarted: list[str] = []
        done = threading.Event()

        def watch() -> None:
            dead_since: dict[str, float] = {}
            while not done.wait(0.2):
                for name in [*self.nodes, "controlplane"]:
                    died = (
                        self.controlplane_died()
                        if name == "controlplane"
                        else self.daemon_died(name)
                    )
                    if not died:
                        dead_since.pop(name, None)
                        continue
                    since = dead_since.setdefault(name, time.monotonic())
                    if time.monotonic() - since < restart_after_s:
                        continue
                    try:
                        if name == "controlplane":
                            self.restart_controlplane(points=[])
                        else:
                            self.restart_daemon(name, points=[])
                        restarted.append(name)
                    except (AssertionError, OSError) as e:  # tried again on the next round
                        print(f"soak: could not start {name} again: {e}", flush=True)
                    dead_since.pop(name, None)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            yield restarted
        finally:
            done.set()
            t.join()

    def heal(self) -> None:
        """Undo every fault: the store reachable, what died started again (disarmed)."""
        self.unstall_store(wait=False)
        if self.proxy is not None:
            self.proxy.heal()
        if self.controlplane_died():
            self.restart_controlplane(points=[])
        for name, d in self.nodes.items():
            if self.daemon_died(name) or d.env.get("STASIS_TEST_FAULT_POINTS"):
                self.restart_daemon(name, points=[])

    # -- processes ---------------------------------------------------------------------------

    @staticmethod
    def tree(pid: int) -> list[int]:
        return proctree.tree(pid)

    @staticmethod
    def frozen(pid: int) -> list[int]:
        return stopped(pid)

    def wait_unfrozen(self, pid: int, timeout_s: float) -> bool:
        """Whether the tree of `pid` still has a stopped process after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.frozen(pid):
            if time.monotonic() > deadline:
                return True
            time.sleep(0.2)
        return False

    @staticmethod
    def kill_pid(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
