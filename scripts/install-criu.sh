#!/usr/bin/env bash
# install-criu.sh: install the CRIU that stasis needs, plus the job-side tools.
#
# Run as root on Debian 12 or 13. Idempotent: a second run changes nothing.
#
#  1. apt-get installs the build and runtime dependencies (only if one is missing).
#  2. Builds CRIU 4.2.1 from Debian's upstream tarball with patches/criu/*.patch
#     applied, unless /usr/local/sbin/criu already reports the version the stamp
#     file records, and the stamp records the sha256 of the current patch set (a
#     changed patch rebuilds). No network is used then.
#     The tarball is fetched with apt's own client (signature-verified Release,
#     hash-checked files) through a PRIVATE apt configuration holding a deb-src
#     entry for Debian unstable; the system's apt sources are never touched.
#     The pinned 4.2.1 tarball is checked against CRIU_ORIG_SHA256 too.
#     When unstable no longer carries 4.2.1 (Debian moved on), the newest CRIU
#     >= CRIU_MIN_VERSION it carries is built instead, verified by apt's signed
#     Sources index only; the run says so, and stops with what to do if one of
#     the patches does not apply to it. The stamp then records that version
#     ("criu=V fallback-for=4.2.1 ..."), and later runs keep it as it is.
#  3. Installs:
#       /usr/local/sbin/criu              the patched criu binary
#       /usr/local/share/criu/rpc.proto   CRIU's RPC schema (protoc input for the
#                                         Python package: keep this exact path)
#       /usr/local/share/stasis/criu.stamp
#
#     CRIU is built with RUNDIR=/run/stasis-criu: its cache of kernel probes
#     (criu.kdat, ~50 ms saved on every CRIU run) lives there instead of in /run,
#     because CRIU keeps that cache only on a tmpfs and some machines' /run is
#     not one. The stasis daemon makes that directory a tmpfs at start
#     (stasis/engine/kdat.py must name the same path).
#
# Environment (all optional):
#   STASIS_CRIU_FORCE=1     rebuild even if the stamp matches
#   STASIS_CRIU_MIRROR=URI  Debian mirror to fetch the source from (default: the
#                           one the system's apt sources use); a snapshot, e.g.
#                           https://snapshot.debian.org/archive/debian/20251101T000000Z/,
#                           brings back a version unstable no longer carries
#   STASIS_CRIU_JOBS=N      make -jN (default: number of CPUs)
#   STASIS_CRIU_PREFIX=DIR  install into DIR/sbin, DIR/share/criu, DIR/share/stasis
#                           (default /usr/local; for tests: stasis uses /usr/local)
#   STASIS_CRIU_PIN=V       the CRIU version to look for instead of 4.2.1, with
#   STASIS_CRIU_PIN_SHA256=H  the sha256 of its orig tarball (tests: pinning a
#                           version the archive lacks takes the fallback path)
#   STASIS_CRIU_PREPARE_ONLY=1  fetch, verify, unpack and patch the source, then
#                           stop: nothing is built or installed
set -euo pipefail

CRIU_UPSTREAM_VERSION=4.2.1
CRIU_MIN_VERSION=4.2
# sha256 of criu_4.2.1.orig.tar.xz (Debian source package criu 4.2.1-1)
CRIU_ORIG_SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9

# The version the patches are for (and its tarball's sha256): CRIU_UPSTREAM_VERSION
# unless a test pins another one.
PIN="${STASIS_CRIU_PIN:-$CRIU_UPSTREAM_VERSION}"
if [ -n "${STASIS_CRIU_PIN_SHA256:-}" ]; then
    PIN_SHA256="$STASIS_CRIU_PIN_SHA256"
elif [ "$PIN" = "$CRIU_UPSTREAM_VERSION" ]; then
    PIN_SHA256="$CRIU_ORIG_SHA256"
else
    PIN_SHA256=""   # only needed if the archive carries $PIN (checked there)
fi
PREPARE_ONLY="${STASIS_CRIU_PREPARE_ONLY:-0}"

