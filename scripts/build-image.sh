#!/usr/bin/env bash
# build-image.sh [OUT]: the node agent's container image (`make image`), as an OCI image archive
# (default build/stasis-agent-VERSION.oci.tar, named stasis/agent:VERSION), from Debian
# packages only: no registry is pulled from.
#
#  1. The node packages, stasis and stasis-criu (scripts/build-deb.sh, as `make deb` builds
#     them: stasis in /opt/stasis/venv, our CRIU as /usr/sbin/criu, stasis-init).
#  2. A Debian root (debootstrap --variant=minbase, the suite of this machine, from the mirror
#     its apt uses), built once into build/image/base-SUITE and copied for every build, with
#     what the two packages depend on (their Depends fields), containerd's ctr (exit events)
#     and ca-certificates.
#  3. The two packages installed in it by dpkg, as on a node (no systemd runs there: the unit
#     is enabled, never started).
#  4. Packed by stasis.k8s.image (run by the image's own /opt/stasis/venv): one gzip layer,
#     entrypoint `stasis`, command `k8s agent`.
# Run as root (debootstrap, chroot) with what build-deb.sh needs (our CRIU built, the RPC
# classes): `make image` provides them; it needs neither `make install` nor its venv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ "$(id -u)" = 0 ] || { echo "build-image: run as root (debootstrap, chroot)" >&2; exit 2; }
version=$(/usr/bin/python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
suite=$(. /etc/os-release && echo "$VERSION_CODENAME")
out=${1:-build/stasis-agent-$version.oci.tar}
work=build/image
base=$work/base-$suite
root=$work/root
mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$mirror" ] || { echo "build-image: no Debian mirror in apt's sources" >&2; exit 2; }
command -v debootstrap >/dev/null || bash scripts/apt-install.sh build-image debootstrap

debs=$work/debs
rm -rf "$debs"
bash scripts/build-deb.sh "$debs" | sed 's/^/build-image: /'
# What the packages depend on, as package names (versions are this suite's own).
depends=$(for d in "$debs"/*.deb; do dpkg-deb -f "$d" Depends; done | tr ',' '\n' |
    sed 's/^ *//; s/[ (].*//' | grep -v '^stasis' | grep . | sort -u | paste -sd, -)
include="containerd,ca-certificates,$depends"

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

mkdir -p "$root/tmp/debs"
cp "$debs"/*.deb "$root/tmp/debs/"
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    dpkg -i $(cd "$root" && ls tmp/debs/*.deb | sed 's#^#/#') > "$work/dpkg.log" 2>&1 || {
    tail -20 "$work/dpkg.log" >&2
    echo "build-image: dpkg -i of the node packages failed (log: $work/dpkg.log)" >&2; exit 1; }
rm -rf "$root/tmp/debs" "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/* \
    "$root"/var/cache/apt/*.bin "$root"/var/log/*.log "$root"/root/.cache
mkdir -p "$root/var/lib/stasis" "$root/run/stasis"

mkdir -p "$(dirname "$out")"
# Packed by the stasis the image holds (-I -B: nothing of this machine's environment, nothing
# written into the root).
"$root/opt/stasis/venv/bin/python" -I -B -m stasis.k8s.image "$root" "$out" "stasis/agent:$version" \
    --version "$version"
