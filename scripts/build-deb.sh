#!/usr/bin/env bash
# build-deb.sh [OUTDIR]: the node packages (`make deb`), for the Debian release and architecture
# of this machine, into OUTDIR (default build/):
#
#   stasis_VERSION_ARCH.deb       stasis in /opt/stasis/venv (a venv of Debian's python3.X with
#                                 the pinned runtime dependencies of pyproject.toml: no dev extras,
#                                 no stasis/dev), stasis-init (built as `make install` builds
#                                 it; the postinst puts it where `make install` does,
#                                 /usr/libexec/stasis), /usr/bin/stasis and
#                                 /usr/bin/stasis-runc, /usr/bin/stasis-rsh, the daemon's unit stasis.service,
#                                 /etc/stasis/config.toml (a conffile)
#   stasis-criu_CRIU-1+stasis_ARCH.deb
#                                 /usr/sbin/criu: the CRIU scripts/install-criu.sh built here
#                                 (4.2 with patches/criu/; stasis needs the patches, so stasis
#                                 depends on this package, and it replaces Debian's criu)
#
# Packaging files: packaging/deb/. Inputs: this checkout (stasis/, pyproject.toml, the generated
# stasis/engine/_proto), the CRIU in /usr/local/sbin with its stamp (`make deb` runs
# scripts/install-criu.sh and `make proto` first), wheels from the index pip uses (cached in
# build/deb/wheels). Nothing is installed on this machine.
#
# Environment: STASIS_DEB_VERSION (default: pyproject's version, -1, +git and the commit's date
# and hash: 0.1.0-1+git20261206145900.1a2b3c4, so a later commit's package upgrades an earlier
# one), STASIS_DEB_COMPRESS (dpkg-deb's -Z: zstd, the default, which apt reads from Debian 12
# on; xz, gzip, none).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
die() { echo "build-deb: $*" >&2; exit 2; }

