"""`stasis-dev local-cluster up|down|status|exec|kill-node|start-node`: a throwaway Slurm
cluster on this machine, of one node or several.

Everything lives under one private directory with private ports and a private munge socket, so it
never clashes with a real Slurm on the machine: munged, slurmctld (started with -c: job ids restart
at 1), slurmd nodes n1..nN, one stasis node daemon per node, a checkpoint store they all share
(the directory stands in for a shared file system; one site key, so every node trusts every
node's checkpoints), and the stasis plugin set installed into the cluster's own slurm.conf. Two
partitions over all nodes: `low` (preemptable, PreemptMode=REQUEUE with a GraceTime) and `high`
(PreemptMode=OFF, higher tier). With SLURM_CONF=<dir>/etc/slurm.conf the ordinary
sbatch/squeue/scontrol/scancel talk to it.

One node runs in this machine's own namespaces on 127.0.0.1. Several nodes are each a host of
their own (stasis.dev.nodehost): a network namespace with its own address on a private bridge
(10.213.X.0/24, the bridge is this machine's .254 and slurmctld's address), a UTS namespace with
the node's name as host name, and a mount namespace in which the node's own slurmd spool
directory is at the one SlurmdSpoolDir path (node-local, as on real sites) and /tmp, /var/tmp,
/dev/shm and /run are fresh tmpfs of its own (modes 1777, /run 755), so that a job's node-local
files stay on its node as on real hosts. Each node's slurmd and stasis daemon run inside them,
so the jobs of a node, the CRIU that dumps them and the one that restores them all see that
node. The rest of the file
system is shared, as on a cluster with a shared home and store: the cluster's directory (bound
back at its own path where it lies under a private directory, e.g. a test's /tmp/...), the home
directories, the installed software, this Python and the stasis package.

By default (--cgroup), Slurm runs proctrack/cgroup and task/cgroup (--mem a hard limit), as
sites do, and each node (the one node too) has a cgroup subtree and cgroup namespace of its own
(stasis.dev.slurmcgroup); --no-cgroup (and --job-container) runs proctrack/linuxproc and task/none.

    D/etc/        slurm.conf, plugstack.conf, job_submit.lua, cli_filter.lua
    D/munge/      key, socket, pid, log (owned by munge: munged refuses other owners)
    D/slurm/      StateSaveLocation, slurmctld's pid and log (and slurmd's on one node)
    D/stasis/     the shared store and site key (and on one node: the daemon's config.toml,
                  socket, state, log)
    D/nodes/NAME/ several nodes: the node's slurmd spool, pid and log, its stasis daemon's
                  config.toml, socket, state and log
    D/ns/NAME.holder  several nodes, or --cgroup: the pid of the process that holds the node's
                  namespaces (with --cgroup one node has a holder of its mounts and cgroups only)
    D/lib/        the built SPANK plugin and the launcher
    D/cluster.json  pids of what `up` started, the nodes and their network
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stasis.daemon import detached
from stasis.dev import commands, nodehost, slurmaccounting, slurmcgroup
from stasis.dev.nodehost import Net
from stasis.dev.slurmdirs import NODE, SlurmClusterDirs, read_state, write_state
from stasis.errors import SlurmError, StasisError, UsageError
from stasis.poll import poll
from stasis.slurm import install

MAX_NODES = 16
_UP_TIMEOUT_S = 60.0


def node_names(count: int) -> list[str]:
    return [f"n{i + 1}" for i in range(count)]


def _q(value: str) -> str:
    """A TOML basic string (JSON's escaping is a subset of TOML's)."""
    return json.dumps(value)


def _check_path(path: Path) -> None:
    if any(c.isspace() for c in str(path)) or "#" in str(path) or "%" in str(path):
        raise UsageError(
            f"{path}: Slurm's config files cannot hold paths with spaces, '#' or " "'%'"
        )


# Slurm's job_container/tmpfs (`up(job_container=True)`); Contain: the job's namespace is made
# at its allocation, before any step.
JOB_CONTAINER = "JobContainerType=job_container/tmpfs\nPrologFlags=Contain"


def slurm_conf_text(
    lay: SlurmClusterDirs,
    *,
    cpus: int,
    grace_s: int,
    hostname: str,
    accounting: str = "",
    nodes: list[str] | None = None,
    net: Net | None = None,
    gpus: int = 0,
    job_container: bool = False,
    cgroup: bool = False,
    configless: bool = False,
) -> str:
    """`accounting`: slurm.conf lines that replace the accounting_storage/none default.
    `nodes` and `net`: several nodes, each at its address on `net`. `gpus`: GPUs per node as
    Slurm counts them (generic resources without devices, gres.conf beside slurm.conf).
    `cgroup`: proctrack/cgroup and task/cgroup (cgroup.conf beside slurm.conf) instead of
    proctrack/linuxproc and task/none. `configless`: slurmctld serves its configuration to
    the nodes (SlurmctldParameters=enable_configless), plugstack.conf with it (at its default
    path, beside slurm.conf: a node reads it from its cache)."""
    s = lay.slurm
    gres = f" Gres=gpu:{gpus}" if gpus else ""
    acct = (
        accounting
        or "JobAcctGatherType=jobacct_gather/none\n" "AccountingStorageType=accounting_storage/none"
    )
    # cgroup: --mem is a limit only where memory is a consumable resource; a job that asks
    # for none gets DefMemPerCPU. RealMemory is twice what the node's CPUs take at that
    # default, so that memory never keeps a job from free CPUs before the CPUs run out, with
    # room left for jobs that ask for more (seen with 4000 MB on 8 CPUs: a 5-CPU preemptor
    # waited on memory beside an 800 MB job instead of preempting the low partition).
    memory = 2 * 500 * cpus if cgroup else 1000
    select = "CR_Core_Memory\nDefMemPerCPU=500" if cgroup else "CR_Core"
    if net is None or not nodes or len(nodes) < 2:
        ctld = f"{hostname}(127.0.0.1)"
        slurmd = (
            f"SlurmdPidFile={s}/slurmd.pid\nSlurmdLogFile={s}/slurmd.log\n"
            f"SlurmdSpoolDir={s}/spool"
        )
        node_lines = (
            f"NodeName={NODE} NodeHostname={hostname} NodeAddr=127.0.0.1 CPUs={cpus} "
            f"RealMemory={memory}{gres} State=UNKNOWN"
        )
        members = NODE
    else:
        ctld = f"{hostname}({net.host_addr})"
        # %n: each slurmd its own files (Slurm puts the node's name in).
        n = lay.root / "nodes" / "%n"
        # One spool path on every node, as on real sites (a job reading its batch script has
        # it open there): each node's mount namespace binds its own directory over it.
        slurmd = (
            f"SlurmdPidFile={n}/slurmd.pid\nSlurmdLogFile={n}/slurmd.log\n"
            f"SlurmdSpoolDir={s}/spool\n"
            # A node killed without warning is DOWN (and its jobs requeued) this soon.
            "SlurmdTimeout=10"
        )
        node_lines = "\n".join(
            f"NodeName={name} NodeHostname={name} NodeAddr={net.addr(i)} CPUs={cpus} "
            f"RealMemory={memory}{gres} State=UNKNOWN"
            for i, name in enumerate(nodes)
        )
        members = ",".join(nodes)
    title = "single-node" if not nodes or len(nodes) < 2 else f"{len(nodes)}-node"
    return f"""\
