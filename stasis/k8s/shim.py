"""How a node's containerd gets the stasis runtime: one function writes it for the node agent
and for `stasis k8s local-node`, so that tests run exactly what nodes run.

    <bin>/containerd-shim-stasis-v2    containerd's own runc shim (containerd-shim-runc-v2),
                                       started with <bin>/runc-wrapper first on its PATH and
                                       STASIS_CONFIG set: containerd finds it by the runtime
                                       type io.containerd.stasis.v2
    <bin>/runc-wrapper/runc            stasis-runc (stasis.k8s.runtime)

and the CRI runtime entry `stasis` (the handler of RuntimeClass `stasis`) in containerd's
config.toml names that runtime type.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from stasis.errors import ContainerError

RUNTIME_TYPE = "io.containerd.stasis.v2"
HANDLER = "stasis"
SHIM_NAME = "containerd-shim-stasis-v2"


def cri_runtime_entry() -> str:
    """The lines of containerd's config.toml (version 2) that make `stasis` a CRI handler."""
    return (
        f'[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{HANDLER}]\n'
        f'  runtime_type = "{RUNTIME_TYPE}"\n'
    )


def _runc_shim() -> str:
    for candidate in ("/usr/bin/containerd-shim-runc-v2", "/usr/local/bin/containerd-shim-runc-v2"):
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("containerd-shim-runc-v2")
    if not found:
        raise ContainerError("containerd-shim-runc-v2 is not installed: apt-get install "
                             "containerd")
    return found


def _wrapper() -> str:
    script = Path(sys.executable).parent / "stasis-runc"
    if not script.exists():
        raise ContainerError(f"{script} is missing: run `make install`")
    return str(script)


def install(bin_dir: Path, stasis_config: Path) -> Path:
    """Write the shim and the runc wrapper into `bin_dir`; the shim's path."""
    wrapper_dir = bin_dir / "runc-wrapper"
    wrapper_dir.mkdir(parents=True, exist_ok=True)
    runc = wrapper_dir / "runc"
    runc.unlink(missing_ok=True)
    runc.symlink_to(_wrapper())
    shim = bin_dir / SHIM_NAME
    tmp = shim.with_name(shim.name + ".tmp")
    tmp.write_text(
        "#!/bin/sh\n"
        "# Written by stasis (stasis/k8s/shim.py): containerd's runc shim with stasis-runc in\n"
        "# front of runc. Containers without STASIS_CHECKPOINT go to runc unchanged.\n"
        f"export STASIS_CONFIG={shlex.quote(str(stasis_config))}\n"
        f'export PATH={shlex.quote(str(wrapper_dir))}:"$PATH"\n'
        f"exec {shlex.quote(_runc_shim())} \"$@\"\n"
    )
    tmp.chmod(0o755)
    tmp.replace(shim)
    return shim
