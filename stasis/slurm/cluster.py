"""`stasis slurm local-cluster up|down|status`: a throwaway single-node Slurm cluster.

Everything lives under one private directory with private ports and a private munge socket, so it
never clashes with a real Slurm on the machine: munged, slurmctld (started with -c: job ids restart
at 1), one slurmd (node n1), a stasis node daemon with its own socket, state and store, and the
stasis plugin set installed into the cluster's own slurm.conf. Two partitions: `low`
(preemptable, PreemptMode=REQUEUE with a GraceTime) and `high` (PreemptMode=OFF, higher tier).
With SLURM_CONF=<dir>/etc/slurm.conf the ordinary sbatch/squeue/scontrol/scancel talk to it.

    D/etc/        slurm.conf, plugstack.conf, job_submit.lua, cli_filter.lua
    D/munge/      key, socket, pid, log (owned by munge: munged refuses other owners)
    D/slurm/      StateSaveLocation, SlurmdSpoolDir, pid and log files
    D/stasis/     config.toml, daemon socket, state, checkpoint store, daemon log
    D/lib/        the built SPANK plugin and the launcher
    D/cluster.json  pids of what `up` started
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stasis.daemon import detached
from stasis.errors import SlurmError, StasisError, UsageError
from stasis.poll import poll
from stasis.slurm import install

NODE = "n1"
_UP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def munge(self) -> Path:
        return self.root / "munge"

    @property
    def slurm(self) -> Path:
        return self.root / "slurm"

    @property
    def stasis(self) -> Path:
        return self.root / "stasis"

    @property
    def stasis_config(self) -> Path:
        return self.stasis / "config.toml"

    @property
    def stasis_socket(self) -> Path:
        return self.stasis / "stasis.sock"

    @property
    def store(self) -> Path:
        return self.stasis / "store"

    @property
    def lib(self) -> Path:
        return self.root / "lib"

    @property
    def state_file(self) -> Path:
        return self.root / "cluster.json"

    def env(self) -> dict[str, str]:
        """What a client needs to talk to this cluster and its stasis daemon."""
        return {"SLURM_CONF": str(self.slurm_conf), "STASIS_CONFIG": str(self.stasis_config)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _q(value: str) -> str:
    """A TOML basic string (JSON's escaping is a subset of TOML's)."""
    return json.dumps(value)


def _check_path(path: Path) -> None:
    if any(c.isspace() for c in str(path)) or "#" in str(path):
        raise UsageError(f"{path}: Slurm's config files cannot hold paths with spaces or '#'")


def slurm_conf_text(lay: Layout, *, cpus: int, grace_s: int, hostname: str,
                    accounting: str = "") -> str:
    """`accounting`: slurm.conf lines that replace the accounting_storage/none default."""
    s = lay.slurm
    acct = accounting or "JobAcctGatherType=jobacct_gather/none\n" \
        "AccountingStorageType=accounting_storage/none"
    return f"""\
# A throwaway single-node cluster made by `stasis slurm local-cluster up`.
ClusterName=stasis-local
SlurmctldHost={hostname}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={lay.munge}/munge.sock,cred_expire=5
StateSaveLocation={s}/state
SlurmdSpoolDir={s}/spool
SlurmctldPidFile={s}/slurmctld.pid
SlurmdPidFile={s}/slurmd.pid
SlurmctldLogFile={s}/slurmctld.log
SlurmdLogFile={s}/slurmd.log
PlugStackConfig={lay.etc}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
{acct}
JobCompType=jobcomp/filetxt
JobCompLoc={s}/jobcomp.txt
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
KillWait=5
MinJobAge=300
InactiveLimit=0
Waittime=0
ReturnToService=2
MpiDefault=none
NodeName={NODE} NodeHostname={hostname} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=low Nodes={NODE} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={grace_s}
PartitionName=high Nodes={NODE} Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


def _run(cmd: list[str], env: dict[str, str] | None = None, check: bool = True
         ) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as e:
        raise UsageError(f"{cmd[0]} is not installed; run `make install` "
                         "(scripts/install-slurm.sh)") from e
    if check and result.returncode != 0:
        raise SlurmError(f"{' '.join(cmd)} failed: {(result.stderr or result.stdout).strip()}")
    return result


def _client_env(lay: Layout) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), **lay.env()}


def _wait(pred: Any, timeout_s: float, what: str) -> None:
    if not poll(pred, timeout_s, 0.1):
        raise SlurmError(f"local cluster: timed out after {timeout_s:.0f} s waiting for {what}")