# A throwaway {title} cluster made by `stasis-dev local-cluster up`.
ClusterName=stasis-local
SlurmctldHost={ctld}
SlurmctldPort={commands.free_port()}
SlurmdPort={commands.free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={lay.munge}/munge.sock,cred_expire=5
StateSaveLocation={s}/state
SlurmctldPidFile={s}/slurmctld.pid
SlurmctldLogFile={s}/slurmctld.log
{slurmd}
{"" if configless else f"PlugStackConfig={lay.etc}/plugstack.conf"}
ProctrackType=proctrack/{"cgroup" if cgroup else "linuxproc"}
TaskPlugin=task/{"cgroup" if cgroup else "none"}
{acct}
{"GresTypes=gpu" if gpus else ""}
JobCompType=jobcomp/filetxt
JobCompLoc={s}/jobcomp.txt
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters={select}
SlurmdParameters=config_overrides
{"SlurmctldParameters=enable_configless" if configless else ""}
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
KillWait=5
{JOB_CONTAINER if job_container else ""}
# A job's record outlives the half hour a test suite may take to look at it again.
MinJobAge=3600
InactiveLimit=0
Waittime=0
ReturnToService=2
MpiDefault=none
{node_lines}
PartitionName=low Nodes={members} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={grace_s}
PartitionName=high Nodes={members} Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


def _client_env(lay: SlurmClusterDirs) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        **lay.env(),
        **commands.session_mark(),
    }


def _wait(pred: Any, timeout_s: float, what: str) -> None:
    if not poll(pred, timeout_s, 0.1):
        raise SlurmError(f"local cluster: timed out after {timeout_s:.0f} s waiting for {what}")


# -- several nodes, each a host of its own (stasis.dev.nodehost) ----------------------------------

# The ids of the local clusters' networks (tests/nodes.py takes 220..251, k8s local nodes 252).
_FIRST_NET, _LAST_NET = 20, 219

# What every node has of its own (read by the tests).
PRIVATE_DIRS = nodehost.PRIVATE_DIRS


def _shared_paths(lay: SlurmClusterDirs) -> list[str]:
    """What stays visible at its own path inside every node even where it lies under a private
    directory (a cluster made in /tmp, a test root's venv in /tmp): the cluster's directory,
    this Python and the stasis package."""
    package = Path(__file__).resolve().parents[1]
    return sorted({str(lay.root), sys.prefix, str(package.parent)})


def _holder(state: dict[str, Any], node: str) -> int | None:
    """The pid of the process that holds `node`'s namespaces, while it is that process (a pid
    the kernel gave to another since is not: its network's processes are killed by it)."""
    holder = state.get("holders", {}).get(node)
    try:
        held = bool(holder) and Path(f"/proc/{holder}/cmdline").read_bytes() == b"sleep\0infinity\0"
    except OSError:
        return None
    return int(holder) if held else None


