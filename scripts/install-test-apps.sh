#!/usr/bin/env bash
# install-test-apps.sh: real server software the tests checkpoint (issue: real applications).
#
# Run as root on Debian 12 or 13. Idempotent: packages already installed are not touched.
#   postgresql   a multi-process database server that daemonizes (pg_ctl) and keeps its
#                shared buffers in SysV shared memory when asked (shared_memory_type=sysv);
#                also the control plane's database in its PostgreSQL tests
#   chromium, chromium-driver
#                the control plane's dashboard, driven headless by Selenium in its tests
#   debootstrap  the Debian 13 root (Slurm 24.11) that the Slurm tests build and run in
#                (tests/e2e/debian_root.sh)
#   strace       what an install puts on command lines (every exec's argv), in the installer's
#                security tests
#   default-jdk-headless
#                OpenJDK: a JVM keeps /tmp/hsperfdata_<user>/<pid> mapped while it runs and
#                removes it when it ends, the node-local file a checkpoint must carry (issue
#                29); the JDK, not only the JRE, because the tests compile their small program
#                (javac; `java File.java` needs the compiler too)
#   faketime     libfaketime: a second test daemon runs with its clock days ahead (LD_PRELOAD),
#                to show a label's order does not follow the dumping nodes' clocks
#   openmpi-bin libopenmpi-dev mpich libmpich-dev
#                both of Debian's MPIs, for the multi-node job tests (issue 31); the same names
#                on Debian 12 (Open MPI 4.1, MPICH 4.0) and 13 (Open MPI 5.0, MPICH 4.2). The
#                alternatives system picks one `mpicc`/`mpirun`: the tests call the explicit
#                ones (mpicc.openmpi, mpicc.mpich, mpirun.openmpi, mpirun.mpich)
# The tests start private servers as an ordinary user on loopback; nothing here is configured,
# and on a machine without systemd the package's own cluster is not started.
set -euo pipefail

PACKAGES=(postgresql chromium chromium-driver debootstrap default-jdk-headless faketime strace
    openmpi-bin libopenmpi-dev mpich libmpich-dev)

bash "$(dirname "$0")/apt-install.sh" install-test-apps "${PACKAGES[@]}"
