"""What the control plane serves to install nodes: the Slurm installer script (GET
/install/slurm), the wheel of the stasis it runs itself (GET /install/stasis.whl), and `stasis
controlplane join`, which the script runs to put the control plane's settings into the node
daemon's config file.

    (umask 077; printf 'Authorization: Bearer %s\\n' "$TOKEN" > /root/stasis-auth)
    curl -fsSL -H @/root/stasis-auth "$URL/install/slurm" | sudo -E bash -s -- \\
        --node-role worker [any `stasis slurm install` option]

(the token in a header file, not on curl's command line, which every user of the node can read
in /proc). The script refuses a plain http:// URL to a host off loopback unless
STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP=1 (then the node's config allows it too). It installs
stasis into a virtual environment (STASIS_PREFIX, default /opt/stasis) from that wheel, checked
against the SHA-256 the control plane wrote into the script before pip sees it (its
dependencies come from the node's package index, unpinned), builds the jobs' init
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
import re
import shlex
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from stasis.controlplane import routes
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
    entries.append(
        (
            f"{info}/WHEEL",
            b"Wheel-Version: 1.0\nGenerator: stasis\n"
            b"Root-Is-Purelib: true\nTag: py3-none-any\n",
        )
    )
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
                z.writestr(
                    zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)),
                    data,
                    zipfile.ZIP_DEFLATED,
                )
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slurm_script(
    url: str, cluster_id: str, cluster_name: str, token: str, wheel_sha256: str
) -> str:
    """The installer a node pipes into `sudo -E bash -s -- --node-role ROLE ...`: it installs
    only a wheel whose SHA-256 is `wheel_sha256`, and never puts `token` on a command line."""
    q = shlex.quote
    # One pass: a value holding another's @NAME@ must not be substituted again.
    values = {
        "URL": url,
        "CLUSTER_ID": cluster_id,
        "CLUSTER": cluster_name,
        "TOKEN": token,
        "VERSION": version(),
        "WHEEL": wheel_name(),
        "WHEEL_SHA256": wheel_sha256,
        "SLURM_PATH": routes.INSTALL_SLURM.path,
        "WHEEL_PATH": routes.INSTALL_WHEEL.path,
    }
    return re.sub(r"@([A-Z_0-9]+)@", lambda m: q(values[m.group(1)]), _SCRIPT)


_SCRIPT = r"""#!/usr/bin/env bash
# The stasis installer for a node of Slurm cluster @CLUSTER@, from its control plane:
#   (umask 077; printf 'Authorization: Bearer %s\n' "$TOKEN" > /root/stasis-auth)
#   curl -fsSL -H @/root/stasis-auth "$URL"@SLURM_PATH@ | sudo -E bash -s -- \
#       --node-role worker [--slurm-conf PATH] [any other `stasis slurm install` option]
# STASIS_PREFIX: where stasis goes (a venv, default /opt/stasis); STASIS_CONFIG: the node
# daemon's config file (default /etc/stasis/config.toml); STASIS_NODE_NAME: this node's name in
# the control plane (default: the host name); STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP=1: accept a
# plain http:// control plane off loopback (its token crosses the network in the clear).
# The token is never put on a command line (other users read those in /proc): curl reads it
# from a header file, `stasis controlplane join` from its environment.
set -euo pipefail
STASIS_INSTALL_TOKEN=@TOKEN@
url=@URL@
cluster_id=@CLUSTER_ID@
want=@VERSION@
wheel=@WHEEL@
wheel_sha256=@WHEEL_SHA256@
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
plain=()
case "${STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP:-}" in
    1|[Tt]rue|TRUE|[Yy]es|YES|[Oo]n|ON) plain=(--allow-plain-http) ;;
