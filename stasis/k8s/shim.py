"""How a node's containerd gets the stasis runtime: one function writes it for the node agent
and for `stasis-dev local-node`, so that tests run exactly what nodes run.

    <bin>/containerd-shim-stasis-v2    containerd's own runc shim (containerd-shim-runc-v2),
                                       started with <bin>/runc-wrapper first on its PATH and
                                       STASIS_CONFIG set: containerd finds it by the runtime
                                       type io.containerd.stasis.v2
    <bin>/runc-wrapper/runc            stasis-runc (stasis.k8s.runtime)

and the CRI runtime entry `stasis` (the handler of RuntimeClass `stasis`) in containerd's
config.toml names that runtime type. containerd 1.x reads config version 2, where the CRI plugin
is `io.containerd.grpc.v1.cri`; containerd 2.x writes version 3, where the runtimes moved to the
plugin `io.containerd.cri.v1.runtime` (it still reads version 2 and migrates it in memory). k3s
and RKE2 make their containerd's config.toml anew at each start from a Go template
(config.toml.tmpl, config-v3.toml.tmpl): the entry goes there, after the template's
`{{ template "base" . }}`.
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


# The CRI plugin whose `containerd.runtimes` table holds the runtime entries, by config version.
CRI_PLUGIN = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
# What k3s's and RKE2's templates start with to keep the config they would have written.
_K3S_BASE = '{{ template "base" . }}\n'


def cri_runtime_entry(version: int = 2) -> str:
    """The lines of containerd's config.toml (version 2 or 3) that make `stasis` a CRI
    handler."""
    return (
        f'[plugins."{CRI_PLUGIN[version]}".containerd.runtimes.{HANDLER}]\n'
        f'  runtime_type = "{RUNTIME_TYPE}"\n'
    )


def _runc_shim() -> str:
    for candidate in ("/usr/bin/containerd-shim-runc-v2", "/usr/local/bin/containerd-shim-runc-v2"):
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("containerd-shim-runc-v2")
    if not found:
        raise ContainerError(
            "containerd-shim-runc-v2 is not installed: apt-get install " "containerd"
        )
    return found


def _wrapper() -> str:
    script = Path(sys.executable).parent / "stasis-runc"
    if not script.exists():
        raise ContainerError(f"{script} is missing: run `make install`")
    return str(script)


def _dispatcher(real_runc: str, wrapper: str) -> str:
    """The `runc` the shim runs: the shim calls runc for state, ps, exec, events... of every
    container on the node; only create, start, kill and delete can concern stasis, so only
    those pay for starting Python (stasis-runc), and the rest go to runc at once."""
    return (
        "#!/bin/sh\n"
        "# Written by stasis (stasis/k8s/shim.py): runc, with stasis-runc in front of it for\n"
        "# the commands that can concern a container with STASIS_CHECKPOINT.\n"
        "skip=0\n"
        'for a in "$@"; do\n'
        '    if [ "$skip" = 1 ]; then skip=0; continue; fi\n'
        '    case "$a" in\n'
        "        --log|--log-format|--root|--criu|--rootless) skip=1 ;;\n"
        "        -*) ;;\n"
        "        create|start|kill|delete) exec " + shlex.quote(wrapper) + ' "$@" ;;\n'
        "        *) break ;;\n"
        "    esac\n"
        "done\n"
        f'exec {shlex.quote(real_runc)} "$@"\n'
    )


def install(
    bin_dir: Path,
    stasis_config: Path,
    wrapper: str | None = None,
    node_runc: str | None = None,
    seen_as: Path | None = None,
) -> Path:
    """Write the shim and the runc wrapper into `bin_dir`; the shim's path. `wrapper`: the
    stasis-runc the node runs (default: this venv's); `node_runc`: the node's real runc (default:
    the config's, else the first found here); `seen_as`: the path the node knows `bin_dir`
    by (the agent sees the host's root mounted elsewhere)."""
    from stasis.config import load_settings
    from stasis.k8s.runc import real_runc

    wrapper_dir = bin_dir / "runc-wrapper"
    wrapper_dir.mkdir(parents=True, exist_ok=True)
    runc = wrapper_dir / "runc"
    settings = (
        load_settings({"STASIS_CONFIG": str(stasis_config)}) if stasis_config.exists() else None
    )
    tmp_runc = runc.with_name("runc.tmp")
    tmp_runc.unlink(missing_ok=True)
    tmp_runc.write_text(
        _dispatcher(
            node_runc or real_runc(settings.runc if settings else ""), wrapper or _wrapper()
        )
    )
    tmp_runc.chmod(0o755)
    tmp_runc.replace(runc)
    shim = bin_dir / SHIM_NAME
    tmp = shim.with_name(shim.name + ".tmp")
    tmp.write_text(
        "#!/bin/sh\n"
        "# Written by stasis (stasis/k8s/shim.py): containerd's runc shim with stasis-runc in\n"
        "# front of runc. Containers without STASIS_CHECKPOINT go to runc unchanged.\n"
        f"export STASIS_CONFIG={shlex.quote(str(stasis_config))}\n"
        f'export PATH={shlex.quote(str((seen_as or bin_dir) / "runc-wrapper"))}:"$PATH"\n'
        f"exec {shlex.quote(_runc_shim())} \"$@\"\n"
    )
    tmp.chmod(0o755)
    tmp.replace(shim)
    return shim


_BEGIN = "# --- stasis runtime (stasis k8s install-runtime; removed by uninstall-runtime) ---\n"
_END = "# --- end of stasis runtime ---\n"


def _block(version: int) -> str:
    return _BEGIN + cri_runtime_entry(version) + _END


def is_template(path: Path) -> bool:
    """k3s's and RKE2's config template (config.toml.tmpl, config-v3.toml.tmpl)."""
    return path.name.endswith(".tmpl")


def install_node(
    containerd_config: Path,
    bin_dir: Path,
    stasis_config: Path,
    dry_run: bool = False,
    wrapper: str | None = None,
    node_runc: str | None = None,
    seen_as: Path | None = None,
    config_version: int = 0,
) -> list[str]:
    """Put the stasis runtime on this node as the node agent does: the shim and runc wrapper
    in `bin_dir` (on containerd's PATH), the CRI runtime entry at the end of containerd's
    config (a marked block, so that uninstall gives the file back byte for byte). What was
    (or would be) changed; containerd reads its config again only when restarted.
    `config_version`: 2 or 3, what the config is (or a new one is to be); 0: the file's own
    `version` (2 for a new file, which containerd 1.x and 2.x both read)."""
    changes = [f"write {bin_dir / SHIM_NAME} and {bin_dir / 'runc-wrapper' / 'runc'}"]
    text = containerd_config.read_text() if containerd_config.exists() else ""
    version = 0
    if _BEGIN not in text:
        version = config_version_of(containerd_config, text, config_version)
        changes.append(
            f"append the runtime entry `{HANDLER}` (containerd config version "
            f"{version}) to {containerd_config}"
        )
    if dry_run:
        return changes
    install(bin_dir, stasis_config, wrapper, node_runc, seen_as)
    if _BEGIN not in text:
        base = text if text else _new_config(containerd_config, version)
        if not base.endswith("\n"):
            base += "\n"
        containerd_config.parent.mkdir(parents=True, exist_ok=True)
        tmp = containerd_config.with_name(containerd_config.name + ".stasis-tmp")
        tmp.write_text(base + _block(version))
        if containerd_config.exists():
            os.chmod(tmp, containerd_config.stat().st_mode & 0o7777)
        tmp.replace(containerd_config)
        if not text:
            (containerd_config.parent / ".stasis-created").write_text(containerd_config.name)
    return changes


def _new_config(path: Path, version: int) -> str:
    if is_template(path):
        # Without it, k3s would write only our entry: a containerd without its own settings.
        return _K3S_BASE
    return f"version = {version}\n"


def config_version_of(path: Path, text: str, wanted: int = 0) -> int:
    """The config version the runtime entry must be written for (2 or 3), after checking that
    the entry can go at the end of `text`; ContainerError (one line) otherwise."""
    import tomllib

    if wanted not in (0, 2, 3):
        raise ContainerError(
            f"containerd config version {wanted}: stasis writes 2 "
            "(containerd 1.x, also read by 2.x) or 3 (containerd 2.x)"
        )
    template = is_template(path)
    # A template's Go actions are not TOML; what k3s puts there is its own config.
    body = "\n".join(line for line in text.splitlines() if "{{" not in line) if template else text
    try:
        data = tomllib.loads(body)
    except tomllib.TOMLDecodeError as e:
        raise ContainerError(f"cannot read containerd's config {path}: {e}") from e
    found = data.get("version")
    if not text:
        found = None
    elif found is None and not template:
        # containerd reads a config without `version` as version 1: its plugin names differ.
        found = 1
    if found is None:  # a new file, or a template whose base holds the version
        version = wanted or (3 if template and "v3" in path.name else 2)
    elif found in (2, 3):
        if wanted and wanted != found:
            raise ContainerError(
                f"{path} is a version {found} containerd config, not {wanted}: set the "
                f"config version to {found} (the chart's containerd.configVersion, "
                f"--containerd-config-version), or leave it to the file (0)"
            )
        version = int(found)
    else:
        raise ContainerError(
            f"{path} is a version {found} containerd config: stasis writes versions 2 and 3; "
            "migrate it (`containerd config migrate`) or add the runtime entry by hand: "
            + cri_runtime_entry().replace("\n", " ")
        )
    runtimes = (
        data.get("plugins", {})
        .get(CRI_PLUGIN[version], {})
        .get("containerd", {})
        .get("runtimes", {})
    )
    if HANDLER in runtimes:
        raise ContainerError(
            f"{path} already has a runtime `{HANDLER}` that stasis did not "
            "write: remove it, then install again"
        )
    return version


# What install_node writes into a file it creates, besides the entry.
_CREATED_BASES = {"", "version = 2", "version = 3", _K3S_BASE.strip()}


def uninstall_node(containerd_config: Path, bin_dir: Path) -> list[str]:
    """What install_node put there, taken away (containerd's config byte for byte as it was,
    or gone when install_node made it); what was removed."""
    changes = []
    for path in (bin_dir / SHIM_NAME, bin_dir / "runc-wrapper" / "runc"):
        if path.exists() or path.is_symlink():
            path.unlink()
            changes.append(f"remove {path}")
    try:
        (bin_dir / "runc-wrapper").rmdir()
    except OSError:
        pass  # not there, or not empty: someone else's files
    if containerd_config.exists():
        text = containerd_config.read_text()
        if _BEGIN in text:
            head, _, rest = text.partition(_BEGIN)
            _, _, tail = rest.partition(_END)
            created = containerd_config.parent / ".stasis-created"
            if created.exists() and (head + tail).strip() in _CREATED_BASES:
                containerd_config.unlink()
                created.unlink()
            else:
                tmp = containerd_config.with_name(containerd_config.name + ".stasis-tmp")
                tmp.write_text(head + tail)
                os.chmod(tmp, containerd_config.stat().st_mode & 0o7777)
                tmp.replace(containerd_config)
            changes.append(f"remove the runtime entry `{HANDLER}` from {containerd_config}")
    return changes
