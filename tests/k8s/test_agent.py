"""The node agent's host install: the runtime into the host's root as the pod mounts it (the
shim, the runtime entry, stasis-runc and CRIU as a bundle that needs nothing of the host's
libraries), and containerd restarted only when its config was changed. (Its watches, taint,
cordon, by-hand and interval checkpoints: tests/e2e/test_k8s_agent.py, against kmock and a
real containerd.)"""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

from stasis.config import Settings
from stasis.errors import ContainerError
from stasis.k8s import shim
from stasis.k8s.agent import HostInstall, install_runtime

SETTINGS = Settings(socket=Path("/run/stasis/stasis.sock"))


def host_root(tmp_path: Path) -> Path:
    host = tmp_path / "host"
    (host / "etc" / "containerd").mkdir(parents=True)
    (host / "etc" / "containerd" / "config.toml").write_text("version = 2\n")
    (host / "usr" / "bin").mkdir(parents=True)
    (host / "usr" / "bin" / "runc").write_text("")  # the node's runc is /usr/bin/runc
    return host


def test_the_runtime_goes_into_the_host_root_and_containerd_restarts_once(tmp_path: Path) -> None:
    host = host_root(tmp_path)
    marker = tmp_path / "restarted"
    where = HostInstall(root=host, restart_containerd=("sh", "-c", f"echo x >> {marker}"))
    changes = install_runtime(where, SETTINGS)
    assert any("runtime entry" in c for c in changes)
    config = tomllib.loads((host / "etc" / "containerd" / "config.toml").read_text())
    assert (
        config["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["stasis"][
            "runtime_type"
        ]
        == shim.RUNTIME_TYPE
    )
    # The scripts name the host's paths, not the pod's.
    script = (host / "usr" / "local" / "bin" / shim.SHIM_NAME).read_text()
    assert "STASIS_CONFIG=/etc/stasis/runtime.toml" in script
    assert 'export PATH=/usr/local/bin/runc-wrapper:"$PATH"' in script
    dispatcher = (host / "usr" / "local" / "bin" / "runc-wrapper" / "runc").read_text()
    assert "exec /usr/local/lib/stasis/bin/stasis-runc " in dispatcher
    assert 'exec /usr/bin/runc "$@"' in dispatcher
    assert tomllib.loads((host / "etc" / "stasis" / "runtime.toml").read_text()) == {
        "socket": "/run/stasis/stasis.sock",
        "criu": "/usr/local/lib/stasis/bin/criu",
        "runc": "/usr/bin/runc",
    }
    wrapper = (host / "usr" / "local" / "lib" / "stasis" / "bin" / "criu").read_text()
    assert (
        "exec /usr/local/lib/stasis/lib/ld-linux-x86-64.so.2 --library-path "
        "/usr/local/lib/stasis/lib /usr/local/lib/stasis/sbin/criu" in wrapper
    )
    assert marker.read_text() == "x\n"
    # The agent started again (a new pod): nothing to copy or restart for.
    assert install_runtime(where, SETTINGS) == [
        "write /host/usr/local/bin/containerd-shim-stasis-v2 and "
        "/host/usr/local/bin/runc-wrapper/runc".replace("/host", str(host))
    ]
    assert marker.read_text() == "x\n"