esac
case "$url" in
    https://*) ;;
    http://*)
        host="${url#http://}"; host="${host%%/*}"; host="${host##*@}"; host="${host,,}"
        case "$host" in
            \[*) host="${host%%]*}]" ;;
            *) host="${host%%:*}" ;;
        esac
        if ! [[ "$host" =~ ^(localhost|127\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}|\[::1\])$ ]] &&
                [ "${#plain[@]}" -eq 0 ]; then
            say "refused to install from $url: plain http:// to $host, not this host's" \
                "loopback, sends the cluster's token in the clear (fetching this script just" \
                "did: rotate it); use https://, or STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP=1 on a" \
                "network you trust"
            exit 2
        fi ;;
    *) say "refused control plane URL $url: not https:// or http://"; exit 2 ;;
esac
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# printf is bash's own: the token goes into a 0600 file (in a 0700 directory) without an exec
# of its own. Only here umask 077: what the rest installs, users' jobs must read.
(umask 077; printf 'Authorization: Bearer %s\n' "$STASIS_INSTALL_TOKEN" > "$tmp/auth")
# Python runs isolated (-I) throughout: root must not import from the directory this was
# started in, which may be anyone's.
if ! command -v python3 >/dev/null || ! python3 -I -c 'import venv, ensurepip' 2>/dev/null; then
    if command -v apt-get >/dev/null; then
        say "installing python3 and python3-venv"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3 python3-venv >&2
    else
        say "python3 with venv is needed"; exit 2
    fi
fi
have=""
if [ -x "$prefix/bin/python" ]; then
    have="$("$prefix/bin/python" -I -c \
            'import importlib.metadata as m; print(m.version("stasis"))' 2>/dev/null || true)"
fi
if [ "$have" != "$want" ]; then
    say "installing stasis $want into $prefix"
    curl -fsS -o "$tmp/$wheel" -H @"$tmp/auth" "$url"@WHEEL_PATH@
    got="$(sha256sum "$tmp/$wheel")"; got="${got%% *}"
    if [ "$got" != "$wheel_sha256" ]; then
        say "refused $wheel: its sha256 $got is not $wheel_sha256, the one this installer" \
            "names (changed on the way, or the control plane was upgraded meanwhile);" \
            "nothing installed: fetch the installer again, over https://"
        exit 3
    fi
    [ -x "$prefix/bin/python" ] || python3 -I -m venv "$prefix"
    "$prefix/bin/pip" install -q --disable-pip-version-check "$tmp/$wheel" >&2
else
    say "stasis $want is installed in $prefix already"
fi
# Where `make install` and the node package put it too: CRIU restores a job's init by path.
init=/usr/libexec/stasis/stasis-init
if [ ! -x "$init" ]; then
    src="$("$prefix/bin/python" -I -c 'import stasis, pathlib
print(pathlib.Path(stasis.__file__).parent / "daemon" / "stasis-init.c")')"
    if command -v gcc >/dev/null; then
        say "building the jobs' init $init"
        mkdir -p "$(dirname "$init")"
        gcc -O2 -static -o "$init" "$src"
    else
        say "warning: no gcc to build $init from $src: jobs cannot be protected until it is there"
    fi
fi
# The config file may not exist yet: join writes it, and reads no settings but the token.
STASIS_CONFIG=/dev/null STASIS_AUTH_TOKEN="$STASIS_INSTALL_TOKEN" "$prefix/bin/stasis" \
    controlplane join \
    --config "$config" --url "$url" --cluster-id "$cluster_id" --node "$node" "${plain[@]}"
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


def join(
    config: Path,
    url: str,
    cluster_id: str,
    token: str,
    node: str | None,
    allow_plain_http: bool = False,
) -> list[str]:
    """Put the control plane's settings into the daemon's config file `config` (created 0600;
    other keys kept); the keys written."""
    import tomllib

    values: dict[str, object] = {}
    if config.exists():
        try:
            values = tomllib.loads(config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise UsageError(f"cannot read the config file {config}: {e}") from None
    new: dict[str, object] = {
        "controlplane_url": url,
        "cluster_id": cluster_id,
        "auth_token": token,
    }
    if node:
        new["node_name"] = node
    if allow_plain_http:
        new["controlplane_allow_plain_http"] = True
    values.update(new)
    lines = []
    for key, value in values.items():
        if isinstance(value, dict):
            raise UsageError(
                f"config file {config} has a table [{key}]: add the control "
                "plane's settings to it by hand"
            )
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
