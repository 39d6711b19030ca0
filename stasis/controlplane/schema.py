"""The control plane's tables (SQLAlchemy Core). Changes go through a new Alembic revision in
migrations/versions, never through create_all."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
    true,
)

metadata = MetaData()

clusters = Table(
    "clusters",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("kind", String(20), nullable=False),  # slurm | kubernetes
    Column("created", String(40), nullable=False),
    # A node joined with the cluster's token waits for an admin's approval (`nodes approve`)
    # before it is given commands or chosen as a target: a stolen cluster token joins no node
    # that work is sent to.
    Column("approve_joins", Boolean, nullable=False, server_default=false()),
)

# A token is shown once; only its SHA-256 is kept (tokens are 256 random bits: no salt or slow
# hash needed to keep them from being guessed back).
tokens = Table(
    "tokens",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("kind", String(20), nullable=False),  # admin | cluster
    Column("cluster_id", String(40), ForeignKey("clusters.id"), nullable=True),
    Column("sha256", String(64), nullable=False, unique=True),
    Column("created", String(40), nullable=False),
    Column("revoked", String(40), nullable=True),
    Column("expires", Integer, nullable=True),  # unix seconds; None: until revoked
)

nodes = Table(
    "nodes",
    metadata,
    Column("cluster_id", String(40), ForeignKey("clusters.id"), primary_key=True),
    Column("name", String(200), primary_key=True),
    Column("host", String(200), nullable=False),
    Column("stasis_version", String(60), nullable=False),
    Column("criu_version", String(60), nullable=True),
    Column("slurm_version", String(60), nullable=True),
    Column("check_ok", Boolean, nullable=False),
    Column("problems", Text, nullable=False),  # JSON list of the check's problems
    Column("registered", String(40), nullable=False),
    Column("last_heartbeat", Integer, nullable=False),  # unix seconds
    Column("jobs", Integer, nullable=False, default=0),
    Column("job_list", Text, nullable=False, default="[]"),  # JSON: the node's jobs
    Column("mem_total_bytes", BigInteger, nullable=True),  # its memory (for memory triggers)
    Column("scheduler_state", String(60), nullable=True),  # Slurm's: IDLE, MIXED+DRAIN, ...
    Column("lost_since", Integer, nullable=True),  # when it was found silent (an event)
    # False: joined in a cluster that approves joins, and not approved yet (state "pending").
    Column("approved", Boolean, nullable=False, server_default=true()),
)

# Commands for a node, carried out once: a node leases the next one (for `lease_s`), does it,
# and acknowledges it with its result; a lease that runs out without an acknowledgement (the
# node or the connection died) is leased again, and the node, which keeps what it did by
# command id, answers with the same result instead of doing it twice.
commands = Table(
    "commands",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("cluster_id", String(40), ForeignKey("clusters.id"), nullable=False),
    Column("node", String(200), nullable=False),
    Column("kind", String(40), nullable=False),  # checkpoint
    Column("args", Text, nullable=False),  # JSON
    Column("state", String(20), nullable=False),  # queued | leased | done | failed
    Column("attempts", Integer, nullable=False, default=0),
    Column("lease_until", Integer, nullable=True),
    Column("result", Text, nullable=True),  # JSON
    Column("created", String(40), nullable=False),
    Column("finished", String(40), nullable=True),
    # The current (or last) lease's random id: only the node holding it renews or
    # acknowledges the command, quoting it; a lease that ran out and was given again gets a
    # new one, so a late answer to the old lease is refused.
    Column("lease_id", String(40), nullable=True),
)

# Each node's own identity: a credential it got when it joined with its cluster's token
# (only its SHA-256 kept), bound to (cluster, node name). From then on the node speaks with
# it, and the cluster token only joins nodes that have none yet. An admin deletes a node's
# row (`stasis controlplane nodes reset NAME`) to let the node join again.
node_credentials = Table(
    "node_credentials",
    metadata,
    Column("cluster_id", String(40), ForeignKey("clusters.id"), primary_key=True),
    Column("node", String(200), primary_key=True),
    Column("sha256", String(64), nullable=False, unique=True),
    Column("created", String(40), nullable=False),
)

# Policies: trigger -> filter -> action. The trigger: every `every_s` seconds (0: only when
# its webhook is called); the
# filter: cluster, node, label (a glob), user; the actions: a leave-running checkpoint of every
# matching job, or retention of each matching label's newest `keep` checkpoints on each node.
policies = Table(
    "policies",
    metadata,
    Column("name", String(100), primary_key=True),
    Column("every_s", Integer, nullable=False),
    Column("action", String(40), nullable=False),  # checkpoint | retain
    Column("filters", Text, nullable=False),  # JSON {cluster, node, label, user}
    Column("keep", Integer, nullable=True),
    Column("older_than_s", Integer, nullable=True),  # retain: and none older than this
    # every (every_s; 0: only its webhook) | memory (a job above threshold_pct of its node's
    # memory) | drain (the jobs of a node its scheduler drains or holds for maintenance)
    Column("trigger", String(20), nullable=False, server_default="every"),
    Column("threshold_pct", Float, nullable=True),
    Column("stop", Boolean, nullable=False, server_default=false()),  # checkpoint: and stop
    # retain: and every checkpoint of a label whose job completed (exit 0), none running
    Column("completed", Boolean, nullable=False, server_default=false()),
    # checkpoint every "auto": each job it picks at its own Young/Daly interval
    # (stasis.controlplane.intervals); every_s is 0 then.
    Column("every_auto", Boolean, nullable=False, server_default=false()),
    # Its hook token's SHA-256: that token runs this policy (its webhook) and nothing else.
    Column("hook_sha256", String(64), nullable=True),
    Column("hook_created", String(40), nullable=True),
    Column("enabled", Boolean, nullable=False),
    Column("last_run", Integer, nullable=False),
    Column("created", String(40), nullable=False),
    UniqueConstraint("hook_sha256", name="policies_hook_once"),
)

# What happened, newest last: nodes joining, commands done or failed, policies run.
events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", String(40), nullable=False),
    Column("cluster_id", String(40), nullable=True),
    Column("node", String(200), nullable=True),
    Column("kind", String(40), nullable=False),
    Column("message", Text, nullable=False),
)

# The checkpoints the nodes report (stasis.daemon.activity), deleted ones kept with the time:
# what each cost (size, CRIU's time, how long the job stood frozen) and the work it holds.
checkpoints = Table(
    "checkpoints",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("cluster_id", String(40), nullable=False),
    Column("node", String(200), nullable=False),
    Column("job", String(100), nullable=False),
    Column("label", String(200), nullable=False),
    Column("user", String(100), nullable=False),
    Column("size_bytes", BigInteger, nullable=False),
    Column("stored_size_bytes", BigInteger, nullable=False),
    Column("duration_s", Float, nullable=False),
    Column("frozen_s", Float, nullable=False),
    Column("work_s", Float, nullable=False),  # seconds of the job's run it holds
    Column("leave_running", Boolean, nullable=False),
    Column("reason", String(60), nullable=False),
    Column("store", String(500), nullable=False),
    Column("created", Float, nullable=False),  # unix seconds
    Column("deleted", Float, nullable=True),
    # The newest verdict of `stasis verify` a node of its cluster reported on it
    # (stasis.controlplane.verdicts): all None while it was never verified.
    Column("verified_ok", Boolean, nullable=True),
    Column("verify_reason", Text, nullable=True),  # "" when ok; else what failed
    Column("verified_by", String(200), nullable=True),  # the node that verified it
    Column("verified_at", Float, nullable=True),  # unix seconds
    Column("verify_duration_s", Float, nullable=True),
    Column("verify_processes", Integer, nullable=True),
)

# Restores the nodes report: each keeps `work_s` seconds of work a rerun would have redone
# (the savings). Once per (node, job, checkpoint): a report sent twice counts once.
restores = Table(
    "restores",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("cluster_id", String(40), nullable=False),
    Column("node", String(200), nullable=False),
    Column("checkpoint", String(64), nullable=False),
    Column("job", String(100), nullable=False),
    Column("label", String(200), nullable=False),
    Column("user", String(100), nullable=False),
    Column("work_s", Float, nullable=False),
    Column("duration_s", Float, nullable=False),
    Column("reason", String(60), nullable=False),
    Column("at", Float, nullable=False),
    UniqueConstraint("cluster_id", "node", "job", "checkpoint", name="restores_once"),
)

# Dashboard log-ins: a session id (its SHA-256 kept) for the token that logged in, with the
# token every form of that session must carry back (CSRF); gone at `expires` or at log-out.
sessions = Table(
    "sessions",
    metadata,
    Column("sha256", String(64), primary_key=True),
    Column("token_id", String(40), nullable=False),
    Column("csrf", String(64), nullable=False),
    Column("expires", Integer, nullable=False),
)