def up(root: Path, *, cpus: int = 8, grace_s: int = 10, socket_group: str = "stasis",
       warn_s: int = 60, accounting: bool = False) -> Layout:
    """Start the cluster under `root` (created if needed); returns its layout."""
    if os.geteuid() != 0:
        raise UsageError("local-cluster up must run as root (it starts slurmd and munged)")
    root = root.absolute()
    _check_path(root)
    lay = Layout(root)
    if lay.state_file.exists() and status(root)["running"]:
        raise UsageError(f"a local cluster is already running in {root}; "
                         "`stasis slurm local-cluster down` first")
    for tool in ("munged", "slurmctld", "slurmd", "sinfo"):
        if not shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin"):
            raise UsageError(f"{tool} is not installed; run `make install` "
                             "(scripts/install-slurm.sh)")
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    # A clean controller state: job ids start at 1 again (jobs of an earlier `up` are gone).
    shutil.rmtree(lay.slurm / "state", ignore_errors=True)
    for d in (lay.etc, lay.slurm, lay.slurm / "state", lay.slurm / "spool", lay.stasis, lay.lib):
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
    started: dict[str, int] = {}
    try:
        started["munged"] = _start_munge(lay)
        hostname = socket.gethostname().split(".")[0]
        acct_conf = ""
        if accounting:
            from stasis.slurm import accounting as acct

            acct_conf = acct.start(lay, started)
        lay.slurm_conf.write_text(slurm_conf_text(lay, cpus=cpus, grace_s=grace_s,
                                                  hostname=hostname, accounting=acct_conf))
        lay.stasis_config.write_text(
            f"socket = {_q(str(lay.stasis_socket))}\n"
            f"state_dir = {_q(str(lay.stasis / 'state'))}\n"
            f"store = {_q(str(lay.store))}\n"
            f"socket_group = {_q(socket_group)}\n"
            f"slurm_node_name = {_q(NODE)}\n"
        )
        install.install(install.InstallOptions(
            roles=frozenset(install.ROLES), slurm_conf=lay.slurm_conf, lib_dir=lay.lib,
            stasis_config=lay.stasis_config, systemd_dir=None, warn_s=warn_s,
        ), out=None)
        started["stasis"] = _start_stasis(lay)
        env = _client_env(lay)
        _run(["slurmctld", "-f", str(lay.slurm_conf), "-c"], env)
        _wait(lambda: detached.alive(detached.read_pid(lay.slurm / "slurmctld.pid")), 20, "slurmctld")
        started["slurmctld"] = detached.read_pid(lay.slurm / "slurmctld.pid") or 0
        _run(["slurmd", "-f", str(lay.slurm_conf), "-N", NODE], env)
        _wait(lambda: detached.alive(detached.read_pid(lay.slurm / "slurmd.pid")), 20, "slurmd")
        started["slurmd"] = detached.read_pid(lay.slurm / "slurmd.pid") or 0
        lay.state_file.write_text(json.dumps({"pids": started}))

        def idle() -> bool:
            r = _run(["sinfo", "-h", "-N", "-o", "%T"], env, check=False)
            return r.returncode == 0 and {s.rstrip("*") for s in r.stdout.split()} == {"idle"}

        _wait(idle, _UP_TIMEOUT_S, "node n1 to be idle")
    except BaseException:
        lay.state_file.write_text(json.dumps({"pids": started}))
        down(root)
        raise
    return lay


def _start_munge(lay: Layout) -> int:
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
    _run(["runuser", "-u", "munge", "--", "munged", f"--socket={m}/munge.sock",
          f"--key-file={key}", f"--log-file={m}/munged.log", f"--pid-file={m}/munged.pid",
          f"--seed-file={m}/munged.seed", "--force"])
    _wait(lambda: (m / "munge.sock").exists() and detached.alive(detached.read_pid(m / "munged.pid")), 10,
          "munged")
    return detached.read_pid(m / "munged.pid") or 0


def _start_stasis(lay: Layout) -> int:
    """Start the node daemon detached: it outlives this command."""
    log = lay.stasis / "daemon.log"
    env = {**_client_env(lay), "LANG": "C.UTF-8"}
    pid = detached.start([*detached.stasis_command(), "daemon"], lay.stasis / "daemon.pid", log,
                         env)
    detached.wait_listening(pid, lay.stasis_socket, log, 20,
                            lambda why: SlurmError(f"the stasis daemon did not start: {why}"))
    assert pid is not None
    return pid


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


def _jobs(lay: Layout) -> list[str]:
    r = _run(["squeue", "-h", "-o", "%i"], _client_env(lay), check=False)
    return r.stdout.split() if r.returncode == 0 else []


def down(root: Path) -> None:
    """Cancel every job, stop every daemon `up` started. The directory stays (logs)."""
    lay = Layout(root.absolute())
    try:
        pids: dict[str, int] = json.loads(lay.state_file.read_text())["pids"]
    except (OSError, ValueError, KeyError):
        pids = {}
    if detached.alive(pids.get("slurmctld")):
        jobs = _jobs(lay)
        if jobs:
            _run(["scancel", *jobs], _client_env(lay), check=False)
            try:
                _wait(lambda: not _jobs(lay), 30, "the jobs to end")
            except StasisError:
                pass
    for name in _stop_order(pids):
        detached.stop(pids.get(name))
    try:
        lay.state_file.unlink()
    except FileNotFoundError:
        pass


def _pids(lay: Layout) -> dict[str, int]:
    try:
        pids: dict[str, int] = json.loads(lay.state_file.read_text())["pids"]
    except (OSError, ValueError, KeyError):
        pids = {}
    return pids


def stop_daemon(root: Path) -> None:
    """Stop only the cluster's stasis daemon (jobs then run unprotected)."""
    lay = Layout(root.absolute())
    detached.stop(_pids(lay).get("stasis"))


def start_daemon(root: Path) -> None:
    """Start the cluster's stasis daemon again after `stop_daemon`."""
    lay = Layout(root.absolute())
    pids = _pids(lay)
    if detached.alive(pids.get("stasis")):
        return
    pids["stasis"] = _start_stasis(lay)
    lay.state_file.write_text(json.dumps({"pids": pids}))


def status(root: Path) -> dict[str, Any]:
    lay = Layout(root.absolute())
    try:
        pids: dict[str, int] = json.loads(lay.state_file.read_text())["pids"]
    except (OSError, ValueError, KeyError):
        pids = {}
    daemons = {name: detached.alive(pids.get(name))
               for name in ("munged", "slurmctld", "slurmd", "stasis")}
    return {"dir": str(lay.root), "slurm_conf": str(lay.slurm_conf),
            "stasis_config": str(lay.stasis_config), "daemons": daemons,
            "running": all(daemons.values())}
