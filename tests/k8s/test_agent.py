"""The node agent's host install: the runtime into the host's root as the pod mounts it, and
containerd restarted only when its config was changed. (Its watches, taint, cordon, by-hand and
interval checkpoints: tests/e2e/test_k8s_agent.py, against kmock and a real containerd.)"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from stasis.errors import ContainerError
from stasis.k8s import shim
from stasis.k8s.agent import HostInstall, install_runtime


def test_the_runtime_goes_into_the_host_root_and_containerd_restarts_once(tmp_path: Path
                                                                          ) -> None:
    host = tmp_path / "host"
    (host / "etc" / "containerd").mkdir(parents=True)
    (host / "etc" / "containerd" / "config.toml").write_text("version = 2\n")
    marker = tmp_path / "restarted"
    where = HostInstall(root=host, restart_containerd=("sh", "-c", f"echo x >> {marker}"))
    changes = install_runtime(where)
    assert any("runtime entry" in c for c in changes)
    config = tomllib.loads((host / "etc" / "containerd" / "config.toml").read_text())
    assert config["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"][
        "stasis"]["runtime_type"] == shim.RUNTIME_TYPE
    # The scripts name the host's paths, not the pod's.
    script = (host / "usr" / "local" / "bin" / shim.SHIM_NAME).read_text()
    assert "STASIS_CONFIG=/etc/stasis/config.toml" in script
    assert marker.read_text() == "x\n"
    # The agent started again (a new pod): nothing to restart for.
    install_runtime(where)
    assert marker.read_text() == "x\n"


def test_a_failed_containerd_restart_is_one_clear_error(tmp_path: Path) -> None:
    where = HostInstall(root=tmp_path, restart_containerd=("sh", "-c", "echo no unit >&2; "
                                                                       "exit 5"))
    with pytest.raises(ContainerError, match=r"restarting containerd \(sh -c .*\) failed: "
                                             r"no unit$"):
        install_runtime(where)