PREFIX="${STASIS_CRIU_PREFIX:-/usr/local}"
PREFIX_SBIN="$PREFIX/sbin"
PROTO_DIR="$PREFIX/share/criu"
STAMP_DIR="$PREFIX/share/stasis"
STAMP="$STAMP_DIR/criu.stamp"
CRIU_RUNDIR=/run/stasis-criu

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PATCH_DIR="$(cd "$SCRIPT_DIR/.." && pwd)/patches/criu"

BUILD_DEPS=(
    libbsd-dev libcap-dev libgnutls28-dev libnet1-dev libnftables-dev
    libnl-3-dev libprotobuf-c-dev libprotobuf-dev uuid-dev
    protobuf-c-compiler protobuf-compiler pkgconf gcc make patch
    xz-utils ca-certificates debian-archive-keyring
)
RUNTIME_DEPS=(
    tini iptables nftables util-linux procps python3-venv python3-dev git
)

step() { printf '[install-criu] %s\n' "$*"; }
die()  { printf '[install-criu] ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root"
[ -r /etc/debian_version ] || die "this script supports Debian only"

# --------------------------------------------------------------------------
# 1. packages
# --------------------------------------------------------------------------
missing=()
for p in "${BUILD_DEPS[@]}" "${RUNTIME_DEPS[@]}"; do
    st="$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)"
    [ "${st:0:2}" = "ii" ] || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    step "apt-get install: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install failed"
else
    step "packages: all present"
fi
[ -x /usr/bin/tini ] || [ -x /usr/bin/tini-static ] || die "tini not installed"

# --------------------------------------------------------------------------
# 2. is the installed criu current?
# --------------------------------------------------------------------------
shopt -s nullglob
patches=("$PATCH_DIR"/*.patch)
shopt -u nullglob
# sha256 over the patch names and contents, in application order
patchset_sha="$(
    for f in "${patches[@]}"; do
        printf '%s\n' "$(basename "$f")"
        cat "$f"
    done | sha256sum | cut -d' ' -f1
)"
# The stamp of a build: "criu=VERSION patches=SHA rundir=DIR" for the pinned
# version, "criu=VERSION fallback-for=PIN patches=SHA rundir=DIR" for a newer one
# built because the archive no longer carried the pin.
stamp_for() {  # VERSION
    if [ "$1" = "$PIN" ]; then
        printf 'criu=%s patches=%s rundir=%s' "$1" "$patchset_sha" "$CRIU_RUNDIR"
    else
        printf 'criu=%s fallback-for=%s patches=%s rundir=%s' \
            "$1" "$PIN" "$patchset_sha" "$CRIU_RUNDIR"
    fi
}

installed_version=""
if [ -x "$PREFIX_SBIN/criu" ]; then
    installed_version="$("$PREFIX_SBIN/criu" --version 2>/dev/null \
        | sed -n 's/^Version: *//p' | head -n1 || true)"
fi
installed_stamp=""
[ -f "$STAMP" ] && installed_stamp="$(cat "$STAMP")"
# Nothing to do, without going to the network, when the installed criu is the
# build the stamp describes, for the current pin, patch set and rundir: the
# pinned version, or a fallback build (kept even if the pin came back since:
# STASIS_CRIU_FORCE=1 rebuilds, and then takes the pin if the archive has it).
if [ "${STASIS_CRIU_FORCE:-0}" != 1 ] && [ "$PREPARE_ONLY" != 1 ] \
   && [ -n "$installed_version" ] \
   && [ "$installed_stamp" = "$(stamp_for "$installed_version")" ] \
   && [ -f "$PROTO_DIR/rpc.proto" ]; then
    if [ "$installed_version" = "$PIN" ]; then
        step "criu $installed_version with patch set ${patchset_sha:0:12} already installed: nothing to do"
    else
        step "criu $installed_version (built because Debian unstable no longer carried $PIN) with patch set ${patchset_sha:0:12} already installed: nothing to do (STASIS_CRIU_FORCE=1 rebuilds)"
    fi
    exit 0
fi
step "building criu $PIN or, if Debian unstable no longer carries it, the newest >= $CRIU_MIN_VERSION (${#patches[@]} patches, set ${patchset_sha:0:12}; installed: ${installed_version:-none})"

# --------------------------------------------------------------------------
# 3. fetch the source with apt, through a private configuration
# --------------------------------------------------------------------------
WORK="$(mktemp -d /tmp/stasis-criu-build.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
chmod 755 "$WORK"

mirror_uri() {
    if [ -n "${STASIS_CRIU_MIRROR:-}" ]; then
        echo "$STASIS_CRIU_MIRROR"; return
    fi
    local f uri
    # deb822: the first stanza's URIs line that is not a security archive
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        uri="$(awk 'tolower($1)=="uris:" {for(i=2;i<=NF;i++) print $i}' "$f" \
            | grep -v -- '-security' | head -n1 || true)"
        [ -n "$uri" ] && { echo "$uri"; return; }
    done
    # one-line format
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        uri="$(awk '$1=="deb" || $1=="deb-src" {
                    for(i=2;i<=NF;i++) if ($i ~ /^[a-z+]+:\/\//) { print $i; break } }' "$f" \
            | grep -v -- '-security' | head -n1 || true)"
        [ -n "$uri" ] && { echo "$uri"; return; }
    done
    echo "http://deb.debian.org/debian"
}
MIRROR="$(mirror_uri)"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
[ -r "$KEYRING" ] || die "$KEYRING missing (package debian-archive-keyring)"

APTROOT="$WORK/apt"
mkdir -p "$APTROOT/sources.list.d" "$APTROOT/lists/partial" \
         "$APTROOT/cache/archives/partial" "$WORK/src"
# Unstable's Release file is signed by the current Debian archive keys, which
# debian-archive-keyring ships (Debian 12's package carries the trixie keys
# too). Verification stays ON: signed-by pins the official keyring. A snapshot's
# Release is past its Valid-Until by design: its signature is still checked.
src_opts="signed-by=$KEYRING"
case "$MIRROR" in *://snapshot.debian.org/*) src_opts="$src_opts check-valid-until=no" ;; esac
printf 'deb-src [%s] %s unstable main\n' "$src_opts" "$MIRROR" \
    > "$APTROOT/sources.list"
cat > "$APTROOT/apt.conf" <<EOF
Dir::Etc::SourceList "$APTROOT/sources.list";
Dir::Etc::SourceParts "$APTROOT/sources.list.d";
Dir::State::Lists "$APTROOT/lists";
Dir::Cache "$APTROOT/cache";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
APT::Get::List-Cleanup "false";
Acquire::Languages "none";
Acquire::IndexTargets::deb::Packages::DefaultEnabled "false";
EOF
chown -R _apt "$WORK/src" 2>/dev/null || true   # apt downloads as user _apt
export APT_CONFIG="$APTROOT/apt.conf"

step "apt-get update (private config: deb-src $MIRROR unstable main)"
apt-get update -qq >"$WORK/apt-update.log" 2>&1 \
    || { cat "$WORK/apt-update.log" >&2; die "apt-get update of the private source list failed"; }

# --------------------------------------------------------------------------
# 3a. which version: the pin if the archive carries it, else the newest >= min
# --------------------------------------------------------------------------
upstream_of() {  # Debian version -> upstream version: 1:4.2.1+dfsg-3 -> 4.2.1+dfsg
    local v="${1#*:}"
    printf '%s' "${v%-*}"
}
criu_version_of() {  # Debian version -> what its `criu --version` says: 4.2.1
    local v
    v="$(upstream_of "$1")"
    printf '%s' "${v%%+*}"
}
newest_of() {  # Debian versions -> the newest of them
    local best="" v
    for v in "$@"; do
        if [ -z "$best" ] || dpkg --compare-versions "$v" gt "$best"; then best="$v"; fi
    done
    printf '%s' "$best"
}
mapfile -t src_versions < <(apt-cache showsrc criu 2>/dev/null | sed -n 's/^Version: *//p')
[ "${#src_versions[@]}" -gt 0 ] \
    || { cat "$WORK/apt-update.log" >&2; die "no criu source package found in $MIRROR unstable"; }
pinned_versions=()
for v in "${src_versions[@]}"; do
    if [ "$(criu_version_of "$v")" = "$PIN" ]; then pinned_versions+=("$v"); fi
done
if [ "${#pinned_versions[@]}" -gt 0 ]; then
    fallback=0
    src_version="$(newest_of "${pinned_versions[@]}")"
    [ -n "$PIN_SHA256" ] || die "STASIS_CRIU_PIN=$PIN needs STASIS_CRIU_PIN_SHA256 (the sha256 of its orig tarball)"
    step "Debian unstable carries the pinned criu $PIN ($src_version)"
else
    fallback=1
    src_version="$(newest_of "${src_versions[@]}")"
    dpkg --compare-versions "$(criu_version_of "$src_version")" ge "$CRIU_MIN_VERSION" \
        || die "Debian unstable carries neither criu $PIN nor any criu >= $CRIU_MIN_VERSION (only: ${src_versions[*]}): set STASIS_CRIU_MIRROR to a mirror that has $PIN (e.g. https://snapshot.debian.org/archive/debian/<date>/)"
    step "criu $PIN is no longer in Debian unstable (it carries: ${src_versions[*]}): trying $src_version"
fi
upstream="$(upstream_of "$src_version")"
criu_version="$(criu_version_of "$src_version")"
want_stamp="$(stamp_for "$criu_version")"

# `apt-get source --print-uris` lists the package's files with the hashes from the
# signed Sources index; apt-helper then downloads the upstream tarball and checks
# that hash. Only the .orig tarball is fetched: some mirrors/proxies do not serve
# the Debian packaging tarball, and it is not needed (we build upstream + our patches).
step "apt-get source --print-uris criu=$src_version"
apt-get source -qq --print-uris "criu=$src_version" >"$WORK/apt-source.log" 2>&1 \
    || { cat "$WORK/apt-source.log" >&2; die "apt-get source --print-uris failed"; }
# lines look like: 'URI' criu_4.2.1.orig.tar.xz SIZE SHA256:HEX
orig_line="$(awk -v n="criu_${upstream}.orig.tar." '$1 ~ /^\047/ && index($2, n) == 1' \
    "$WORK/apt-source.log" | head -n1)"
[ -n "$orig_line" ] || { cat "$WORK/apt-source.log" >&2; die "no orig tarball listed for criu=$src_version"; }
orig_uri="$(echo "$orig_line" | awk '{print $1}' | tr -d "'")"
orig_name="$(echo "$orig_line" | awk '{print $2}')"
orig_hash="$(echo "$orig_line" | awk '{print $4}')"
case "$orig_hash" in SHA256:*|SHA512:*) ;; *) die "apt gave no strong hash for $orig_name ($orig_hash)";; esac
hash_kind="${orig_hash%%:*}"
step "download $orig_name (apt-helper checks it against $hash_kind from the signed Sources index)"
/usr/lib/apt/apt-helper -qq download-file "$orig_uri" "$WORK/src/$orig_name" "$orig_hash" \
    >"$WORK/apt-download.log" 2>&1 \
    || { cat "$WORK/apt-download.log" >&2; die "download of $orig_uri failed"; }
