"""The Slurm web installer played against (issue 27, item 7): every process it starts is traced
(strace: the argv of each exec, which is what any user of the node reads in /proc/PID/cmdline)
and the cluster's token is in none of them; a wheel changed after the installer was served (the
control plane's copy rewritten, standing in for a man in the middle of the download) is refused
before pip sees it, and its code never runs; a plain http:// control plane off loopback is
refused before anything is downloaded, unless the site says so.

The node's prefix is a fresh virtual environment that sees the test environment's dependencies
(not stasis): pip installs the served wheel without an index, in seconds."""

from __future__ import annotations

import os
import subprocess
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controlplane.conftest import ControlPlane
from tests.controlplane.test_transport import outside_address

SITE = Path(sysconfig.get_paths()["purelib"])


@pytest.fixture(scope="module")
def cp(world_tmp: Path) -> Iterator[ControlPlane]:
    root = Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp))
    plane = ControlPlane(root, str(root / "cp.db"))
    # Every address: the plain-HTTP cases reach it at this host's network address.
    plane.start("--listen", f"0.0.0.0:{plane.port}", "--allow-plain-http")
    yield plane
    plane.stop()


class Node:
    """A node's view: a prefix without stasis, a config file, a header file with the token."""

    def __init__(self, root: Path, token: str) -> None:
        self.root = root
        self.prefix = root / "opt-stasis"
        self.config = root / "config.toml"
        self.marker = root / "tampered-code-ran"
        subprocess.run(["python3", "-m", "venv", str(self.prefix)], check=True, timeout=120)
        deps = root / "deps"
        deps.mkdir()
        for entry in SITE.iterdir():
            if (
                not entry.name.startswith(
                    (
                        "stasis",
                        "__editable__",
                        "pip",
                        "_distutils_hack",
                        "setuptools",
                        "pkg_resources",
                    )
                )
                and entry.suffix != ".pth"
            ):
                (deps / entry.name).symlink_to(entry)
        site = subprocess.run(
            [
                str(self.prefix / "bin" / "python"),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        Path(site, "_test_deps.pth").write_text(f"{deps}\n")
        self.auth = root / "auth"
        self.auth.write_text(f"Authorization: Bearer {token}\n")
        os.chmod(self.auth, 0o600)
        self.slurm_conf = root / "slurm.conf"
        self.slurm_conf.write_text("ClusterName=test\nSlurmctldHost=localhost\n")

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "PATH": os.environ["PATH"],
            "HOME": str(self.root),
            "STASIS_PREFIX": str(self.prefix),
            "STASIS_CONFIG": str(self.config),
            "STASIS_NODE_NAME": "node-1",
            "STASIS_STATE_DIR": str(self.root / "state"),
            **extra,
        }

    def args(self) -> list[str]:
        return [
            "--node-role",
            "login",
            "--slurm-conf",
            str(self.slurm_conf),
            "--lib-dir",
            str(self.root / "lib"),
            "--no-systemd",
        ]

    def traced(
        self, command: str, cwd: Path | None = None, **env: str
    ) -> tuple[subprocess.CompletedProcess[str], str]:
        """`command` (bash) with the argv of every process it starts traced."""
        trace = self.root / "execs.trace"
        r = subprocess.run(
            [
                "strace",
                "-f",
                "-qq",
                "-e",
                "trace=execve",
                "-s",
                "65536",
                "-o",
                str(trace),
                "bash",
                "-c",
                command,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=self.env(**env),
            cwd=cwd or self.root,
        )
        return r, trace.read_text()


def _fetch(node: Node, url: str) -> str:
    """The documented fetch: the token from a header file, not on curl's command line."""
    return f'curl -fsSL -H @{node.auth} "{url}/install/slurm"'


def test_the_installer_never_puts_the_token_on_a_command_line(
    cp: ControlPlane, world_tmp: Path
) -> None:
    hpc = cp.json("clusters", "add", "argv", "--kind", "slurm")
    node = Node(Path(tempfile.mkdtemp(prefix="node-", dir=world_tmp)), hpc["token"])
    url = f"http://{outside_address()}:{cp.port}"
    # Run from a directory a user filled: modules of theirs that Python would import from
    # the current directory (root must not run them).
    cwd = node.root / "users-dir"
    for module in ("venv.py", "importlib.py", "pathlib.py", "stasis/__init__.py"):
        (cwd / module).parent.mkdir(parents=True, exist_ok=True)
        (cwd / module).write_text(f"open({str(node.marker)!r}, 'a').write({module!r})\n")
    r, execs = node.traced(
        f"{_fetch(node, url)} | bash -s -- {' '.join(node.args())}",
        cwd,
        STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP="1",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert not node.marker.exists(), node.marker.read_text()
    assert hpc["token"] not in execs, [x for x in execs.splitlines() if hpc["token"] in x]
    assert hpc["token"] not in r.stdout + r.stderr
    ran = execs.count("execve(")
    assert '/bin/curl", ["curl"' in execs and "controlplane\", \"join\"" in execs, execs
    assert ran > 10, execs  # the trace saw the installer's processes, not just bash
    # And it did install: the pinned wheel, the settings, the site's plain-HTTP consent.
    assert (node.prefix / "bin" / "stasis").exists()
    config = node.config.read_text()
    assert f'auth_token = "{hpc["token"]}"' in config and f'"{url}"' in config
    assert "controlplane_allow_plain_http = true" in config
    assert os.stat(node.config).st_mode & 0o777 == 0o600
    # What users' jobs run and Slurm reads stays theirs to read (the token's file alone is
    # made private).
    assert os.stat(node.prefix / "bin" / "stasis").st_mode & 0o005 == 0o005
    assert os.stat(node.slurm_conf).st_mode & 0o777 == 0o644


def test_a_wheel_changed_on_the_way_is_refused_and_never_runs(
    cp: ControlPlane, world_tmp: Path
) -> None:
    hpc = cp.json("clusters", "add", "tamper", "--kind", "slurm")
    node = Node(Path(tempfile.mkdtemp(prefix="node-", dir=world_tmp)), hpc["token"])
    script = node.root / "install.sh"
    fetched = subprocess.run(f"{_fetch(node, cp.url)} > {script}", shell=True, timeout=120)
    assert fetched.returncode == 0
    # The bytes the node will download are not the ones the script was served for: the
    # attacker's wheel runs code of theirs as soon as stasis is imported.
    (wheel,) = (cp.root / "controlplane").glob("stasis-*.whl")
    honest = wheel.read_bytes()
    hostile = node.root / "hostile.whl"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(hostile, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "stasis/__init__.py":
                data = f"open({str(node.marker)!r}, 'w').write('ran')\n".encode() + data
            dst.writestr(item, data)
    os.replace(hostile, wheel)
    try:
        r = subprocess.run(
            ["bash", str(script), *node.args()],
            capture_output=True,
            text=True,
            timeout=300,
            env=node.env(),
        )
    finally:
        wheel.write_bytes(honest)
    assert r.returncode == 3, r.stdout + r.stderr
    (line,) = [x for x in r.stderr.splitlines() if "refused" in x]
    assert line.startswith("stasis-install: refused stasis-") and "its sha256 " in line, line
    assert "nothing installed: fetch the installer again, over https://" in line
    assert not node.marker.exists()
    assert not (node.prefix / "bin" / "stasis").exists() and not node.config.exists()


def test_plain_http_off_loopback_is_refused_before_any_download(
    cp: ControlPlane, world_tmp: Path
) -> None:
    hpc = cp.json("clusters", "add", "plain", "--kind", "slurm")
    node = Node(Path(tempfile.mkdtemp(prefix="node-", dir=world_tmp)), hpc["token"])
    host = outside_address()
    r, execs = node.traced(
        f"{_fetch(node, f'http://{host}:{cp.port}')} | " f"bash -s -- {' '.join(node.args())}"
    )
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(
        f"stasis-install: refused to install from http://{host}:{cp.port}: "
        f"plain http:// to {host}, not this host's loopback"
    ), line
    assert "STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP=1" in line and "rotate it" in line
    assert execs.count('execve("/usr/bin/curl"') == 1  # the fetch of the script, no more
    assert not (node.prefix / "bin" / "stasis").exists() and not node.config.exists()
