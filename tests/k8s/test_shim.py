"""The stasis runtime as a node gets it: containerd's config and the shim script."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

from stasis.errors import ContainerError
from stasis.k8s import shim


def default_config() -> str:
    r = subprocess.run(
        ["containerd", "config", "default"], capture_output=True, text=True, check=True
    )
    return r.stdout


def test_install_adds_the_runtime_entry_and_uninstall_gives_the_file_back(tmp_path: Path) -> None:
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
    r = subprocess.run(
        ["containerd", "--config", str(config), "config", "dump"], capture_output=True, text=True
    )
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


@pytest.mark.parametrize(
    "text,why",
    [
        ("version = 1\n", "is a version 1 containerd config"),
        # containerd reads a config without `version` as version 1.
        ("[plugins.'io.containerd.grpc.v1.cri']\nsandbox_image = 'x'\n", "version 1 containerd"),
        ("version = 4\n", "stasis writes versions 2 and 3"),
        (
            "version = 2\n[plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.stasis]\n"
            "runtime_type = 'x'\n",
            "already has a runtime",
        ),
        ("version = = 2", "cannot read"),
    ],
)
def test_configs_it_cannot_extend_are_refused_and_left_alone(
    tmp_path: Path, text: str, why: str
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(text)
    with pytest.raises(ContainerError, match=why):
        shim.install_node(config, tmp_path / "bin", Path("/etc/stasis/config.toml"))
    assert config.read_text() == text and not (tmp_path / "bin").exists()


# containerd 2.x's own default config (`containerd config default` of 2.0, abridged): version
# 3, the CRI runtimes under the plugin io.containerd.cri.v1.runtime (containerd's docs/PLUGINS.md
# and docs/cri/config.md of 2.0; containerd/containerd#10132).
CONTAINERD_2_DEFAULT = """\
version = 3
root = '/var/lib/containerd'
state = '/run/containerd'

[grpc]
  address = '/run/containerd/containerd.sock'

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'

  [plugins.'io.containerd.cri.v1.runtime']
    enable_selinux = false

    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'

      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes]
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
          runtime_type = 'io.containerd.runc.v2'

          [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
            SystemdCgroup = false

  [plugins.'io.containerd.grpc.v1.cri']
    disable_tcp_service = true
"""


def test_a_version_3_config_of_containerd_2_gets_its_entry_under_the_cri_runtime_plugin(
    tmp_path: Path,
) -> None:
    """containerd 2.x cannot run here (Debian ships 1.6/1.7): the result is checked against
    its documented format, as its own TOML parser (go-toml v2) would read it."""
    config = tmp_path / "config.toml"
    config.write_text(CONTAINERD_2_DEFAULT)
    planned = shim.install_node(
        config, tmp_path / "bin", Path("/etc/stasis/config.toml"), dry_run=True
    )
    assert "config version 3" in planned[1]
    shim.install_node(config, tmp_path / "bin", Path("/etc/stasis/config.toml"))
    data = tomllib.loads(config.read_text())
    assert data["version"] == 3
    runtimes = data["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    assert runtimes["stasis"] == {"runtime_type": shim.RUNTIME_TYPE}
    assert runtimes["runc"]["options"] == {"SystemdCgroup": False}  # untouched
    assert "stasis" not in str(data["plugins"]["io.containerd.grpc.v1.cri"])
    # Asked for version 2 of a version 3 file: refused, nothing written.
    other = tmp_path / "other.toml"
    other.write_text(CONTAINERD_2_DEFAULT)
    with pytest.raises(ContainerError, match="is a version 3 containerd config, not 2"):
        shim.install_node(
            other, tmp_path / "bin2", Path("/etc/stasis/config.toml"), config_version=2
        )
    assert other.read_text() == CONTAINERD_2_DEFAULT
    shim.uninstall_node(config, tmp_path / "bin")
    assert config.read_text() == CONTAINERD_2_DEFAULT
    # A new file for containerd 2.x, when asked.
    new = tmp_path / "new" / "config.toml"
    shim.install_node(new, tmp_path / "bin", Path("/etc/stasis/config.toml"), config_version=3)
    assert (
        tomllib.loads(new.read_text())["plugins"]["io.containerd.cri.v1.runtime"]["containerd"][
            "runtimes"
        ]["stasis"]["runtime_type"]
        == shim.RUNTIME_TYPE
    )
    shim.uninstall_node(new, tmp_path / "bin")
    assert not new.exists() and not (new.parent / ".stasis-created").exists()


def test_a_version_2_config_is_read_back_by_containerd_s_own_parser(tmp_path: Path) -> None:
    """The containerd here (1.6) reads what stasis writes for version 2, default and new."""
    config = tmp_path / "config.toml"
    shim.install_node(config, tmp_path / "bin", Path("/etc/stasis/config.toml"), config_version=2)
    r = subprocess.run(
        ["containerd", "--config", str(config), "config", "dump"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    dumped = tomllib.loads(r.stdout)
    assert (
        dumped["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["stasis"][
            "runtime_type"
        ]
        == shim.RUNTIME_TYPE
    )


@pytest.mark.parametrize("name,version", [("config.toml.tmpl", 2), ("config-v3.toml.tmpl", 3)])
def test_k3s_and_rke2_templates_keep_their_base_and_get_the_entry(
    tmp_path: Path, name: str, version: int
) -> None:
    """k3s and RKE2 write containerd's config.toml anew at each start, from this template:
    a new one starts with their base config, an existing one is kept as it is."""
    template = tmp_path / "agent" / "etc" / "containerd" / name
    shim.install_node(template, tmp_path / "bin", Path("/etc/stasis/config.toml"))
    text = template.read_text()
    assert text.startswith('{{ template "base" . }}\n')
    plugin = shim.CRI_PLUGIN[version]
    body = "\n".join(line for line in text.splitlines() if "{{" not in line)
    assert tomllib.loads(body)["plugins"][plugin]["containerd"]["runtimes"]["stasis"]
    shim.uninstall_node(template, tmp_path / "bin")
    assert not template.exists()
    # A site's own template: kept byte for byte.
    own = (
        '{{ template "base" . }}\n[plugins."%s".containerd.runtimes.gvisor]\n'
        '  runtime_type = "io.containerd.runsc.v1"\n' % plugin
    )
    template.write_text(own)
    shim.install_node(template, tmp_path / "bin", Path("/etc/stasis/config.toml"))
    assert template.read_text().startswith(own) and "stasis" in template.read_text()
    shim.uninstall_node(template, tmp_path / "bin")
    assert template.read_text() == own


def test_only_the_commands_that_can_concern_stasis_start_stasis_runc(tmp_path: Path) -> None:
    real = tmp_path / "real-runc"
    real.write_text('#!/bin/sh\necho "runc $*"\n')
    real.chmod(0o755)
    script = tmp_path / "runc"
    script.write_text(shim._dispatcher(str(real), shim._wrapper()))
    script.chmod(0o755)

    def run(*args: str) -> str:
        return subprocess.run(
            [str(script), *args], capture_output=True, text=True, check=False
        ).stdout

    # Straight to runc, the value of --root never taken for a command.
    assert run("--root", "kill", "state", "c1") == "runc --root kill state c1\n"
    assert run("--log=/l", "ps", "c1") == "runc --log=/l ps c1\n"
    assert run("--version") == "runc --version\n"
    assert (
        "stasis-runc" in script.read_text().split("create|start|kill|delete", 1)[1].splitlines()[0]
    )
