#!/usr/bin/env bash
# install-containers.sh: what the Kubernetes integration runs on and is tested with.
#
# Run as root on Debian 12 or 13. Idempotent: packages already installed are not touched.
#   containerd       containerd and its runc shim (containerd-shim-runc-v2), which runs
#                    stasis-runc in front of runc; tests start a private one (`stasis-dev
#                    local-node up`), the package's own service is not used
#   runc             the OCI runtime; it drives our CRIU (/usr/local/sbin/criu) for containers
#   busybox-static   the tests' container image is built from it (no registry is reachable)
#   skopeo           reads the OCI archives `stasis export --oci` writes (tests)
# --no-install-recommends: runc recommends Debian's criu, which is older than ours.
set -euo pipefail

PACKAGES=(containerd runc busybox-static skopeo)

bash "$(dirname "$0")/apt-install.sh" install-containers "${PACKAGES[@]}"