def _nodes_up(lay: SlurmClusterDirs, state: dict[str, Any]) -> Net:
    """The private network and each node on it, with its own slurmd spool at the one
    SlurmdSpoolDir path; each recorded in `state` as soon as it exists, so that `down` ends
    what was made if a later step fails."""
    net = nodehost.claim_net(_FIRST_NET, _LAST_NET)
    state["net_id"] = net.net_id
    holders: dict[str, int] = state.setdefault("holders", {})
    write_state(lay, state)
    (lay.root / "ns").mkdir(exist_ok=True)
    for i, node in enumerate(state["nodes"]):
        holders[node] = nodehost.start_holder(
            node,
            lay.root / "ns" / f"{node}.holder",
            _shared_paths(lay),
            binds=[(str(lay.node_dir(node) / "spool"), str(lay.slurm / "spool"))]
            # configless: the node has no slurm.conf but the one slurmd fetches.
            + ([(str(_no_etc(lay)), str(lay.etc))] if state.get("configless") else []),
            **_cgroup_holder(state, node),
        )
        write_state(lay, state)
        nodehost.attach(net, holders[node], i)
    return net


def _no_etc(lay: SlurmClusterDirs) -> Path:
    """An empty directory that hides the cluster's etc/ on the nodes of a configless cluster."""
    return lay.root / "nodes" / "no-etc"


# Where a configless node finds its configuration: slurmd (22.05 and later) links it to the
# copy it fetched from slurmctld (SlurmdSpoolDir/conf-cache).
CONFIGLESS_CONF = Path("/run/slurm/conf/slurm.conf")


def node_slurm_conf(lay: SlurmClusterDirs, node: str) -> Path:
    """The slurm.conf a command on `node` reads: the cluster's, or on a configless cluster
    the copy its slurmd fetched."""
    if read_state(lay).get("configless"):
        return CONFIGLESS_CONF
    return lay.slurm_conf


def _munge_on_nodes(lay: SlurmClusterDirs, state: dict[str, Any]) -> None:
    """configless: a slurmd fetches its configuration before it has read AuthInfo, so it asks
    munged at munge's default socket; each node gets the cluster's munged there."""
    link = lay.munge / "munge.socket.2"
    if not link.is_symlink():
        link.symlink_to("munge.sock")
    for node in state["nodes"]:
        commands.slurm(
            [
                *_node_prefix(lay, node),
                "sh",
                "-ec",
                'mkdir -p /run/munge && mount --bind "$1" /run/munge',
                "sh",
                str(lay.munge),
            ],
            _client_env(lay),
        )


def _cgroup_holder(state: dict[str, Any], node: str) -> dict[str, Any]:
    """What `node`'s holder needs for a cgroup subtree of its own (--cgroup), else nothing."""
    if "cgroup" not in state:
        return {}
    m = slurmcgroup.machine()
    return {
        "cgroups": slurmcgroup.make_node(m, state["cgroup"]["base"], node),
        "cgroup_mounts": slurmcgroup.node_mounts(m),
    }


def _cgroup_node_up(lay: SlurmClusterDirs, state: dict[str, Any]) -> None:
    """One node with --cgroup: a holder of a mount and a cgroup namespace only (the node is
    this machine otherwise), so that its slurmd's cgroups are the cluster's own."""
    (lay.root / "ns").mkdir(exist_ok=True)
    holders: dict[str, int] = state.setdefault("holders", {})
    holders[NODE] = nodehost.start_holder(
        NODE,
        lay.root / "ns" / f"{NODE}.holder",
        [],
        net=False,
        host=False,
        **_cgroup_holder(state, NODE),
    )
    write_state(lay, state)


def _cgroup_down(lay: SlurmClusterDirs, state: dict[str, Any]) -> None:
    """End the one node's holder and what is left in the cluster's cgroups (processes of its
    jobs that outlived slurmd: each is in a cgroup of this cluster's), then remove them; the
    cluster's directory is no longer a mount of its own."""
    if "cgroup" not in state:
        return
    if "net_id" not in state:
        holder = _holder(state, NODE)
        if holder:
            nodehost.end_holder(holder)
    base = state["cgroup"]["base"]
    for h in slurmcgroup.hierarchies():
        top = Path(h.mountpoint) / base
        for procs in top.glob("**/cgroup.procs") if top.is_dir() else ():
            for pid in procs.read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
    slurmcgroup.remove(base)


def _nodes_down(state: dict[str, Any]) -> None:
    if "net_id" not in state:
        return
    net = Net(int(state["net_id"]))
    for node in state.get("nodes", []):
        holder = _holder(state, node)
        if holder:
            nodehost.end_holder(holder)
        # A cluster brought up before its holders held the nodes' networks named them in
        # /run/netns.
        if net.netns_path(node).exists():
            commands.slurm(["ip", "netns", "del", net.netns(node)], check=False)
    nodehost.release_net(net)


