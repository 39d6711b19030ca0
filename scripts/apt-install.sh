#!/usr/bin/env bash
# apt-install.sh NAME PACKAGE...: install the Debian packages that are missing (none: nothing
# runs, not even `apt-get update`), without recommends. NAME prefixes what it says. Used by the
# install-*.sh scripts.
set -euo pipefail

name=$1
shift
missing=()
for p in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "$name: all packages present"
    exit 0
fi
echo "$name: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
