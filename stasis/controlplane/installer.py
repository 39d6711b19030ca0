"""What the control plane serves to install nodes: the Slurm installer script (GET
/install/slurm), the wheel of the stasis it runs itself (GET /install/stasis.whl), and `stasis
controlplane join`, which the script runs to put the control plane's settings into the node
daemon's config file.

    curl -fsSL "$URL/install/slurm" -H "Authorization: Bearer $TOKEN" | sudo -E bash -s -- \\
        --node-role worker [any `stasis slurm install` option]

The script installs stasis into a virtual environment (STASIS_PREFIX, default /opt/stasis) from
that wheel (its dependencies from the node's package index), builds the jobs' init
(stasis-init) if it is missing, writes `controlplane_url`, `cluster_id`, `auth_token` and
`node` into the daemon's config file (STASIS_CONFIG, default /etc/stasis/config.toml, 0600),
runs `stasis slurm install` with the arguments it was given, restarts the daemon where systemd
runs, and ends with `stasis check`. CRIU itself is not installed by it (`stasis check` says when
it is missing: scripts/install-criu.sh builds it)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from stasis.errors import UsageError

_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".so.tmp")


def version() -> str:
    return metadata.version("stasis")


def wheel_name() -> str:
    return f"stasis-{version()}-py3-none-any.whl"


def build_wheel(cache_dir: Path) -> Path:
    """The wheel of the stasis this process runs (its package files as installed, generated
    CRIU RPC classes included, and its metadata: the dependencies pip installs with it). Built
    once per version into `cache_dir`."""
    cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(cache_dir, 0o700)  # what nodes install and run as root: nobody else's to write
    dest = cache_dir / wheel_name()
    if dest.exists():
        return dest
    import stasis

    package = Path(stasis.__file__).parent
    dist = metadata.distribution("stasis")
    info = f"stasis-{version()}.dist-info"
    entries: list[tuple[str, bytes]] = []
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package.parent)
        if path.is_dir() or _SKIP_DIRS & set(rel.parts) or path.name.endswith(_SKIP_SUFFIXES):
            continue
        entries.append((rel.as_posix(), path.read_bytes()))
    meta = dist.read_text("METADATA") or dist.read_text("PKG-INFO")  # a wheel's, an egg's
    if not meta:
        raise UsageError("this stasis has no package metadata to build a wheel from")
    entries.append((f"{info}/METADATA", meta.encode()))
    entries.append((f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: stasis\n"
                                     b"Root-Is-Purelib: true\nTag: py3-none-any\n"))
    points = dist.read_text("entry_points.txt")
    if points:
        entries.append((f"{info}/entry_points.txt", points.encode()))
    record = "".join(f"{name},sha256={_digest(data)},{len(data)}\n" for name, data in entries)
    record += f"{info}/RECORD,,\n"
    entries.append((f"{info}/RECORD", record.encode()))
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".part")
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for name, data in entries:
                z.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data,
                           zipfile.ZIP_DEFLATED)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slurm_script(url: str, cluster_id: str, cluster_name: str, token: str) -> str:
    """The installer a node pipes into `sudo -E bash -s -- --node-role ROLE ...`."""
    q = shlex.quote
    return _SCRIPT.replace("@URL@", q(url)).replace("@CLUSTER_ID@", q(cluster_id)) \
        .replace("@CLUSTER@", q(cluster_name)).replace("@TOKEN@", q(token)) \
        .replace("@VERSION@", q(version())).replace("@WHEEL@", q(wheel_name()))


_SCRIPT = r"""#!/usr/bin/env bash
# The stasis installer for a node of Slurm cluster @CLUSTER@, from its control plane:
#   curl -fsSL "$URL/install/slurm" -H "Authorization: Bearer $TOKEN" | sudo -E bash -s -- \
#       --node-role worker [--slurm-conf PATH] [any other `stasis slurm install` option]
# STASIS_PREFIX: where stasis goes (a venv, default /opt/stasis); STASIS_CONFIG: the node
# daemon's config file (default /etc/stasis/config.toml); STASIS_NODE_NAME: this node's name in
# the control plane (default: the host name).
set -euo pipefail
STASIS_INSTALL_TOKEN=@TOKEN@
url=@URL@
cluster_id=@CLUSTER_ID@
want=@VERSION@
wheel=@WHEEL@
prefix="${STASIS_PREFIX:-/opt/stasis}"
config="${STASIS_CONFIG:-/etc/stasis/config.toml}"
node="${STASIS_NODE_NAME:-$(hostname)}"
say() { echo "stasis-install: $*" >&2; }
if [ "$(id -u)" -ne 0 ]; then
    say "run as root: ... | sudo -E bash -s -- --node-role worker"; exit 2
