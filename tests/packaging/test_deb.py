"""The node package (`make deb`, scripts/build-deb.sh) built, then installed, upgraded, removed
and purged by dpkg in a throwaway root: an overlay whose lower layer is this machine's / and
whose upper layer is a tmpfs, entered through a private mount namespace and chroot, so that
nothing of it reaches this machine. The package's own maintainer scripts run there (no systemd
runs in it: the unit is enabled, not started)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stasis.slurm import install

REPO = Path(__file__).resolve().parents[2]
VENV = "/opt/stasis/venv"
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
    before = r.changed()
    assert not r.exists("/opt/stasis"), "this machine has /opt/stasis: the test would not see it"
    r.ok(f"dpkg -i {criu} {first}")

    # The files land, the commands run from the installed copy.
    for path in (
        "/usr/bin/stasis",
        "/usr/bin/stasis-runc",
        f"{VENV}/bin/stasis-init",
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
    assert "not a dynamic executable" in r.ok(f"ldd {VENV}/bin/stasis-init 2>&1 || true")
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
