#!/usr/bin/env bash
# install.sh: the stasis Slurm installer as a script that can be piped into a shell, e.g.
#     cat install.sh | sudo -E bash -s -- --node-role worker [--slurm-conf PATH] [--dry-run]
#     ... | sudo -E bash -s -- uninstall [--slurm-conf PATH]
# It wraps `stasis slurm install` (see `stasis slurm install --help`); stasis must be installed
# on the node. STASIS_BIN names the stasis command when it is not on PATH.
set -euo pipefail

stasis="${STASIS_BIN:-}"
if [ -z "$stasis" ]; then
    stasis="$(command -v stasis || true)"
fi
if [ -z "$stasis" ] || [ ! -x "$stasis" ]; then
    echo "install.sh: cannot find the stasis command; set STASIS_BIN=/path/to/stasis" >&2
    exit 2
fi
if [ "$(id -u)" -ne 0 ] && [[ " $* " != *" --dry-run "* ]]; then
    echo "install.sh: run as root (sudo -E bash -s -- ...)" >&2
    exit 2
fi
if [ "${1:-}" = "uninstall" ]; then
    shift
    exec "$stasis" slurm uninstall "$@"
fi
exec "$stasis" slurm install "$@"