fi
if [ "$#" -eq 0 ]; then
    say "say what this node is: ... | sudo -E bash -s -- --node-role worker"; exit 2
fi
if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    if command -v apt-get >/dev/null; then
        say "installing python3 and python3-venv"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3 python3-venv >&2
    else
        say "python3 with venv is needed"; exit 2
    fi
fi
have=""
if [ -x "$prefix/bin/python" ]; then
    have="$("$prefix/bin/python" -c 'import importlib.metadata as m; print(m.version("stasis"))' \
            2>/dev/null || true)"
fi
if [ "$have" != "$want" ]; then
    say "installing stasis $want into $prefix"
    [ -x "$prefix/bin/python" ] || python3 -m venv "$prefix"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    curl -fsS -o "$tmp/$wheel" -H "Authorization: Bearer $STASIS_INSTALL_TOKEN" \
        "$url/install/stasis.whl"
    "$prefix/bin/pip" install -q --disable-pip-version-check "$tmp/$wheel" >&2
else
    say "stasis $want is installed in $prefix already"
fi
init=/usr/local/libexec/stasis/stasis-init
if [ ! -x "$init" ]; then
    src="$("$prefix/bin/python" -c 'import stasis, pathlib
print(pathlib.Path(stasis.__file__).parent / "daemon" / "stasis-init.c")')"
    if command -v gcc >/dev/null; then
        say "building the jobs' init $init"
        mkdir -p "$(dirname "$init")"
        gcc -O2 -static -o "$init" "$src"
    else
        say "warning: no gcc to build $init from $src: jobs cannot be protected until it is there"
    fi
fi
STASIS_AUTH_TOKEN="$STASIS_INSTALL_TOKEN" "$prefix/bin/stasis" controlplane join \
    --config "$config" --url "$url" --cluster-id "$cluster_id" --node "$node"
args=("$@")
case " $* " in *" --stasis-config "*) ;; *) args+=(--stasis-config "$config") ;; esac
"$prefix/bin/stasis" slurm install "${args[@]}"
if [ -d /run/systemd/system ] && [ -f /etc/systemd/system/stasis.service ]; then
    systemctl daemon-reload
    systemctl enable -q stasis.service
    systemctl restart stasis.service
    say "the node daemon (stasis.service) restarted: it joins the control plane at $url"
else
    say "no systemd here: (re)start the node daemon:" \
        "STASIS_CONFIG=$config $prefix/bin/stasis daemon"
fi
say "apply the Slurm side with: scontrol reconfigure"
STASIS_CONFIG="$config" "$prefix/bin/stasis" check >&2 ||
    say "warning: stasis check found problems (above)"
"""


def join(config: Path, url: str, cluster_id: str, token: str, node: str | None) -> list[str]:
    """Put the control plane's settings into the daemon's config file `config` (created 0600;
    other keys kept); the keys written."""
    import tomllib

    values: dict[str, object] = {}
    if config.exists():
        try:
            values = tomllib.loads(config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise UsageError(f"cannot read the config file {config}: {e}") from None
    new: dict[str, object] = {"controlplane_url": url, "cluster_id": cluster_id,
                              "auth_token": token}
    if node:
        new["node_name"] = node
    values.update(new)
    lines = []
    for key, value in values.items():
        if isinstance(value, dict):
            raise UsageError(f"config file {config} has a table [{key}]: add the control "
                             "plane's settings to it by hand")
        lines.append(f"{key} = {_toml(value)}")
    config.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=config.parent, prefix=".config-")
    try:
        with os.fdopen(fd, "w") as f:  # mkstemp: 0600, and it holds the token
            f.write("# the control plane's settings written by `stasis controlplane join`\n")
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, config)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return sorted(new)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise UsageError(f"cannot write {value!r} into a config file")