def _node_prefix(lay: SlurmClusterDirs, node: str) -> list[str]:
    """How to run a command inside `node` (nothing on a one-node cluster)."""
    state = read_state(lay)
    several, cgroup = "net_id" in state, "cgroup" in state
    if not several and not cgroup:
        return []
    holder = _holder(state, node)
    if not holder:
        raise SlurmError(
            f"node {node} of the local cluster in {lay.root} has lost its "
            "namespaces (their holder process is gone): `local-cluster down`, "
            "then `up` again"
        )
    inside = nodehost.prefix(holder, net=several, cgroup=cgroup, host=several)
    if not cgroup:
        return inside
    # One node with --cgroup: this machine's namespaces but for its mounts and cgroups.
    join = slurmcgroup.join_prefix(slurmcgroup.machine(), state["cgroup"]["base"], node)
    return [*join, *inside]


# -- up, down ----------------------------------------------------------------------------------


def up(
    root: Path,
    *,
    cpus: int = 8,
    grace_s: int = 10,
    socket_group: str = "",
    warn_s: int = 60,
    accounting: bool = False,
    nodes: int = 1,
    without_stasis: tuple[str, ...] = (),
    gpus: int = 0,
    job_container: bool = False,
    cgroup: bool | None = None,
    configless: bool = False,
) -> SlurmClusterDirs:
    """Start the cluster under `root` (created if needed); returns its layout.

    `gpus`: GPUs each node offers to jobs (`--gres=gpu:N`), counted by Slurm and its accounting
    (GPU-hours in `stasis slurm report`) but without devices: none of these machines has one.

    `without_stasis`: nodes that have no stasis at all (no SPANK plugin: their slurmd reads a
    slurm.conf of their own whose plugstack is empty; no daemon), as a node of a site that
    installed stasis on some nodes only.

    `job_container`: each job in a mount namespace of its own with a private /tmp (a directory
    under <root>/job-containers/<node>/<jobid>) and /dev/shm, as sites with Slurm's
    job_container/tmpfs have it; <root> must then not be under /tmp (jobs would not see it).

    `cgroup`: Slurm as sites run it, proctrack/cgroup and task/cgroup with ConstrainRAMSpace
    (--mem is a hard limit), each node's slurmd in a cgroup subtree of its own
    (stasis.dev.slurmcgroup); None (the default): so, unless `job_container`. False:
    proctrack/linuxproc and task/none.

    `configless`: slurmctld serves its configuration (enable_configless) and each node's
    slurmd fetches it (`--conf-server`) into its cache; the nodes have no slurm.conf of their
    own (the cluster's etc/ is an empty directory there), as on sites that run Slurm so."""
    if os.geteuid() != 0:
        raise UsageError("local-cluster up must run as root (it starts slurmd and munged)")
    if not 1 <= nodes <= MAX_NODES:
        raise UsageError(f"--nodes must be 1 to {MAX_NODES}")
    if not 0 <= gpus <= 64:
        raise UsageError("--gpus must be 0 to 64")
    root = root.absolute()
    _check_path(root)
    if cgroup and job_container:
        # The same failure: with cgroups the one node has a mount namespace of its own too
        # (seen: its jobs never start).
        raise UsageError(
            "--job-container works without cgroups only: add --no-cgroup (the node's own "
            "mount namespace, which --cgroup gives it, defeats job_container/tmpfs)"
        )
    if cgroup is None:  # the default: Slurm as sites run it, unless job_container/tmpfs
        cgroup = not job_container
    if job_container and nodes > 1:
        # Seen with Slurm 22.05: in the nodes' own mount namespaces job_container/tmpfs fails
        # to make the job's ("_create_ns: ns base mount failed", "/tmp mount failed").
        raise UsageError("--job-container works with one node only (--nodes 1)")
    if job_container and str(root).startswith(("/tmp/", "/var/tmp/")):
        raise UsageError(
            f"--job-container: {root} is under a directory each job sees as its "
            "own; give a --dir outside /tmp and /var/tmp"
        )
    machine = slurmcgroup.machine() if cgroup else None
    lay = SlurmClusterDirs(root)
    if lay.state_file.exists() and status(root)["running"]:
        raise UsageError(
            f"a local cluster is already running in {root}; "
            "`stasis-dev local-cluster down` first"
        )
    for tool in ("munged", "slurmctld", "slurmd", "sinfo"):
        if not shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin"):
            raise UsageError(
                f"{tool} is not installed; run `make install` " "(scripts/install-slurm.sh)"
            )
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    # A clean controller state: job ids start at 1 again (jobs of an earlier `up` are gone).
    shutil.rmtree(lay.slurm / "state", ignore_errors=True)
    names = node_names(nodes)
    bare = sorted(set(without_stasis))
    if bare and nodes < 2:
        raise UsageError("--without-stasis needs several nodes (--nodes N)")
    for node in bare:
        if node not in names:
            raise UsageError(
                f"--without-stasis {node}: no such node (nodes: " f"{', '.join(names)})"
            )
    if len(bare) == len(names):
        raise UsageError("at least one node must have stasis")
    if configless and (nodes < 2 or bare):
        raise UsageError(
            "--configless needs several nodes (--nodes N) and no --without-stasis: only a node "
            "of its own has a /run and an etc/ that are not this machine's"
        )
    dirs = [lay.etc, lay.slurm, lay.slurm / "state", lay.slurm / "spool", lay.stasis, lay.lib]
    dirs += [p for n in names if nodes > 1 for p in (lay.node_dir(n), lay.node_dir(n) / "spool")]
    dirs += [_no_etc(lay)] if configless else []
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
    started: dict[str, int] = {}
    state: dict[str, Any] = {"pids": started, "nodes": names, "without_stasis": bare}
    if configless:
        state["configless"] = True
    if machine is not None:
        state["cgroup"] = {"version": machine.version, "base": slurmcgroup.base_name(root)}
        (lay.etc / "cgroup.conf").write_text(slurmcgroup.cgroup_conf(machine))
    else:
        (lay.etc / "cgroup.conf").unlink(missing_ok=True)
    write_state(lay, state)
    restore_signals = _terminate_as_error()
    try:
        net = _nodes_up(lay, state) if nodes > 1 else None
        if machine is not None and nodes == 1:
            _cgroup_node_up(lay, state)
        started["munged"] = _start_munge(lay)
        if configless:
            _munge_on_nodes(lay, state)
        hostname = socket.gethostname().split(".")[0]
        acct_conf = ""
        if accounting:
            acct_conf = slurmaccounting.start(lay, started)
        lay.slurm_conf.write_text(
            slurm_conf_text(
                lay,
                cpus=cpus,
                grace_s=grace_s,
                hostname=hostname,
                accounting=acct_conf,
                nodes=names,
                net=net,
                gpus=gpus,
                job_container=job_container,
                cgroup=machine is not None,
                configless=configless,
            )
        )
        (lay.slurm_conf.parent / "gres.conf").write_text(_gres_conf(lay, gpus))
        if job_container:
            base = lay.root / "job-containers"
            base.mkdir(exist_ok=True)
            (lay.etc / "job_container.conf").write_text(f"AutoBasePath=true\nBasePath={base}\n")
        _make_site_key(lay)
        remote_port = (
            commands.free_port()
        )  # one port cluster-wide: `dump --slurm-job`, `slurm drain`
        for node in names:
            lay.config_of(node).write_text(_stasis_config(lay, node, socket_group, remote_port))
        install.install(
            install.InstallOptions(
                roles=frozenset(install.ROLES),
                slurm_conf=lay.slurm_conf,
                lib_dir=lay.lib,
                # %n: the SPANK plugin reads the config of the node it runs on.
                stasis_config=lay.config_of("%n") if nodes > 1 else lay.config_of(NODE),
                systemd_dir=None,
                warn_s=warn_s,
            ),
            out=None,
        )
        for node in bare:
            _write_bare_conf(lay, node)
        write_state(lay, state)
        for node in names:
            if node in bare:
                continue
            started[_daemon_key(lay, node)] = _start_stasis(lay, node)
            write_state(lay, state)
        env = _client_env(lay)
        commands.slurm(["slurmctld", "-f", str(lay.slurm_conf), "-c"], env)
        _wait(
            lambda: detached.alive(detached.read_pid(lay.slurm / "slurmctld.pid")), 20, "slurmctld"
        )
        started["slurmctld"] = detached.read_pid(lay.slurm / "slurmctld.pid") or 0
        write_state(lay, state)
        for node in names:
            started[_slurmd_key(lay, node)] = _start_slurmd(lay, node)
            write_state(lay, state)

        def idle() -> bool:
            r = commands.slurm(["sinfo", "-h", "-N", "-o", "%N %T"], env, check=False)
            seen = dict(line.split()[:2] for line in r.stdout.splitlines() if line.split())
            return r.returncode == 0 and all(seen.get(n, "").rstrip("*") == "idle" for n in names)

        _wait(idle, _UP_TIMEOUT_S, f"node(s) {', '.join(names)} to be idle")
    except BaseException:
        write_state(lay, state)
        down(root)
        raise
    finally:
        restore_signals()
    return lay