unset APT_CONFIG

orig="$WORK/src/$orig_name"
[ -f "$orig" ] || die "expected $orig after apt-get source"
sha="$(sha256sum "$orig" | cut -d' ' -f1)"
if [ "$fallback" = 0 ]; then
    [ "$sha" = "$PIN_SHA256" ] \
        || die "sha256 mismatch for $(basename "$orig"): got $sha, want $PIN_SHA256"
    step "verified $(basename "$orig") sha256 $sha"
else
    step "verified $(basename "$orig") by apt's signed Sources index only ($hash_kind; sha256 $sha): there is no pinned sha256 for criu $criu_version"
fi

# --------------------------------------------------------------------------
# 4. unpack, patch, build
# --------------------------------------------------------------------------
mkdir "$WORK/build"
tar -xf "$orig" -C "$WORK/build" --strip-components=1 \
    || die "cannot unpack $orig"
for p in "${patches[@]}"; do
    step "patch $(basename "$p")"
    if ! patch -p1 -N --batch -d "$WORK/build" -i "$p" >"$WORK/patch.log" 2>&1; then
        cat "$WORK/patch.log" >&2
        [ "$fallback" = 1 ] || die "patch $(basename "$p") does not apply to criu $criu_version"
        die "patch $(basename "$p") does not apply to criu $criu_version, which Debian unstable carries instead of criu $PIN (the version the patches are for). Either set STASIS_CRIU_MIRROR to a mirror that still carries criu $PIN (e.g. https://snapshot.debian.org/archive/debian/<date>/, dates at https://snapshot.debian.org/package/criu/), or port patches/criu/ to criu $criu_version and update CRIU_UPSTREAM_VERSION and CRIU_ORIG_SHA256 in $0"
    fi
