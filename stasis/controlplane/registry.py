"""The control plane's one entry point for the server, the policies and the dashboard: its
repositories, composed (tokens and clusters: stasis.controlplane.access; nodes: .nodes; their
checkpoints and restores: .reports; their commands: .commandqueue; events: .events), and the
orders given about a job or a node that span them (find a job, checkpoint it, verify a
checkpoint, migrate a job, drain a node). No SQL here: each repository owns its tables'."""

from __future__ import annotations

import re

from stasis.controlplane import events as event_log
from stasis.controlplane import jobgroups, migration, wire
from stasis.controlplane.access import NODE_PREFIX, Access, Principal, validate_name
from stasis.controlplane.commandqueue import CommandQueue
from stasis.controlplane.commands import CheckpointArgs, Command
from stasis.controlplane.commands import Kind as CommandKind
from stasis.controlplane.database import Database
from stasis.controlplane.nodes import Nodes, not_ready
from stasis.controlplane.reports import Reports
from stasis.controlplane.verdicts import CHECKPOINT_ID as CHECKPOINT_ID
from stasis.errors import ConflictError, NotFoundError, UsageError

# What nodes may report as ids (job ids, users, labels): checked before they reach a form, a
# path, a log or a command. Daemon job ids, Slurm ids (123, 123_4), container ids; users are
# login names or "k8s:NAMESPACE"; labels are the store's (stasis.store.manifest).
JOB_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$"
USER = r"^[A-Za-z0-9._][A-Za-z0-9._:@-]{0,99}$"
LABEL = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class Registry:
    """The repositories of one database, and the orders that span them."""

    def __init__(self, db: str) -> None:
        self.db = Database(db)
        self.url = self.db.url
        self.access = Access(self.db)
        self.reports = Reports(self.access)
        self.nodes = Nodes(self.access, self.reports)
        self.commands = CommandQueue(self.nodes, self.reports)

    def close(self) -> None:
        self.db.close()

    def authenticate(self, token: str) -> Principal:
        """Who `token` is: a node (its own credential), the admin or a cluster (a policy's hook
        token runs its policy only: stasis.controlplane.policies.refuse_hook)."""
        if token.startswith(NODE_PREFIX):
            return self.nodes.authenticate(token)
        return self.access.authenticate(token)

    def list_events(self, by: Principal, limit: int = 200) -> list[wire.Event]:
        return event_log.listed(self.db, None if by.kind == "admin" else by.cluster_id, limit)

    def find_job(
        self, by: Principal, job: str, cluster: str | None = None, node: str | None = None
    ) -> wire.Job:
        """The one job `job` that a node reports, by (cluster, node, job): a job id that
        several nodes report (two clusters, or a node repeating another's) is refused unless
        its cluster and node are given, never taken by name order."""
        if not re.fullmatch(JOB_ID, job):
            raise UsageError(
                f"bad job id {job[:100]!r}: letters, digits, '.', '_', ':' and " "'-', at most 100"
            )
        cid = self.access.cluster_id_of(cluster) if cluster else None
        where = [
            j
            for j in self.nodes.list_jobs(by)
            if j.get("job") == job
            and (cid is None or j["cluster_id"] == cid)
            and (node is None or j["node"] == node)
        ]
        if not where:
            on = (f" in cluster {cluster}" if cluster else "") + (
                f" on node {node}" if node else ""
            )
            raise NotFoundError(
                f"no node reports a job {job}{on}: `stasis controlplane jobs` " "lists them"
            )
        if len(where) > 1:
            seen = ", ".join(f"{j['cluster']}/{j['node']}" for j in where[:5])
            raise ConflictError(
                f"job {job} is reported by {len(where)} nodes ({seen}): name "
                "its cluster and node (--cluster, --node)"
            )
        return where[0]

    def queue(
        self,
        by: Principal,
        kind: CommandKind,
        job: str,
        args: CheckpointArgs,
        cluster: str | None = None,
        node: str | None = None,
    ) -> Command:
        """A command for the node that reports `job` (cluster and node: see find_job)."""
        by.admin_only()
        found = self.find_job(by, job, cluster, node)
        full: CheckpointArgs = {**args, "job": job, "kind": found.get("kind") or "daemon"}
        return self.commands.queue_for_node(found["cluster_id"], found["node"], kind, full)

    def verify_checkpoint(self, by: Principal, checkpoint_id: str, lost_after_s: float) -> Command:
        """A verify command (`stasis verify`) for checkpoint `checkpoint_id`, sent to the node
        that took it, which must be ready: its verdict is kept with the checkpoint."""
        by.admin_only()
        if not re.fullmatch(CHECKPOINT_ID, checkpoint_id):
            raise UsageError(f"bad checkpoint id {checkpoint_id[:64]!r}")
        row = self.reports.checkpoint(checkpoint_id)
        if row is None or row["deleted"] is not None:
            raise NotFoundError(
                f"no checkpoint {checkpoint_id} known here"
                + (" (deleted)" if row is not None else "")
                + ": `stasis controlplane checkpoints` lists them"
            )
        node = [
            n
            for n in self.nodes.list_nodes(by, lost_after_s)
            if n["cluster_id"] == row["cluster_id"] and n["name"] == row["node"]
        ]
        if not node:
            raise NotFoundError(
                f"node {row['node']}, which took checkpoint {checkpoint_id}, "
                "is no longer known here: `stasis verify "
                f"{checkpoint_id}` on a node that shares its store"
            )
        if node[0]["state"] != "ready":
            raise ConflictError(
                not_ready(node[0]) + f": the node that took checkpoint "
                f"{checkpoint_id} verifies it; ask again once it is ready"
            )
        return self.commands.queue_for_node(
            row["cluster_id"],
            row["node"],
            "verify",
            {
                "checkpoint": checkpoint_id,
                "label": row["label"],
                "user": row["user"],
                "reason": "asked",
            },
        )

    def migrate_job(
        self,
        by: Principal,
        job: str,
        to: str,
        extra: CheckpointArgs | None = None,
        cluster: str | None = None,
        node: str | None = None,
        lost_after_s: float = float("inf"),
    ) -> Command:
        """Stop-and-checkpoint `job` on its node, then (once that is acknowledged) restore it
        on node `to` of the same cluster, through the store both share. The restore names
        the job's label and owner as reported now, the checkpoint command, and the seal the
        source node answered with: the target node restores only the checkpoint that command
        took (stasis.controlplane.node)."""
        by.admin_only()
        validate_name(to, "node name")
        src = self.find_job(by, job, cluster, node)
        if (src.get("kind") or "daemon") != "daemon":
            raise UsageError(
                f"{src['kind']} job {job} moves where its scheduler puts it: "
                f"`stasis controlplane checkpoint {job} --stop` checkpoints and "
                "requeues it"
            )
        if src["node"] == to:
            raise UsageError(f"job {job} runs on {to} already")
        peers = [
            n
            for n in self.nodes.list_nodes(by, lost_after_s)
            if n["cluster_id"] == src["cluster_id"]
        ]
        target = [n for n in peers if n["name"] == to]
        if not target:
            raise NotFoundError(f"no node {to} in cluster {src['cluster']}")
        if target[0]["state"] == "pending":
            self.nodes.refuse_if_pending(src["cluster_id"], to)
        if target[0]["state"] != "ready":
            raise ConflictError(
                not_ready(target[0]) + ": it is no migration target; "
                "migrate to a ready node (`stasis controlplane nodes`)"
            )
        # Where the restore goes if the target fails it or is lost: the source seals for
        # these too (stasis.controlplane.node), fewest jobs first.
        alternates = [
            n["name"]
            for n in sorted(peers, key=lambda n: (int(n["jobs"]), n["name"]))
            if n["state"] == "ready" and n["name"] not in (to, src["node"])
        ]
        return self.queue(
            by,
            "checkpoint",
            job,
            {
                "leave_running": False,
                "then_restore_on": to,
                "or_on": alternates[: migration.ALTERNATES],
                "reason": f"migration to {to}",
                "label": src.get("label"),
                "user": src.get("user"),
                **(extra or {}),
            },
            src["cluster_id"],
            src["node"],
        )

    def drain(
        self,
        by: Principal,
        node: str,
        lost_after_s: float,
        reason: str = "stasis drain",
        cluster: str | None = None,
    ) -> wire.Drained:
        """Every live job of `node` off it. Where the node reports a scheduler state (Slurm,
        Kubernetes), one `drain` command has its daemon empty it in the scheduler: a Slurm
        node drained and its Slurm jobs checkpointed and requeued, a Kubernetes node cordoned
        and its pods checkpointed and evicted; the scheduler runs them again elsewhere,
        restored. Those jobs (kind other than "daemon") are listed as `handled` by that
        command. The daemon's own jobs are migrated to the other ready nodes of the cluster
        (the one with the fewest jobs first)."""
        by.admin_only()
        validate_name(node, "node name")
        all_nodes = self.nodes.list_nodes(by, lost_after_s)
        cid = self.access.cluster_id_of(cluster) if cluster else None
        mine = [
            n for n in all_nodes if n["name"] == node and (cid is None or n["cluster_id"] == cid)
        ]
        if not mine:
            raise NotFoundError(f"no node {node}" + (f" in cluster {cluster}" if cluster else ""))
        if len(mine) > 1:
            raise ConflictError(
                f"node {node} is in several clusters "
                f"({', '.join(n['cluster'] for n in mine)}): name its cluster "
                "(--cluster)"
            )
        cluster = str(mine[0]["cluster_id"])
        listed = [
            j for j in self.nodes.list_jobs(by) if j["node"] == node and j["cluster_id"] == cluster
        ]
        # A part of a Slurm job on several nodes is its Slurm job's: the node's Slurm drain
        # has the job's batch node checkpoint and requeue it whole, never the part moved alone.
        jobs = [
            j
            for j in listed
            if (j.get("kind") or "daemon") == "daemon" and jobgroups.part_of(j) is None
        ]
        theirs = [
            j
            for j in listed
            if (j.get("kind") or "daemon") != "daemon" or jobgroups.part_of(j) is not None
        ]
        # Only where the node said its scheduler knows it (a node that runs stasis's own jobs
        # only reports no scheduler state).
        by_scheduler = (
            self.access.cluster(cluster)["kind"] in ("slurm", "kubernetes")
            and mine[0]["state"] != "lost"
            and bool(mine[0].get("scheduler_state"))
        )
        if theirs and not by_scheduler:
            why = "is lost" if mine[0]["state"] == "lost" else "reports no scheduler state"
            raise UsageError(
                f"node {node} {why}: its {len(theirs)} {theirs[0]['kind']} "
                "job(s) cannot be drained in their scheduler from here"
            )
        others = {
            n["name"]: int(n["jobs"])
            for n in all_nodes
            if n["cluster_id"] == cluster and n["name"] != node and n["state"] == "ready"
        }
        if jobs and not others:
            raise UsageError(
                f"no other ready node in cluster {mine[0]['cluster']} to take the "
                f"{len(jobs)} job(s) of {node}"
            )
        scheduler = (
            self.commands.queue_for_node(cluster, node, "drain", {"reason": reason})
            if by_scheduler
            else None
        )
        moves = []
        for j in jobs:
            to = min(sorted(others), key=lambda n: others[n])
            others[to] += 1
            moves.append(self.migrate_job(by, j["job"], to, None, cluster, node, lost_after_s))
        return {
            "node": node,
            "cluster_id": cluster,
            "migrations": moves,
            "drain": scheduler,
            "handled": [
                {"job": j["job"], "kind": j["kind"], "label": j.get("label")} for j in theirs
            ],
        }
