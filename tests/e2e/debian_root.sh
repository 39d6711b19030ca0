#!/usr/bin/env bash
# debian_root.sh build ROOT CHECKOUT | enter ROOT COMMAND
#
# A Debian root of another release (SUITE, default trixie: Slurm 24.11) for the Slurm end-to-end
# tests on that release, next to the machine's own (Debian 12: Slurm 22.05).
#
#   build  debootstrap's minbase, Slurm and munge from that release, the runtime libraries of
#          this machine's CRIU (the binary and the static stasis-init are copied in: building
#          CRIU again would cost minutes), and stasis from CHECKOUT in a venv at /opt/stasis.
#          Idempotent: a root whose stamp matches CHECKOUT's stasis is kept as it is.
#   enter  runs COMMAND as root inside ROOT, entered as a system of its own: a private mount
#          namespace whose / it is (pivot_root; CRIU needs a whole mount tree, a chroot is not
#          enough), with /proc, /sys and /dev. Its /tmp and /run are the root's own directories,
#          so that daemons started by one `enter` are seen by the next.
set -euo pipefail

what=${1:?build ROOT CHECKOUT | enter ROOT COMMAND}
root=${2:?ROOT}

enter() {
    unshare --mount --fork /bin/bash -c '
      set -e
      root=$1; shift
      mount --make-rprivate /
      mount --bind "$root" "$root"
      mount -t proc proc "$root/proc"
      mount --rbind /sys "$root/sys"
      mount --rbind /dev "$root/dev"
      cd "$root"; mkdir -p .oldroot
      pivot_root . .oldroot
      umount -l /.oldroot
      cd /
      exec env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
          PATH=/opt/stasis/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
          /bin/bash -c "$*"
    ' enter "$root" "$@"
}

if [ "$what" = enter ]; then
    shift 2
    enter "$@"
    exit
fi

[ "$what" = build ] || { echo "debian_root.sh: build or enter, not $what" >&2; exit 2; }
checkout=${3:?CHECKOUT}
suite=${SUITE:-trixie}
# What the root's stasis is made of: a changed checkout rebuilds the venv, not the root.
stamp=$( (cd "$checkout" && cat pyproject.toml && find stasis -name '*.py' -o -name '*.c' \
          -o -name '*.lua' -o -name '*.proto' | LC_ALL=C sort | xargs cat) | sha256sum | cut -c1-16)

if [ ! -e "$root/.stasis-root-done" ]; then
    command -v debootstrap >/dev/null || apt-get install -y -q debootstrap
    uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [ -n "$uri" ] || uri=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    uri=${uri:-http://deb.debian.org/debian}
    rm -rf "$root"
    mkdir -p "$(dirname "$root")"
    debootstrap --variant=minbase \
        --include=ca-certificates,python3,python3-venv,procps,iproute2 "$suite" "$root" "$uri" \
        >"$root.debootstrap.log" 2>&1 || { tail -20 "$root.debootstrap.log" >&2; exit 1; }
    # This machine's ways out (proxy, mirrors, certificate authorities) are the root's too.
    cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
    for f in $(grep -l '^Acquire::' /etc/apt/apt.conf.d/* 2>/dev/null); do
        cp "$f" "$root/etc/apt/apt.conf.d/"
    done
    if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
        cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    fi
    [ -f /etc/pip.conf ] && cp /etc/pip.conf "$root/etc/pip.conf"
    if [ -f "$HOME/.config/pip/pip.conf" ]; then
        mkdir -p "$root/root/.config/pip"; cp "$HOME/.config/pip/pip.conf" "$root/root/.config/pip/"
    fi
    # No daemon starts while packages install: the tests start their own.
    printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d"
    chmod 755 "$root/usr/sbin/policy-rc.d"
    enter "update-ca-certificates >/dev/null 2>&1 || true
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends \
            slurmctld slurmd slurm-client munge libslurm-dev slurm-wlm-basic-plugins gcc libc6-dev \
            tini iptables nftables util-linux python3-dev \
            libprotobuf-c1 libnl-3-200 libnet1 libgnutls30t64 libbsd0 libnftables1 >/dev/null"
    touch "$root/.stasis-root-done"
fi

# This machine's CRIU (built with our patches) and the jobs' static init.
install -D -m 0755 /usr/local/sbin/criu "$root/usr/local/sbin/criu"
install -D -m 0755 /usr/local/libexec/stasis/stasis-init "$root/usr/local/libexec/stasis/stasis-init"
if enter "ldd /usr/local/sbin/criu" | grep -q 'not found'; then
    echo "debian_root.sh: CRIU misses libraries in $root:" >&2
    enter "ldd /usr/local/sbin/criu" | grep 'not found' >&2
    exit 1
fi

if [ "$(cat "$root/opt/stasis/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$root/opt/stasis" "$root/src/stasis"
    mkdir -p "$root/src/stasis"
    # The package as it is here, generated protobuf modules included (make proto); installed
    # editable, as `make install` does, so that its data files (plugin source, Lua) are read in place.
    (cd "$checkout" && tar -cf - --exclude=__pycache__ pyproject.toml README.md stasis) \
        | tar -xf - -C "$root/src/stasis"
    enter "python3 -m venv /opt/stasis && /opt/stasis/bin/pip install -q --no-cache-dir \
        --disable-pip-version-check --config-settings editable_mode=compat -e /src/stasis" >"$root.pip.log" 2>&1 \
        || { tail -20 "$root.pip.log" >&2; exit 1; }
    echo "$stamp" > "$root/opt/stasis/.stamp"
fi
echo "$root"
