"""The node package (`make deb`, scripts/build-deb.sh) built, then installed, upgraded, removed
and purged by dpkg in a throwaway root: an overlay whose lower layer is this machine's / and
whose upper layer is a tmpfs, entered through a private mount namespace and chroot, so that
nothing of it reaches this machine. The package's own maintainer scripts run there (no systemd
runs in it: the unit is enabled, not started).

In a root held up as a node (`Node`), the installed daemon is started and restarted as systemd
does it (the unit's ExecStart; KillMode=process) around an upgrade under a running job, and a
`make install` daemon's checkpoint is restored by the packaged daemon."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from stasis.slurm import install
from tests.conftest import TEST_USER, ensure_test_user, wait_for

REPO = Path(__file__).resolve().parents[2]
VENV = "/opt/stasis/venv"
# Where `make install` puts it too (CRIU restores a job's init by path).
INIT = "/usr/libexec/stasis/stasis-init"
# What this machine's own (`make install`) stasis put in place and its daemon's state: a node
# has none of it (the roots hide it), and the packaged daemon would otherwise use this machine's
# init and state. This machine's CRIU stays until a test makes the root a package-only node.
DEV_INSTALL = ("/usr/local/libexec/stasis", "/usr/libexec/stasis", "/var/lib/stasis")
DEV_CRIU = "/usr/local/sbin/criu"
WANTS = "etc/systemd/system/multi-user.target.wants/stasis.service"
CHECKPOINT = "var/lib/stasis/checkpoints/job-1/manifest"
# What dpkg and apt themselves keep about a package once it is gone, and what we keep on purpose.
BOOKKEEPING = ("var/lib/dpkg/", "var/log/", "var/cache/", "var/lib/systemd/deb-systemd-", "tmp/")


@dataclass
class Root:
    """The throwaway root: `upper` holds every change made in it."""

    base: Path

    @property
    def upper(self) -> Path:
        return self.base / "upper"

    def run(self, command: str) -> subprocess.CompletedProcess[str]:
        """`command` run by sh as root inside the root (with a clean environment)."""
        b = self.base
        script = f"""