def test_the_bundle_runs_criu_and_stasis_runc_with_its_own_libraries(tmp_path: Path) -> None:
    from stasis.k8s import hostbundle

    dest = tmp_path / "bundle"
    assert hostbundle.install(dest, Path("/usr/local/sbin/criu"))
    # Nothing of the venv, and not run from the checkout (whose stasis/ Python would find).
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    r = subprocess.run(
        [str(dest / "bin" / "criu"), "--version"],
        capture_output=True,
        cwd=tmp_path,
        text=True,
        env=env,
    )
    assert r.returncode == 0 and r.stdout.startswith("Version: 4."), r.stderr
    # Python, its C extensions and their libraries all come from the bundle.
    r = subprocess.run(
        [
            str(dest / "bin" / "python"),
            "-c",
            "import sys, ssl, zstandard, pydantic_core, stasis.k8s.runtime\n"
            "maps = open('/proc/self/maps').read().split()\n"
            "print(sorted({p for p in maps if '.so' in p and "
            "not p.startswith(sys.argv[1])}))",
            str(dest),
        ],
        capture_output=True,
        cwd=tmp_path,
        text=True,
        env=env,
    )
    assert (r.returncode, r.stdout) == (0, "[]\n"), r.stderr
    # stasis-runc hands what is not about stasis to runc.
    r = subprocess.run(
        [str(dest / "bin" / "stasis-runc"), "--version"],
        capture_output=True,
        cwd=tmp_path,
        text=True,
        env={**env, "STASIS_CONFIG": "/dev/null"},
    )
    assert r.returncode == 0 and r.stdout.startswith("runc version"), r.stderr
    # Dev tools stay out: only what stasis needs at run time.
    assert not (dest / "site-packages" / "pytest").exists()


def test_a_failed_containerd_restart_is_one_clear_error(tmp_path: Path) -> None:
    where = HostInstall(
        root=host_root(tmp_path), restart_containerd=("sh", "-c", "echo no unit >&2; exit 5")
    )
    with pytest.raises(
        ContainerError, match=r"restarting containerd \(sh -c .*\) failed: " r"no unit$"
    ):
        install_runtime(where, SETTINGS)


def test_a_node_without_runc_is_told_so(tmp_path: Path) -> None:
    with pytest.raises(ContainerError, match="no runc on the node"):
        install_runtime(HostInstall(root=tmp_path), SETTINGS)


def test_the_requests_answered_are_kept_bounded_and_read_back_only_from_the_agent_s_file(
    tmp_path: Path,
) -> None:
    """What tells an agent started again which requests were answered: at most
    `remember_pods` entries, 0600, and read back only from a plain file of its own, of a
    sane size (never through a link, never one another user wrote)."""
    import json
    import os

    from stasis.k8s.agent import ANSWERED_FILE, Agent

    settings = Settings(socket=tmp_path / "none.sock", state_dir=tmp_path)
    path = tmp_path / ANSWERED_FILE
    path.write_text(json.dumps({"pods": [[f"ns/p{i}/", f"d{i}"] for i in range(10)]}))
    agent = Agent(settings=settings, api=None, node="n", start_daemon=False, remember_pods=4)
    assert list(agent._answered.items()) == [(f"ns/p{i}/", f"d{i}") for i in range(6, 10)]
    agent._answered.put("ns/new/", "dn")
    agent._keep_answered()
    assert json.loads(path.read_text())["pods"] == [[f"ns/p{i}/", f"d{i}"] for i in (7, 8, 9)] + [
        ["ns/new/", "dn"]
    ]
    assert path.stat().st_mode & 0o777 == 0o600

    def read_back() -> list[tuple[str, str]]:
        return list(
            Agent(settings=settings, api=None, node="n", start_daemon=False)._answered.items()
        )

    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(path.read_text())
    path.unlink()
    path.symlink_to(elsewhere)
    assert read_back() == []
    path.unlink()
    path.write_text(elsewhere.read_text())
    os.chown(path, 65534, 65534)
    assert read_back() == []
    os.chown(path, 0, 0)
    assert len(read_back()) == 4
    with path.open("a") as out:
        out.write(" " * (5 << 20))
    assert read_back() == []
    path.write_text('{"pods": [["a", 1], "bc", ["x", "y"]]}')
    assert read_back() == []  # not what an agent writes: all of it ignored
    # A link planted where the agent writes its next copy is not followed.
    victim = tmp_path / "victim"
    victim.write_text("root's")
    (tmp_path / (ANSWERED_FILE + ".tmp")).symlink_to(victim)
    agent._keep_answered()
    assert victim.read_text() == "root's"
