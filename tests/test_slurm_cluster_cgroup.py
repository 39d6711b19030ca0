"""`local-cluster up`'s (cgroup Slurm, its default) view of a machine's cgroups (stasis.dev.slurmcgroup); the
cluster itself is tested end to end in tests/e2e/test_slurm_cgroup.py."""

from __future__ import annotations

from pathlib import Path

from stasis.dev import slurmcgroup

# A cgroup v1 hybrid machine (these machines), with a node's own mounts on top of the machine's
# in a node's mount namespace: the last mount on a point is the one seen.
HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
52 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
60 50 0:40 /../.. /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
61 50 0:41 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
70 23 0:50 / /mnt/elsewhere rw - cgroup cgroup rw,pids
"""


def test_hierarchies_are_those_under_sys_fs_cgroup_by_what_identifies_them() -> None:
    found = {h.mountpoint: (h.fstype, h.options) for h in slurmcgroup.hierarchies(HYBRID)}
    assert found == {
        "/sys/fs/cgroup/memory": ("cgroup", "memory"),
        "/sys/fs/cgroup/freezer": ("cgroup", "freezer"),
        "/sys/fs/cgroup/systemd": ("cgroup", "name=systemd"),
        "/sys/fs/cgroup/unified": ("cgroup2", ""),
        "/sys/fs/cgroup/cpu,cpuacct": ("cgroup", "cpu,cpuacct"),
    }


def test_node_mounts_cover_the_machines_and_cgroup_conf_names_the_version() -> None:
    m = slurmcgroup.Machine("v1", tuple(slurmcgroup.hierarchies(HYBRID)))
    mounts = slurmcgroup.node_mounts(m)
    assert mounts[0] == ("tmpfs", "mode=755", "/sys/fs/cgroup")
    assert ("cgroup", "name=systemd", "/sys/fs/cgroup/systemd") in mounts
    conf = slurmcgroup.cgroup_conf(m)
    assert "CgroupPlugin=cgroup/v1\n" in conf and "ConstrainRAMSpace=yes\n" in conf
    assert "IgnoreSystemd" not in conf
    v2 = slurmcgroup.Machine(
        "v2", (slurmcgroup.Hierarchy("/sys/fs/cgroup", "cgroup2", "nsdelegate"),)
    )
    assert slurmcgroup.node_mounts(v2) == [("cgroup2", "nsdelegate", "/sys/fs/cgroup")]
    assert "IgnoreSystemd=yes\n" in slurmcgroup.cgroup_conf(v2)


def test_each_cluster_directory_has_its_own_cgroup_name() -> None:
    a = slurmcgroup.base_name(Path("/tmp/a"))
    assert a == slurmcgroup.base_name(Path("/tmp/a"))
    assert a != slurmcgroup.base_name(Path("/tmp/b"))
    assert a.startswith("stasis-slurm-") and "/" not in a
