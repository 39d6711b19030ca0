#!/usr/bin/env bash
# install-slurm.sh: install the Slurm packages that stasis' Slurm integration and its tests need.
#
# Run as root on Debian 12 or 13. Idempotent: packages already installed are not touched.
#   slurmctld slurmd slurm-client   the controller, the node daemon, sbatch/squeue/scontrol/...
#   munge                           authentication
#   libslurm-dev                    <slurm/spank.h>, to build the stasis SPANK plugin
#   slurm-wlm-basic-plugins         job_submit/lua and cli_filter/lua
#   gcc                             to build the SPANK plugin at install time
#   slurmdbd mariadb-server         accounting (`local-cluster up --accounting`, sacct and
#                                   `stasis slurm report`); the local cluster starts private ones
#   iproute2                        `ip`: the local cluster's nodes (network namespaces, a bridge)
# The packages' postinst scripts start no daemon on a machine without systemd; the local cluster
# (`stasis-dev local-cluster up`) starts private ones. Nothing is configured here.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge libslurm-dev slurm-wlm-basic-plugins gcc
          slurmdbd mariadb-server iproute2)

bash "$(dirname "$0")/apt-install.sh" install-slurm "${PACKAGES[@]}"
