#!/usr/bin/env bash
# build-image.sh [OUT]: the node agent's container image (`make image`), as an OCI image archive
# (default build/stasis-agent-VERSION.oci.tar, named stasis/agent:VERSION), from Debian
# packages and this repository only: no registry is pulled from.
#
#  1. A Debian root (debootstrap --variant=minbase, the suite of this machine, from the mirror
#     its apt uses), built once into build/image/base-SUITE and copied for every build, with
#     Python, iptables (CRIU's network lock), containerd's ctr (exit events), tini, and the libraries
#     this machine's CRIU links (found with ldd and dpkg -S).
#  2. This machine's CRIU (scripts/install-criu.sh: 4.2 with our patches) and stasis-init.
#  3. stasis in /opt/stasis/venv: its wheel and the pinned dependencies' wheels built here
#     (pip, the same index `make install` uses), installed in the root without an index.
#  4. Packed by stasis.k8s.image: one gzip layer, entrypoint `stasis`, command `k8s agent`.
# Run as root (debootstrap, chroot) after `make install`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ "$(id -u)" = 0 ] || { echo "build-image: run as root (debootstrap, chroot)" >&2; exit 2; }
[ -x .venv/bin/python ] && [ -x /usr/local/sbin/criu ] || {
    echo "build-image: run \`make install\` first (the venv and CRIU go into the image)" >&2
    exit 2; }
version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("stasis"))')
suite=$(. /etc/os-release && echo "$VERSION_CODENAME")
out=${1:-build/stasis-agent-$version.oci.tar}
work=build/image
base=$work/base-$suite
root=$work/root
mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$mirror" ] || { echo "build-image: no Debian mirror in apt's sources" >&2; exit 2; }
command -v debootstrap >/dev/null || bash scripts/apt-install.sh build-image debootstrap

# The Debian packages of the libraries CRIU links, as this machine has them.
criu_libs=$(ldd /usr/local/sbin/criu | awk '/=> \//{print $3}' | while read -r f; do
    dpkg -S "$f" 2>/dev/null || dpkg -S "$(realpath "$f")" 2>/dev/null || true
done | cut -d: -f1 | sort -u | paste -sd, -)
include="python3,python3-venv,iptables,containerd,tini,util-linux,ca-certificates,$criu_libs"

mkdir -p "$work"
if [ ! -f "$base/.complete" ] || [ "$(cat "$base/.complete")" != "$include" ]; then
    rm -rf "$base"
    echo "build-image: debootstrap $suite from $mirror"
    debootstrap --variant=minbase --include="$include" "$suite" "$base" "$mirror" \
        > "$work/debootstrap.log" 2>&1 || {
        tail -20 "$work/debootstrap.log" >&2
        echo "build-image: debootstrap failed (log: $work/debootstrap.log)" >&2; exit 1; }
    rm -rf "$base"/var/cache/apt/archives/*.deb "$base"/var/lib/apt/lists/*
    echo "$include" > "$base/.complete"
fi
rm -rf "$root"
cp -a "$base" "$root"
rm -f "$root/.complete"

install -D -m 0755 /usr/local/sbin/criu "$root/usr/local/sbin/criu"
install -D -m 0644 /usr/local/share/criu/rpc.proto "$root/usr/local/share/criu/rpc.proto"
[ -f /usr/local/share/stasis/criu.stamp ] &&
    install -D -m 0644 /usr/local/share/stasis/criu.stamp "$root/usr/local/share/stasis/criu.stamp"
install -D -m 0755 /usr/local/libexec/stasis/stasis-init "$root/usr/local/libexec/stasis/stasis-init"

wheels=$root/tmp/wheels
mkdir -p "$wheels"
echo "build-image: wheels of stasis $version and its dependencies"
.venv/bin/pip wheel -q -w "$wheels" . 2> >(grep -v "^WARNING: Location" >&2)
chroot "$root" /usr/bin/python3 -m venv /opt/stasis/venv
PIP_CONFIG_FILE=/dev/null chroot "$root" /opt/stasis/venv/bin/pip install -q --no-index --find-links /tmp/wheels stasis
chroot "$root" /opt/stasis/venv/bin/python -m compileall -q /opt/stasis/venv/lib
rm -rf "$wheels" "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/* \
    "$root"/var/cache/apt/*.bin "$root"/var/log/*.log "$root"/root/.cache
mkdir -p "$root/etc/stasis" "$root/var/lib/stasis" "$root/run/stasis"

mkdir -p "$(dirname "$out")"
.venv/bin/python -m stasis.k8s.image "$root" "$out" "stasis/agent:$version" --version "$version"
