#!/usr/bin/env bash
# install-test-apps.sh: real server software the tests checkpoint (issue: real applications).
#
# Run as root on Debian 12 or 13. Idempotent: packages already installed are not touched.
#   postgresql   a multi-process database server that daemonizes (pg_ctl) and keeps its
#                shared buffers in SysV shared memory when asked (shared_memory_type=sysv)
# The tests start private servers as an ordinary user on loopback; nothing here is configured,
# and on a machine without systemd the package's own cluster is not started.
set -euo pipefail

PACKAGES=(postgresql)

missing=()
for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "install-test-apps: all packages present"
    exit 0
fi
echo "install-test-apps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