set -e
mount --make-rprivate /
mount -t overlay overlay -o lowerdir=/,upperdir={b}/upper,workdir={b}/work {b}/merged
mount -t proc proc {b}/merged/proc
mount --rbind /dev {b}/merged/dev
mount -t tmpfs tmpfs {b}/merged/run
exec chroot {b}/merged /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive /bin/sh -c "$1"
"""
        return subprocess.run(
            ["unshare", "--mount", "--fork", "/bin/sh", "-c", script, "root", command],
            capture_output=True,
            text=True,
            timeout=300,
        )

    def ok(self, command: str) -> str:
        r = self.run(command)
        assert r.returncode == 0, f"{command}: {r.stdout[-2000:]}{r.stderr[-3000:]}"
        return r.stdout

    def exists(self, path: str) -> bool:
        return self.run(f"test -e {path} || test -L {path}").returncode == 0

    def changed(self) -> list[str]:
        """The files the root has that this machine does not (bookkeeping aside)."""
        out = []
        for dirpath, dirnames, filenames in os.walk(self.upper):
            for name in filenames + [d for d in dirnames if os.path.islink(Path(dirpath, d))]:
                rel = str(Path(dirpath, name).relative_to(self.upper))
                if not rel.startswith(BOOKKEEPING):
                    out.append(rel)
        return sorted(out)


@dataclass
class Debs:
    first: Path  # stasis 0.1.0-1 ... with stasis-criu
    second: Path  # the same, a higher version
    criu: Path


def build(out: Path, version: str) -> Path:
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "build-deb.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "STASIS_DEB_VERSION": version},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (deb,) = out.glob(f"stasis_{version}_*.deb")
    return deb


@pytest.fixture(scope="module")
def debs() -> Iterator[Debs]:
    out = Path(tempfile.mkdtemp(prefix="stasis-deb-"))
    try:
        first = build(out / "1", "0.1.0-1")
        second = build(out / "2", "0.1.0-2")
        (criu,) = (out / "2").glob("stasis-criu_*.deb")
        yield Debs(first, second, criu)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def root(debs: Debs) -> Iterator[Root]:
    base = Path(tempfile.mkdtemp(prefix="stasis-deb-root-"))
    # The upper layer on a tmpfs: an overlay's upper may not lie inside its lower (/).
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", str(base)], check=True)
    try:
        for d in ("upper", "work", "merged"):
            (base / d).mkdir()
        r = Root(base)
        (r.upper / "tmp").mkdir(mode=0o1777)
        for deb in (debs.first, debs.second, debs.criu):
            shutil.copy(deb, r.upper / "tmp" / deb.name)
        yield r
    finally:
        subprocess.run(["umount", "-l", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)


def test_install_upgrade_remove_purge(debs: Debs, root: Root) -> None:
    r = root
    first, second, criu = (f"/tmp/{d.name}" for d in (debs.first, debs.second, debs.criu))
    r.ok(f"rm -rf {' '.join(DEV_INSTALL)}")
    before = r.changed()
    assert not r.exists("/opt/stasis"), "this machine has /opt/stasis: the test would not see it"
    r.ok(f"dpkg -i {criu} {first}")

    # The files land, the commands run from the installed copy.
    for path in (
        "/usr/bin/stasis",
        "/usr/bin/stasis-runc",
        "/usr/bin/stasis-rsh",
        INIT,
        "/usr/sbin/criu",
        "/etc/stasis/config.toml",
        f"/{WANTS}",
    ):
        assert r.exists(path), path
    assert r.ok("stasis --version").strip() == "stasis 0.1.0"
    where = r.ok(f"{VENV}/bin/python -c 'import stasis, sys; print(stasis.__file__, sys.path)'")
    assert where.startswith(f"{VENV}/lib/python3"), where
    assert "/work" not in where and str(REPO) not in where, where
    assert not r.exists(f"{VENV}/lib/python3*/site-packages/stasis/dev"), "stasis/dev shipped"
    # Static: jobs exec it as their own user, and it is part of every checkpoint.
    assert "not a dynamic executable" in r.ok(f"ldd {INIT} 2>&1 || true")
    assert r.ok("/usr/sbin/criu --version").startswith("Version: 4.")
    unit = r.ok("cat $(dpkg -L stasis | grep '/stasis.service$')")
    assert f"ExecStart={VENV}/bin/stasis daemon" in unit
    # The same stop behaviour as the unit `stasis slurm install` writes: jobs outlive the daemon.
    slurm_unit = install.unit_text(
        install.InstallOptions(roles=frozenset({"worker"}), python="/x/python")
    )
    for key in ("KillMode=", "TimeoutStopSec=", "Restart="):
        (ours,) = [line for line in unit.splitlines() if line.startswith(key)]
        assert ours in slurm_unit.splitlines(), ours
    assert r.ok("dpkg-query -W -f '${Conffiles}' stasis").split()[0] == "/etc/stasis/config.toml"

    # An upgrade keeps the site's edit of the conffile and replaces the rest.
    r.ok("echo 'keep = 3' >> /etc/stasis/config.toml")
    r.ok(f"mkdir -p /{Path(CHECKPOINT).parent} && echo checkpoint > /{CHECKPOINT}")
    r.ok(f"dpkg -i {second}")
    assert r.ok("cat /opt/stasis/VERSION").strip() == "0.1.0-2"
    assert r.ok("dpkg-query -W -f '${Version}' stasis") == "0.1.0-2"
    assert r.ok("tail -n1 /etc/stasis/config.toml").strip() == "keep = 3"
    settings = (
        f"{VENV}/bin/python -c 'from stasis.config import load_settings as l; print(l().keep)'"
    )
    assert r.ok(settings).strip() == "3"

    # Remove: the program goes, the configuration stays; purge: the configuration goes, the
    # checkpoints never.
    r.ok("dpkg -r stasis")
    assert not r.exists("/usr/bin/stasis") and not r.exists("/opt/stasis")
    assert r.exists("/etc/stasis/config.toml")
    purged = r.ok("dpkg -P stasis stasis-criu 2>&1")
    assert "/var/lib/stasis" in purged  # it says what it keeps
    for path in ("/etc/stasis", f"/{WANTS}", "/usr/sbin/criu", "/opt/stasis"):
        assert not r.exists(path), path
    assert r.ok(f"cat /{CHECKPOINT}") == "checkpoint\n"
    # Nothing else is left behind.
    left = [p for p in r.changed() if not p.startswith("var/lib/stasis/")]
    assert left == before, left


# -- a node with the daemon running: upgrade under a job, and a dev install's checkpoint --------

COUNTER = (REPO / "tests" / "workloads" / "counter.py").read_text()


class Node:
    """The throwaway root held up by one long-lived process (its mount namespace holds the
    overlay): daemons and jobs started in it outlive a command, as on a node."""

    def __init__(self, root: Root) -> None:
        self.root = root
        b = root.base
        self.marker = f"STASIS_DEB_NODE={b}"
        script = f"""
