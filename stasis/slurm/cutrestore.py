"""A Slurm job on several nodes resumed from a cut when it starts again, on whichever nodes Slurm
gave it: driven by taskinit (root, in the batch task, before the launcher) on the new batch node.

The job prolog made each new node's part of the job's network with the address of that node's
place in the new NodeList (stasis.slurm.jobnetnode): the i-th node has `.(i+1)`, whichever node
it is. `cut.restore_plan` pairs every checkpoint of a complete cut with the node that has its
address now. Then:

1. every node's part of the job's network is held still (`net`, held): a part restored early
   must not reach a peer whose node has no socket for it yet (that kernel would answer with a
   reset, and the connection between the two ranks would be lost for good);
2. the batch tree is restored here first, into the job's network namespace, as taskinit
   restores a one-node job (the task's child, in its cgroups): it is the one part this node can
   end without a trace should another fail (`_end_batch`), and a damaged batch checkpoint then
   costs no other node a restore;
3. every other part is restored by its node's daemon (over the remote listener, root's munge
   credential, this node's included), labelled with its key again, so that the launch agent
   that started it finds it (the agent in the batch tree, its network held meanwhile, asks
   again until it does);
4. every node's network is let go: TCP sends again what the hold dropped.

Any part that cannot be restored: every part restored so far is killed and the networks let go,
nothing runs; the caller tries the next older cut or holds the job with the reason (never a job
with a rank missing). The batch tree's connections are put in repair mode before it is killed:
none is left to the kernel in this node's namespace (FIN-WAIT, TIME-WAIT, resent through the
hold), where it would make the next cut's restore be refused. The other parts are killed by
their daemons, which leave such sockets behind: in a job on two nodes none was restored before
the failure, in one on more a later part's failure leaves the earlier parts' nodes unable to
restore another cut (refused in one line) until the job's next prolog makes their networks again.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from stasis.daemon import jobnet
from stasis.daemon.users import account
from stasis.engine import Owner, jobnetns
from stasis.engine.restoring import open_as
from stasis.errors import RestoreError, StasisError
from stasis.slurm import cut, jobcut, jobnetnode, remote, scontrol
from stasis.slurm.partclient import RemoteParts
from stasis.store import Manifest, Store

if TYPE_CHECKING:
    from stasis.config import Settings

# Restores the batch tree's checkpoint into the job's network namespace (its fd): (pid, notes).
BatchRestore = Callable[[Manifest, int], tuple[int, list[str]]]


def job_net(slurm_job: str) -> jobnet.JobNet | None:
    """The job's network as its prolog made it on this node; None if it made none here."""
    try:
        text = (jobnetnode.RECORDS / slurm_job).read_text().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None
    vni = int(text)
    return jobnet.JobNet(vni=vni, subnet=jobnetnode.subnet_of(vni))


def plans(
    manifests: list[Manifest], label: str, net: jobnet.JobNet, nodes: list[str]
) -> list[cut.RestorePlan]:
    """The job's complete cuts that can be restored on `nodes`, newest first, whose batch tree
    is on `nodes[0]` (the batch host)."""
    return [
        p
        for p in cut.restore_plan(manifests, label, net, nodes)
        if any(
            k == jobcut.BATCH and n == nodes[0] for (n, _), k in zip(p.parts, p.keys, strict=True)
        )
    ]


class CutRestore:
    """One try at restoring the cut `plan` of Slurm job `slurm_job` (see the module)."""

    def __init__(
        self, settings: Settings, store: Store, slurm_job: str, net: jobnet.JobNet, nodes: list[str]
    ) -> None:
        self.settings = settings
        self.store = store
        self.slurm_job = slurm_job
        self.net = net
        self.nodes = nodes
        self._daemons: dict[str, RemoteParts] = {}

    def _daemon(self, node: str) -> RemoteParts:
        if node not in self._daemons:
            target = remote.remote_node(self.settings, node, scontrol.node_address(node))
            self._daemons[node] = RemoteParts(self.settings, target, self.slurm_job)
        return self._daemons[node]

    def _release(self) -> list[str]:
        """Let every node's network go; what could not be (one line each)."""
        left = []
        for node in self.nodes:
            try:
                self._daemon(node).net(False)
            except (StasisError, OSError) as e:
                left.append(f"the job's network on {node} is still held ({e})")
        return left

    def restore(self, plan: cut.RestorePlan, batch: BatchRestore) -> tuple[int, list[str]]:
        """The batch tree's pid and notes, every part of `plan` running; RestoreError (one
        line) when a part could not be restored: then nothing of it runs."""
        restored: list[tuple[str, str]] = []
        pid = 0
        try:
            for node in self.nodes:
                self._daemon(node).net(True)
            batch_checkpoint = next(
                c for (_, c), k in zip(plan.parts, plan.keys, strict=True) if k == jobcut.BATCH
            )
            manifest = self.store.get(batch_checkpoint)
            fd = os.open(jobnet.netns_path(self.net.vni), os.O_RDONLY | os.O_CLOEXEC)
            try:
                pid, notes = batch(manifest, fd)
            except (StasisError, OSError) as e:
                raise RestoreError(
                    f"its batch tree (checkpoint {batch_checkpoint}) could not be restored: {e}"
                ) from e
            finally:
                os.close(fd)
            for (node, checkpoint), key in zip(plan.parts, plan.keys, strict=True):
                if key == jobcut.BATCH:
                    continue
                try:
                    self._daemon(node).restore(checkpoint, key)
                except (StasisError, OSError) as e:
                    raise RestoreError(
                        f"its part {key} (checkpoint {checkpoint}) could not be restored on "
                        f"node {node}: {e}"
                    ) from e
                restored.append((node, key))
        except BaseException:
            for node, key in restored:
                try:
                    self._daemon(node).kill(key)
                except (StasisError, OSError):
                    pass  # its node's daemon kills it once the job no longer runs there
            if pid:
                _end_batch(pid)
            self._release()
            raise
        notes += self._release()
        return pid, notes


def _end_batch(pid: int) -> None:
    """Kill the restored batch tree (its namespace init `pid`, our child) without a word to its
    peers: its connections in repair mode first, so that none lives on in the job's namespace
    as the kernel's; reaped before the next cut is tried."""
    try:
        jobnetns.silence_connections(pid)
    except OSError:
        pass  # gone meanwhile: nothing of it to silence
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def tell(path: str, uid: int, gid: int, lines: list[str]) -> bool:
    """Append `lines` to the job's output file `path` now, with its owner's rights (uid, gid
    and their groups: the path is the user's to choose); whether they were written. A job
    requeued held is killed by Slurm at once: the launcher may not live to print them."""
    if not path or path.startswith("/dev/") or not lines:
        return False
    try:
        owner = Owner(uid, gid, account(uid).groups)
        fd = open_as(path, owner)
    except (StasisError, OSError):
        return False
    try:
        os.write(fd, "".join(f"{line}\n" for line in lines).encode())
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


__all__ = ["BatchRestore", "CutRestore", "job_net", "plans", "tell"]