py=/usr/bin/python3
[ -x $py ] || die "no $py: apt-get install python3 python3-venv"
pyver=$($py -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ -x "/usr/bin/python$pyver" ] || die "no /usr/bin/python$pyver"
$py -c 'import ensurepip' 2>/dev/null || die "python$pyver has no venv support: apt-get install python3-venv"
command -v dpkg-deb >/dev/null || die "no dpkg-deb (this builds Debian packages on Debian)"
command -v gcc >/dev/null || die "no gcc: apt-get install gcc libc6-dev (stasis-init is built static)"
[ -f stasis/engine/_proto/rpc_pb2.py ] || die "stasis/engine/_proto/rpc_pb2.py is missing: run \`make proto\`"
criu=/usr/local/sbin/criu
stamp=/usr/local/share/stasis/criu.stamp
[ -x $criu ] && [ -f $stamp ] || die "no CRIU built by scripts/install-criu.sh in /usr/local: run \`make deb\` (it builds it)"
patchset=$(for f in patches/criu/*.patch; do basename "$f"; cat "$f"; done | sha256sum | cut -d' ' -f1)
grep -q "patches=$patchset" $stamp ||
    die "$criu was built from other patches than patches/criu/ ($stamp): run scripts/install-criu.sh"

version=$($py -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
# Each commit's packages upgrade the previous commit's, whatever pyproject's version says:
# VERSION-1+gitDATE.COMMIT (the commit's date, so later commits sort higher).
debversion=${STASIS_DEB_VERSION:-}
if [ -z "$debversion" ]; then
    if commit=$(TZ=UTC git log -1 --format='%cd.%h' --date=format-local:%Y%m%d%H%M%S 2>/dev/null) &&
        [ -n "$commit" ]; then
        debversion=$version-1+git$commit
    else
        debversion=$version-1
    fi
fi
arch=$(dpkg --print-architecture)
compress=${STASIS_DEB_COMPRESS:-zstd}
criu_version=$($criu --version | sed -n 's/^Version: *//p' | head -n1)
criu_debversion=$criu_version-1+stasis
out=${1:-build}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$repo/build/deb
mkdir -p "$work"
# One build at a time in build/deb (the tests of the package and of the image both build it).
exec 9>"$work/.lock"
flock 9

# The Debian packages that provide the libraries a binary links, as this machine has them.
lib_packages() {
    ldd "$@" | awk '/=> \//{print $3}' | sort -u | while read -r f; do
        dpkg -S "$f" 2>/dev/null || dpkg -S "$(realpath "$f")" 2>/dev/null || true
    done | cut -d: -f1 | sort -u | paste -sd, - | sed 's/,/, /g'
}

# -- stasis: the venv --------------------------------------------------------------------------
# The source without stasis/dev (the test harnesses) and without what a build left behind.
src=$work/src
rm -rf "$src"
mkdir -p "$src"
cp pyproject.toml "$src/"
tar -C "$repo" --exclude=stasis/dev --exclude=__pycache__ --exclude='*.pyc' \
    --exclude='*.egg-info' -cf - stasis | tar -C "$src" -xf -

# The dependencies' wheels, once per list of pins and Python version.
deps=$($py -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
# What builds stasis's own wheel (pyproject's build-system asks for setuptools>=68).
setuptools=setuptools==75.3.0
key=$(printf '%s\n%s\n%s\n%s\n' "$pyver" "$arch" "$deps" "$setuptools" | sha256sum | cut -c1-16)
wheels=$work/wheels/$key
venv=/opt/stasis/venv
# The venv, built again only when what goes into it changed (the source, the pins, Python):
# a build that only changes the package's version reuses it.
vroot=$work/venv-root
sv=$vroot$venv
vkey=$( (printf '%s\n' "$key"; tar -C "$src" --sort=name --mtime=@0 --owner=0 --group=0 -cf - .) |
    sha256sum | cut -c1-16)
if [ "$(cat "$vroot/.key" 2>/dev/null)" != "$vkey" ]; then
    rm -rf "$vroot"
    "/usr/bin/python$pyver" -m venv "$sv"
    if [ ! -f "$wheels/.complete" ]; then
        echo "build-deb: wheels of the pinned dependencies (python $pyver)"
        rm -rf "$wheels"
        mkdir -p "$wheels"
        printf '%s\n' "$deps" > "$work/requirements.txt"
        "$sv/bin/pip" wheel -q -w "$wheels" -r "$work/requirements.txt" "$setuptools" \
            2> >(grep -v "^WARNING: Location" >&2)
        touch "$wheels/.complete"
    fi
    echo "build-deb: stasis $version into $venv"
    # Built with the setuptools of the wheel cache, offline.
    rm -rf "$work/own"
    PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$sv/bin/pip" wheel -q --no-deps --no-index \
        --find-links "$wheels" -w "$work/own" "$src"
    PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$sv/bin/pip" install -q --no-index \
        --find-links "$wheels" --find-links "$work/own" "stasis==$version"
    rm -rf "$work/own"
    "$sv/bin/pip" uninstall -q -y pip setuptools
    [ ! -d "$sv/lib/python$pyver/site-packages/stasis/dev" ] || die "stasis/dev got into the package"
    # Commands of the left-out stasis/dev (stasis-dev: the local clusters, the demo) go too.
    { grep -ls -d skip "^from stasis\.dev[. ]" "$sv"/bin/* || true; } | xargs -r rm -f
    # The venv was made at $sv: its scripts and pyvenv.cfg name that path.
    rm -f "$sv"/bin/[Aa]ctivate*
    grep -rlF --exclude='*.pyc' "$vroot" "$sv" | while read -r f; do
        sed -i "s#$vroot##g" "$f"
    done
    find "$sv" -name __pycache__ -prune -exec rm -rf {} +
    "$sv/bin/python" -m compileall -q -j0 -s "$vroot" -p / "$sv/lib" >/dev/null
    echo "$vkey" > "$vroot/.key"
else
    echo "build-deb: stasis $version in $venv as built before (same source and pins)"
fi
stage=$work/stage
rm -rf "$stage"
mkdir -p "$stage/opt/stasis"
cp -al "$sv" "$stage$venv"
echo "$debversion" > "$stage/opt/stasis/VERSION"
# The jobs' init: every job runs it, as its own user, and it is part of every checkpoint. CRIU
# restores it by path and checks its size and build-id, so it is built exactly as `make install`
# builds it (same flags, not stripped), and the postinst puts it where `make install` does,
# /usr/libexec/stasis/stasis-init: a checkpoint made under either install restores under the
# other (on the same Debian release). The package's copy is /usr/lib/stasis/stasis-init: dpkg
# would replace the file jobs run on every upgrade, and a running job whose init was deleted
# under it can no longer be restored by its owner (CRIU recreates a deleted file beside it).
install -d "$stage/usr/lib/stasis"
gcc -O2 -Wall -Wextra -Werror -static -o "$stage/usr/lib/stasis/stasis-init" \
    stasis/daemon/stasis-init.c

install -d "$stage/usr/bin"
ln -s $venv/bin/stasis "$stage/usr/bin/stasis"
ln -s $venv/bin/stasis-runc "$stage/usr/bin/stasis-runc"
# MPI's launch agent for jobs over several nodes (slurm_multinode): on the PATH of every node.
ln -s $venv/bin/stasis-rsh "$stage/usr/bin/stasis-rsh"
# Debian 12 keeps units in /lib (its dpkg does not know /lib and /usr/lib are one); later, /usr/lib.
if dpkg --compare-versions "$(cat /etc/debian_version 2>/dev/null || echo 13)" lt 13 2>/dev/null; then
    unitdir=/lib/systemd/system
else
    unitdir=/usr/lib/systemd/system
fi
install -D -m 0644 packaging/deb/stasis.service "$stage$unitdir/stasis.service"
install -D -m 0644 packaging/deb/config.toml "$stage/etc/stasis/config.toml"
install -d -m 0755 "$stage/usr/share/doc/stasis"
printf 'stasis %s\n\nsystemctl status stasis; journalctl -u stasis: the daemon.\n' \
    "$debversion" > "$stage/usr/share/doc/stasis/README.Debian"

install -d "$stage/DEBIAN"
for f in postinst prerm postrm; do install -m 0755 "packaging/deb/$f" "$stage/DEBIAN/$f"; done
echo /etc/stasis/config.toml > "$stage/DEBIAN/conffiles"
size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
# Compiled extensions in the wheels (manylinux) bring their own libraries, beyond glibc's.
cat > "$stage/DEBIAN/control" <<EOF
Package: stasis
Version: $debversion
Architecture: $arch
Maintainer: stasis <stasis@localhost>
Installed-Size: $size
Depends: python$pyver, stasis-criu (>= 4.2), libc6, tini, iptables, util-linux, mount
Suggests: gcc, libslurm-dev
Section: admin
Priority: optional
Description: checkpoint and restore running jobs with CRIU (node daemon and CLI)
 The stasis node daemon (systemd unit stasis.service) and the stasis command, in
 /opt/stasis/venv with their pinned Python dependencies. Slurm workers build a
 SPANK plugin with \`stasis slurm install\` (gcc and Slurm's headers).
EOF
(cd "$stage" && find . -path ./DEBIAN -prune -o -type f -print0 | sort -z |
    xargs -0 md5sum | sed 's# \./# #') > "$stage/DEBIAN/md5sums"
deb=$out/stasis_${debversion}_$arch.deb
dpkg-deb --root-owner-group -Z"$compress" -b "$stage" "$deb" >/dev/null
echo "build-deb: $deb"

# -- stasis-criu -------------------------------------------------------------------------------
cstage=$work/stage-criu
rm -rf "$cstage"
install -D -m 0755 $criu "$cstage/usr/sbin/criu"
install -D -m 0644 $stamp "$cstage/usr/share/doc/stasis-criu/criu.stamp"
for p in patches/criu/*.patch; do install -D -m 0644 "$p" "$cstage/usr/share/doc/stasis-criu/patches/$(basename "$p")"; done
install -d "$cstage/DEBIAN"
cat > "$cstage/DEBIAN/control" <<EOF
Package: stasis-criu
Version: $criu_debversion
Architecture: $arch
Maintainer: stasis <stasis@localhost>
Installed-Size: $(du -sk --exclude=DEBIAN "$cstage" | cut -f1)
Depends: $(lib_packages $criu), iptables
Provides: criu (= $criu_version)
Conflicts: criu
Replaces: criu
Section: admin
Priority: optional
Description: CRIU $criu_version with the patches stasis needs
 /usr/sbin/criu built from Debian's criu source with stasis's patches
 (usr/share/doc/stasis-criu/patches), RUNDIR /run/stasis-criu.
EOF
(cd "$cstage" && find . -path ./DEBIAN -prune -o -type f -print0 | sort -z |
    xargs -0 md5sum | sed 's# \./# #') > "$cstage/DEBIAN/md5sums"
cdeb=$out/stasis-criu_${criu_debversion}_$arch.deb
dpkg-deb --root-owner-group -Z"$compress" -b "$cstage" "$cdeb" >/dev/null
echo "build-deb: $cdeb"