set -e
mount --make-rprivate /
mount -t overlay overlay -o lowerdir=/,upperdir={b}/upper,workdir={b}/work {b}/merged
mount -t proc proc {b}/merged/proc
mount --rbind /dev {b}/merged/dev
mount --rbind /sys {b}/merged/sys
mount -t tmpfs tmpfs {b}/merged/run
echo $$
exec sleep infinity
"""
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--fork", "/bin/sh", "-c", script],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.holder.stdout is not None
        self.pid = int(self.holder.stdout.readline())
        self.mntns = os.readlink(f"/proc/{self.pid}/ns/mnt")
        self.daemon_pid = 0

    def run(self, command: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        """`command` run by sh as root in the node (a clean environment, as a service has)."""
        session = os.environ.get("STASIS_TEST_SESSION", "")
        return subprocess.run(
            [
                "nsenter",
                f"--target={self.pid}",
                "--mount",
                "--",
                "chroot",
                str(self.root.base / "merged"),
                "/usr/bin/env",
                "-i",
                "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                "LANG=C.UTF-8",
                "DEBIAN_FRONTEND=noninteractive",
                self.marker,
                f"STASIS_TEST_SESSION={session}",
                "/bin/sh",
                "-c",
                command,
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def ok(self, command: str) -> str:
        r = self.run(command)
        assert r.returncode == 0, f"{command}: {r.stdout[-2000:]}{r.stderr[-3000:]}"
        return r.stdout

    def user_json(self, *args: str) -> Any:
        """`stasis ARGS --json` as the test user (the daemon authorizes by peer credentials)."""
        cmd = " ".join(shlex.quote(a) for a in (args[0], "--json", *args[1:]))
        return json.loads(self.ok(f"runuser -u {TEST_USER} -- stasis {cmd}"))

    def start_daemon(self, command: str = "") -> None:
        """The daemon as systemd starts stasis.service: the installed unit's ExecStart."""
        if not command:
            unit = self.ok("cat $(dpkg -L stasis | grep '/stasis.service$')")
            (line,) = [x for x in unit.splitlines() if x.startswith("ExecStart=")]
            command = line.removeprefix("ExecStart=")
        self.ok(
            "rm -f /run/stasis-daemon.pid; "
            "setsid sh -c 'echo $$ > /run/stasis-daemon.pid.new && "
            "mv /run/stasis-daemon.pid.new /run/stasis-daemon.pid && exec \"$@\"' daemon "
            f"{command} < /dev/null >> /var/log/stasis-daemon.log 2>&1 &"
        )
        self.daemon_pid = int(
            wait_for(lambda: self.run("cat /run/stasis-daemon.pid").stdout, 10, "the daemon's pid")
        )
        wait_for(
            lambda: self.run("stasis ps").returncode == 0 or self._daemon_died(),
            30,
            "the daemon's socket",
        )

    def _daemon_died(self) -> bool:
        if not _alive(self.daemon_pid):
            log = self.ok("cat /var/log/stasis-daemon.log")
            raise AssertionError(f"the daemon exited: {log[-3000:]}")
        return False

    def stop_daemon(self) -> None:
        """systemctl stop/restart with KillMode=process: SIGTERM to the daemon's process only."""
        os.kill(self.daemon_pid, signal.SIGTERM)
        wait_for(lambda: not _alive(self.daemon_pid), 120, "the daemon to stop")

    def counted(self, job: str, daemon: bool = True) -> list[int]:
        """What the job's counter printed: its log through the daemon (which a restore carries
        on), or, while no daemon runs, the file it writes to."""
        r = self.run(f"stasis logs {job}" if daemon else f"cat /var/lib/stasis/logs/{job}.log")
        return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []

    def close(self) -> None:
        """Everything started in the node goes (its daemons, jobs, CRIU), then its mounts."""
        for _ in range(50):
            ours = [pid for pid in _pids() if pid != self.pid and self._ours(pid)]
            if not ours:
                break
            for pid in ours:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        else:
            raise AssertionError(f"processes of the node would not go: {ours}")
        # The namespace's own process (unshare's child): the mounts go with it.
        os.kill(self.pid, signal.SIGKILL)
        self.holder.wait(timeout=30)
        assert self.holder.stdout is not None
        self.holder.stdout.close()

    def _ours(self, pid: int) -> bool:
        try:
            if os.readlink(f"/proc/{pid}/ns/mnt") == self.mntns:
                return _alive(pid)
            with open(f"/proc/{pid}/environ", "rb") as f:
                return self.marker.encode() in f.read().split(b"\0") and _alive(pid)
        except OSError:
            return False


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def node(root: Root) -> Iterator[Node]:
    ensure_test_user()
    n = Node(root)
    try:
        n.ok(f"rm -rf {' '.join(DEV_INSTALL)}")
        n.ok(f"cat > /srv/counter.py <<'EOF'\n{COUNTER}EOF\nchmod 0644 /srv/counter.py")
        yield n
    finally:
        n.close()