done
if [ "$fallback" = 1 ]; then
    step "criu $PIN is no longer in Debian unstable; building $criu_version instead, verified by apt's signed Sources index (not by the pinned sha256); all ${#patches[@]} patches applied"
fi
if [ "$PREPARE_ONLY" = 1 ]; then
    step "STASIS_CRIU_PREPARE_ONLY=1: criu $criu_version fetched, verified and patched; stopping before the build (nothing installed)"
    exit 0
fi

jobs="${STASIS_CRIU_JOBS:-$(nproc)}"
step "make -j$jobs RUNDIR=$CRIU_RUNDIR criu"
if ! make -C "$WORK/build" -j"$jobs" RUNDIR="$CRIU_RUNDIR" criu >"$WORK/make.log" 2>&1; then
    tail -n 40 "$WORK/make.log" >&2
    die "criu build failed"
fi
bin="$WORK/build/criu/criu"
[ -x "$bin" ] || die "build produced no criu binary"
built_version="$("$bin" --version | sed -n 's/^Version: *//p' | head -n1)"
[ "$built_version" = "$criu_version" ] \
    || die "built criu reports version '$built_version', want $criu_version"

# --------------------------------------------------------------------------
# 5. install
# --------------------------------------------------------------------------
step "install $PREFIX_SBIN/criu, $PROTO_DIR/rpc.proto"
install -D -m 0755 "$bin" "$PREFIX_SBIN/criu.new"
mv -f "$PREFIX_SBIN/criu.new" "$PREFIX_SBIN/criu"
install -d -m 0755 "$PROTO_DIR"
install -m 0644 "$WORK/build/images/rpc.proto" "$PROTO_DIR/rpc.proto"
# rpc.proto is self-contained today; install anything it imports alongside it.
for imp in $(sed -n 's/^[[:space:]]*import[[:space:]]*"\([^"]*\)".*/\1/p' "$WORK/build/images/rpc.proto"); do
    case "$imp" in google/*) continue ;; esac
    install -m 0644 "$WORK/build/images/$imp" "$PROTO_DIR/$imp"
done
install -d -m 0755 "$STAMP_DIR"
printf '%s\n' "$want_stamp" > "$STAMP"

step "criu check"
if "$PREFIX_SBIN/criu" check >"$WORK/check.log" 2>&1; then
    step "criu check: $(tail -n1 "$WORK/check.log")"
else
    cat "$WORK/check.log" >&2
    die "criu check failed (criu installed, but this kernel lacks something it needs)"
fi
if [ "$fallback" = 1 ]; then
    step "done: $("$PREFIX_SBIN/criu" --version | head -n1) (instead of the pinned $PIN, which Debian unstable no longer carries)"
else
    step "done: $("$PREFIX_SBIN/criu" --version | head -n1)"
fi