def _terminate_as_error() -> Callable[[], None]:
    """Until the returned function is called, SIGTERM and SIGHUP (a harness's timeout, a
    closed terminal) end `up` as a failure does: what it started so far is stopped, not left
    running. A second one is ignored while that is done. Returns what restores the handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    signals = (signal.SIGTERM, signal.SIGHUP)

    def end(signum: int, _frame: object) -> None:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, end) for s in signals}

    def restore() -> None:
        for s, handler in old.items():
            signal.signal(s, handler)

    return restore


def _daemon_key(lay: SlurmClusterDirs, node: str) -> str:
    return "stasis" if len(lay.nodes()) < 2 else f"stasis:{node}"


def _slurmd_key(lay: SlurmClusterDirs, node: str) -> str:
    return "slurmd" if len(lay.nodes()) < 2 else f"slurmd:{node}"


def _bare_conf(lay: SlurmClusterDirs, node: str) -> Path:
    return lay.node_dir(node) / "slurm.conf"


def _gres_conf(lay: SlurmClusterDirs, gpus: int) -> str:
    """gres.conf (read from slurm.conf's directory) for `gpus` stand-in GPUs per node. slurmd
    counts a GPU only by its device file, and wants a character device: each is a node like
    /dev/null's (1:3), which no job is given with task/none."""
    if not gpus:
        return ""
    devices = lay.root / "gpus"
    devices.mkdir(exist_ok=True)
    for i in range(gpus):
        dev = devices / f"gpu{i}"
        if not dev.exists():
            os.mknod(dev, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    last = f"[0-{gpus - 1}]" if gpus > 1 else "0"
    return f"Name=gpu File={devices}/gpu{last}\n"


def _write_bare_conf(lay: SlurmClusterDirs, node: str) -> None:
    """The cluster's slurm.conf but for an empty plugstack: this node loads no stasis plugin.
    (slurmctld logs that its slurm.conf differs; nodes of real sites differ the same way.)"""
    empty = lay.node_dir(node) / "plugstack.conf"
    empty.write_text("# no stasis on this node\n")
    lines = [
        f"PlugStackConfig={empty}" if line.startswith("PlugStackConfig=") else line
        for line in lay.slurm_conf.read_text().splitlines()
    ]
    _bare_conf(lay, node).write_text("\n".join(lines) + "\n")
    for name in ("gres.conf", "cgroup.conf"):  # read from slurm.conf's directory
        if (lay.slurm_conf.parent / name).exists():
            shutil.copyfile(lay.slurm_conf.parent / name, _bare_conf(lay, node).parent / name)


def _slurmd_pid_file(lay: SlurmClusterDirs, node: str) -> Path:
    if len(lay.nodes()) < 2:
        return lay.slurm / "slurmd.pid"
    return lay.node_dir(node) / "slurmd.pid"


def _make_site_key(lay: SlurmClusterDirs) -> None:
    """One key every node signs with and trusts: a checkpoint of one restores on another."""
    if lay.site_key.exists():
        return
    fd = os.open(lay.site_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, os.urandom(32))
    finally:
        os.close(fd)


def _stasis_config(lay: SlurmClusterDirs, node: str, socket_group: str, remote_port: int) -> str:
    several = len(lay.nodes()) > 1
    configless = bool(read_state(lay).get("configless"))
    home = lay.node_dir(node) if several else lay.stasis
    return (
        f"socket = {_q(str(home / 'stasis.sock'))}\n"
        f"state_dir = {_q(str(home / 'state'))}\n"
        f"store = {_q(str(lay.store))}\n"
        f"socket_group = {_q(socket_group)}\n"
        f"site_key = {_q(str(lay.site_key))}\n"
        f"slurm_node_name = {_q(node)}\n"
        + (f"node_name = {_q(node)}\n" if several else "")
        # configless: no slurm_conf, as on such a site's nodes (stasis finds Slurm's copy).
        + ("" if configless else f"slurm_conf = {_q(str(lay.slurm_conf))}\n")
        + f"slurm_remote_port = {remote_port}\n"
    )


def _start_munge(lay: SlurmClusterDirs) -> int:
    munge_user = pwd.getpwnam("munge")
    lay.munge.mkdir(exist_ok=True)
    os.chown(lay.munge, munge_user.pw_uid, munge_user.pw_gid)
    os.chmod(lay.munge, 0o755)  # munged refuses 0700 for the socket's directory
    key = lay.munge / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
    os.chown(key, munge_user.pw_uid, munge_user.pw_gid)
    os.chmod(key, 0o400)
    m = lay.munge
    commands.slurm(
        [
            "runuser",
            "-u",
            "munge",
            "--",
            "munged",
            f"--socket={m}/munge.sock",
            f"--key-file={key}",
            f"--log-file={m}/munged.log",
            f"--pid-file={m}/munged.pid",
            f"--seed-file={m}/munged.seed",
            "--force",
        ]
    )
    _wait(
        lambda: (m / "munge.sock").exists() and detached.alive(detached.read_pid(m / "munged.pid")),
        10,
        "munged",
    )
    return detached.read_pid(m / "munged.pid") or 0


def _start_stasis(lay: SlurmClusterDirs, node: str) -> int:
    """Start `node`'s stasis daemon detached (inside the node): it outlives this command."""
    config = lay.config_of(node)
    home = config.parent
    log = home / "daemon.log"
    env = {**_client_env(lay), "LANG": "C.UTF-8", "STASIS_CONFIG": str(config)}
    if read_state(lay).get("configless"):
        del env["SLURM_CONF"]  # as a configless site's daemon: nothing names slurm.conf
    pid_file = home / "daemon.pid"
    pid_file.unlink(missing_ok=True)  # what it names below is this start's daemon
    try:
        pid = detached.start(
            [*_node_prefix(lay, node), *detached.stasis_command(), "daemon"], pid_file, log, env
        )
        detached.wait_listening(
            pid,
            home / "stasis.sock",
            log,
            20,
            lambda why: SlurmError(f"the stasis daemon of {node} did not " f"start: {why}"),
        )
    except BaseException:
        # Not recorded yet by the caller (`up` failed or was ended meanwhile): stopped here,
        # or it would outlive the cluster.
        detached.stop(detached.read_pid(pid_file))
        raise
    assert pid is not None
    return pid


def _job_container_prefix(lay: SlurmClusterDirs) -> list[str]:
    """What slurmd runs under with job_container/tmpfs: a mount namespace of its own, made on
    one CPU, and that CPU only.

    Slurm makes each job's namespace in a child of the extern step and binds the child's
    /proc/PID/ns/mnt onto a file, which the kernel refuses (EINVAL, "_create_ns: ns base mount
    failed: Invalid argument", the job held "launch failed") when the new namespace's id is not
    above that of the namespace doing the bind (its loop check). Seen on kernel 6.18: namespace
    ids are handed out from per-CPU batches, so in any mount namespace but the machine's first
    (a test root, a container) a child's namespace made on another CPU than the parent's was has
    a lower id about half the time (reproduced with `unshare -m` and `mount --bind`: always on
    one CPU, never on the other; never in the initial namespace, where a site's slurmd runs).
    Made on one CPU, with slurmd and everything it starts kept there, every job's namespace has
    a higher id than slurmd's. The jobs of such a cluster share that CPU."""
    if "JobContainerType=job_container/tmpfs" not in lay.slurm_conf.read_text():
        return []
    cpu = min(os.sched_getaffinity(0))
    return ["taskset", "--cpu-list", str(cpu), "unshare", "--mount", "--propagation", "slave"]


def _start_slurmd(lay: SlurmClusterDirs, node: str) -> int:
    pid_file = _slurmd_pid_file(lay, node)
    pid_file.unlink(missing_ok=True)
    state = read_state(lay)
    env = _client_env(lay)
    if state.get("configless"):
        port = install.conf_value(lay.slurm_conf.read_text(), "SlurmctldPort")
        source = ["--conf-server", f"{Net(int(state['net_id'])).host_addr}:{port}"]
        del env["SLURM_CONF"]  # nothing but the server tells it where its configuration is
    else:
        conf = _bare_conf(lay, node) if node in state.get("without_stasis", []) else lay.slurm_conf
        source = ["-f", str(conf)]
    prefix = [*_node_prefix(lay, node), *_job_container_prefix(lay)]
    commands.slurm([*prefix, "slurmd", *source, "-N", node], env)
    _wait(lambda: detached.alive(detached.read_pid(pid_file)), 20, f"slurmd of {node}")
    return detached.read_pid(pid_file) or 0


def _stop_order(pids: dict[str, int]) -> list[str]:
    """Nodes first, then the controller, the stasis daemons, accounting, munge last."""

    def rank(name: str) -> int:
        if name.startswith("slurmdbd"):
            return 3
        for i, prefix in enumerate(("slurmd", "slurmctld", "stasis")):
            if name.startswith(prefix):
                return i
        return 9 if name == "munged" else 4

    return sorted(pids, key=rank)


def _jobs(lay: SlurmClusterDirs) -> list[str]:
    r = commands.slurm(["squeue", "-h", "-o", "%i"], _client_env(lay), check=False)
    return r.stdout.split() if r.returncode == 0 else []


def down(root: Path) -> None:
    """Cancel every job, stop every daemon `up` started, take its network away. The directory
    stays (logs)."""
    lay = SlurmClusterDirs(root.absolute())
    state = read_state(lay)
    pids: dict[str, int] = state.get("pids") or {}
    if detached.alive(pids.get("slurmctld")):
        # Best effort: a controller that does not answer (its slurmdbd gone, say) must not
        # keep the daemons below from being stopped.
        try:
            jobs = _jobs(lay)
            if jobs:
                commands.slurm(["scancel", *jobs], _client_env(lay), check=False)
                _wait(lambda: not _jobs(lay), 30, "the jobs to end")
        except StasisError:
            pass
    for name in _stop_order(pids):
        detached.stop(pids.get(name))
    for pid in _reexecuted(lay):
        detached.stop(pid)
    for node in state.get("nodes", []):
        _kill_node_processes(lay, state, node)
    _nodes_down(state)
    _cgroup_down(lay, state)
    try:
        lay.state_file.unlink()
    except FileNotFoundError:
        pass


# Slurm's daemons that re-execute themselves: from 23.11 on, `scontrol reconfigure` makes
# slurmctld and slurmd start a new process (SLURMCTLD_RECONF / SLURMD_RECONF in its environment)
# and the recorded one exits.
_REEXECUTING = ("slurmctld", "slurmd", "slurmdbd")


def _reexecuted(lay: SlurmClusterDirs) -> list[int]:
    """Slurm daemons of this cluster (their command line names its directory) that `up` did not
    record: the processes a reconfigure put in place of the recorded ones."""
    mine = f"{lay.root}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        # By its argv[0]: Debian 13's binaries are slurmctld-wlm and slurmd-wlm (alternatives),
        # which is what their comm says.
        if os.path.basename(argv.split(b"\0", 1)[0]).decode(errors="replace") not in _REEXECUTING:
            continue
        if mine in argv:
            found.append(int(entry.name))
    return found


def _pids(lay: SlurmClusterDirs) -> dict[str, int]:
    pids: dict[str, int] = read_state(lay).get("pids") or {}
    return pids


def stop_daemon(root: Path, node: str = NODE) -> None:
    """Stop only a node's stasis daemon (its jobs then run unprotected)."""
    lay = SlurmClusterDirs(root.absolute())
    detached.stop(_pids(lay).get(_daemon_key(lay, node)))


def start_daemon(root: Path, node: str = NODE) -> None:
    """Start a node's stasis daemon again after `stop_daemon`."""
    lay = SlurmClusterDirs(root.absolute())
    state = read_state(lay)
    pids = state.setdefault("pids", {})
    key = _daemon_key(lay, node)
    if detached.alive(pids.get(key)):
        return
    pids[key] = _start_stasis(lay, node)
    write_state(lay, state)


# -- what happens to nodes ---------------------------------------------------------------------


def _check_node(lay: SlurmClusterDirs, node: str) -> None:
    if node not in lay.nodes():
        raise UsageError(
            f"no node {node!r} in the local cluster in {lay.root} "
            f"(nodes: {', '.join(lay.nodes())})"
        )


def _netns_inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _node_netns(state: dict[str, Any], node: str) -> int | None:
    """The inode of `node`'s network namespace: its holder's, or for a cluster brought up
    before the holders held the nodes' networks (the holder is in this machine's), the one
    named in /run/netns."""
    holder = _holder(state, node)
    if holder:
        ino = _netns_inode(Path(f"/proc/{holder}/ns/net"))
        if ino is not None and ino != _netns_inode(Path("/proc/self/ns/net")):
            return ino
    return _netns_inode(Net(int(state["net_id"])).netns_path(node))


def _kill_node_processes(lay: SlurmClusterDirs, state: dict[str, Any], node: str) -> list[int]:
    """SIGKILL every process of `node` (several nodes only) but its holder: the node stays, to
    be started again. Its processes are those in its network namespace or its UTS namespace
    (the parts of a job across nodes run in a job network of their own, still on the node's
    host name); those a freezer holds are thawed to die (a cut's frozen parts), none runs on."""
    if "net_id" not in state:
        return []
    holder = _holder(state, node)
    net = _node_netns(state, node)
    uts = _netns_inode(Path(f"/proc/{holder}/ns/uts")) if holder else None
    if uts == _netns_inode(Path("/proc/self/ns/uts")):
        uts = None  # a holder without a host of its own: the network alone says
    if net is None and uts is None:
        return []
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == holder:
            continue
        try:
            ours = os.stat(entry / "ns" / "net").st_ino == net
            ours = ours or os.stat(entry / "ns" / "uts").st_ino == uts
            if not ours:
                continue
            os.kill(int(entry.name), signal.SIGKILL)
            killed.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    if killed and "cgroup" in state:
        _thaw_node(state["cgroup"]["base"], node)
    return killed


def _thaw_node(base: str, node: str) -> None:
    """Thaw every freezer cgroup of `node` (v1: a SIGKILLed task it holds dies only thawed)."""
    for h in slurmcgroup.hierarchies():
        top = Path(h.mountpoint) / base / node
        for state in top.glob("**/freezer.state") if top.is_dir() else ():
            try:
                if state.read_text().strip() != "THAWED":
                    state.write_text("THAWED")
            except OSError:
                continue  # gone meanwhile


def kill_node(root: Path, node: str) -> list[int]:
    """The node fails: its slurmd, its stasis daemon and every job process on it are killed
    at once, without warning (SIGKILL). Slurm finds it DOWN after SlurmdTimeout."""
    lay = SlurmClusterDirs(root.absolute())
    _check_node(lay, node)
    state = read_state(lay)
    if "net_id" not in state:
        raise UsageError("kill-node needs a cluster of several nodes (up --nodes N)")
    killed = _kill_node_processes(lay, state, node)
    poll(lambda: not _kill_node_processes(lay, state, node), 10, 0.1)
    return killed


def start_node(root: Path, node: str) -> None:
    """Bring a killed node back: its stasis daemon, then its slurmd (Slurm returns it to
    service when it registers: ReturnToService=2)."""
    lay = SlurmClusterDirs(root.absolute())
    _check_node(lay, node)
    state = read_state(lay)
    pids = state.setdefault("pids", {})
    if node not in state.get("without_stasis", []) and not detached.alive(
        pids.get(_daemon_key(lay, node))
    ):
        pids[_daemon_key(lay, node)] = _start_stasis(lay, node)
    if not detached.alive(pids.get(_slurmd_key(lay, node))):
        pids[_slurmd_key(lay, node)] = _start_slurmd(lay, node)
    write_state(lay, state)


def exec_argv(root: Path, node: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """How to run `argv` on `node`: inside its namespaces, with its stasis config."""
    lay = SlurmClusterDirs(root.absolute())
    _check_node(lay, node)
    env = {
        **os.environ,
        "SLURM_CONF": str(node_slurm_conf(lay, node)),
        "STASIS_CONFIG": str(lay.config_of(node)),
    }
    return [*_node_prefix(lay, node), *argv], env


def status(root: Path) -> dict[str, Any]:
    lay = SlurmClusterDirs(root.absolute())
    pids = _pids(lay)
    daemons = {name: detached.alive(pids.get(name)) for name in sorted(pids)}
    if not pids:
        daemons = {name: False for name in ("munged", "slurmctld", "slurmd", "stasis")}
    return {
        "dir": str(lay.root),
        "slurm_conf": str(lay.slurm_conf),
        "stasis_config": str(lay.stasis_config),
        "nodes": lay.nodes(),
        # "v1" or "v2": Slurm's cgroup plugin (proctrack/cgroup, task/cgroup); None: --no-cgroup.
        "cgroup": read_state(lay).get("cgroup", {}).get("version"),
        "daemons": daemons,
        "running": all(daemons.values()),
    }