def test_upgrade_in_place_keeps_a_running_job_protected(debs: Debs, node: Node) -> None:
    n = node
    first, second, criu = (f"/tmp/{d.name}" for d in (debs.first, debs.second, debs.criu))
    n.ok(f"rm -f {DEV_CRIU} && dpkg -i {criu} {first}")
    n.start_daemon()
    job = n.user_json("run", "--label", "upgraded", "--", "python3", "-u", "/srv/counter.py")
    wait_for(lambda: len(n.counted(job["job"])) >= 5, 30, "the job counting")

    # No systemd runs here: the postinst restarts nothing, the old daemon goes on meanwhile.
    old_daemon = n.daemon_pid
    n.ok(f"dpkg -i {second}")
    assert n.ok("cat /opt/stasis/VERSION").strip() == "0.1.0-2"
    assert _alive(old_daemon)
    # The upgrade left the job's init in place (a deleted one could not be restored by its owner).
    assert n.ok(f"readlink /proc/{job['pid']}/exe").strip() == INIT
    # What systemd does on that restart (KillMode=process): the daemon alone is stopped, the
    # job goes on without it, then the new ExecStart starts.
    n.stop_daemon()
    at_stop = len(n.counted(job["job"], daemon=False))
    wait_for(
        lambda: len(n.counted(job["job"], daemon=False)) >= at_stop + 3,
        30,
        "counting without a daemon",
    )
    n.start_daemon()
    assert n.daemon_pid != old_daemon
    listed = {j["job"]: j for j in n.user_json("ps")}
    assert listed[job["job"]]["state"] == "running", listed

    # Still protected: the new daemon checkpoints it, and it comes back counting on.
    n.user_json("dump", job["job"])
    before = n.counted(job["job"])
    assert before == list(range(len(before)))  # never restarted: through the upgrade
    assert len(before) > at_stop + 3
    restored = n.user_json("restore", "--label", "upgraded")
    wait_for(
        lambda: len(n.counted(restored["job"])) >= len(before) + 3, 30, "the restored job counting"
    )
    values = n.counted(restored["job"])
    assert values == list(range(len(values)))  # from where the checkpoint left it
    n.ok(f"runuser -u {TEST_USER} -- stasis kill {restored['job']}")
    n.stop_daemon()


def test_a_dev_install_checkpoint_restores_under_the_package(debs: Debs, node: Node) -> None:
    """`make install`'s daemon (this checkout's venv, its init where `make init` puts it, this
    machine's CRIU) dumps a job; then the node has only the packages, and their daemon restores
    it: the job's init is at the same path, the same binary (CRIU restores it by path)."""
    n = node
    criu, second = (f"/tmp/{d.name}" for d in (debs.criu, debs.second))
    # The dev install, as `make init` lays it out (the root hid this machine's).
    n.ok(
        f"install -D -m 0755 {REPO}/.venv/bin/stasis-init {INIT} && "
        "mkdir -p /usr/local/libexec/stasis && "
        f"ln -sfn {INIT} /usr/local/libexec/stasis/stasis-init && "
        f"ln -s {REPO}/.venv/bin/stasis /usr/bin/stasis"
    )
    n.start_daemon(f"{REPO}/.venv/bin/stasis daemon")
    job = n.user_json("run", "--label", "dev", "--", "python3", "-u", "/srv/counter.py")
    wait_for(lambda: len(n.counted(job["job"])) >= 5, 30, "the job counting")
    n.user_json("dump", job["job"])
    before = n.counted(job["job"])
    n.stop_daemon()
    # The dev install goes; the packages come (CRIU too: /usr/sbin/criu).
    n.ok(f"rm -rf /usr/bin/stasis /usr/local/libexec/stasis {INIT} {DEV_CRIU}")
    n.ok(f"dpkg -i {criu} {second}")
    n.start_daemon()
    restored = n.user_json("restore", "--label", "dev")
    wait_for(
        lambda: len(n.counted(restored["job"])) >= len(before) + 3, 30, "the restored job counting"
    )
    values = n.counted(restored["job"])
    assert values == list(range(len(values)))
    assert n.ok(f"readlink /proc/{restored['pid']}/exe").strip() == INIT
    n.ok(f"runuser -u {TEST_USER} -- stasis kill {restored['job']}")
    n.stop_daemon()
