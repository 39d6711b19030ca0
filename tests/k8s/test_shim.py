"""The stasis runtime as a node gets it: containerd's config and the shim script."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

from stasis.errors import ContainerError
from stasis.k8s import shim


def default_config() -> str:
    r = subprocess.run(["containerd", "config", "default"], capture_output=True, text=True,
                       check=True)
    return r.stdout


def test_install_adds_the_runtime_entry_and_uninstall_gives_the_file_back(tmp_path: Path
                                                                          ) -> None:
    config = tmp_path / "etc" / "containerd" / "config.toml"
    config.parent.mkdir(parents=True)
    original = default_config()
    config.write_text(original)
    bin_dir = tmp_path / "bin"
    planned = shim.install_node(config, bin_dir, Path("/etc/stasis/config.toml"), dry_run=True)
    assert len(planned) == 2 and config.read_text() == original and not bin_dir.exists()
    shim.install_node(config, bin_dir, Path("/etc/stasis/config.toml"))
    data = tomllib.loads(config.read_text())
    runtimes = data["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["stasis"]["runtime_type"] == shim.RUNTIME_TYPE
    assert runtimes["runc"]["runtime_type"] == "io.containerd.runc.v2"  # untouched
    script = (bin_dir / shim.SHIM_NAME).read_text()
    assert "STASIS_CONFIG=/etc/stasis/config.toml" in script
    assert "containerd-shim-runc-v2" in script
    dispatcher = (bin_dir / "runc-wrapper" / "runc").read_text()
    assert "stasis-runc" in dispatcher and 'exec /usr/sbin/runc "$@"' in dispatcher
    once = config.read_text()
    shim.install_node(config, bin_dir, Path("/etc/stasis/config.toml"))
    assert config.read_text() == once  # idempotent
    # containerd itself accepts the result.
    r = subprocess.run(["containerd", "--config", str(config), "config", "dump"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and 'runtime_type = "io.containerd.stasis.v2"' in r.stdout, r.stderr
    shim.uninstall_node(config, bin_dir)
    assert config.read_text() == original
    assert not (bin_dir / shim.SHIM_NAME).exists()


def test_a_node_without_a_config_gets_one_and_loses_it_again(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    shim.install_node(config, tmp_path / "bin", Path("/etc/stasis/config.toml"))
    assert tomllib.loads(config.read_text())["version"] == 2
    shim.uninstall_node(config, tmp_path / "bin")
    assert not config.exists()


@pytest.mark.parametrize("text,why", [
    ("version = 1\n", "not a version 2"),
    ("version = 2\n[plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.stasis]\n"
     "runtime_type = 'x'\n", "already has a runtime"),
    ("version = = 2", "cannot read"),
])
def test_configs_it_cannot_extend_are_refused_and_left_alone(tmp_path: Path, text: str,
                                                            why: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(text)
    with pytest.raises(ContainerError, match=why):
        shim.install_node(config, tmp_path / "bin", Path("/etc/stasis/config.toml"))
    assert config.read_text() == text and not (tmp_path / "bin").exists()


def test_only_the_commands_that_can_concern_stasis_start_stasis_runc(tmp_path: Path) -> None:
    real = tmp_path / "real-runc"
    real.write_text('#!/bin/sh\necho "runc $*"\n')
    real.chmod(0o755)
    script = tmp_path / "runc"
    script.write_text(shim._dispatcher(str(real), shim._wrapper()))
    script.chmod(0o755)

    def run(*args: str) -> str:
        return subprocess.run([str(script), *args], capture_output=True, text=True,
                              check=False).stdout

    # Straight to runc, the value of --root never taken for a command.
    assert run("--root", "kill", "state", "c1") == "runc --root kill state c1\n"
    assert run("--log=/l", "ps", "c1") == "runc --log=/l ps c1\n"
    assert run("--version") == "runc --version\n"
    assert "stasis-runc" in script.read_text().split("create|start|kill|delete", 1)[1] \
        .splitlines()[0]
