"""Every route of the control plane, declared once, as data (stasis.routes.Route, the type the
node daemon's routes use): its API (`API`) and its dashboard's pages and forms (`UI`). The
server registers its handlers from these declarations (stasis.controlplane.server and
.dashboard `add_routes`: the method of its handlers object of the route's name), the client
has one method per API route (stasis.controlplane.client; the dashboard's pages are for
browsers, their own script reloads the page it is on), and
tests/controlplane/test_wire_controlplane.py holds the three to one another. No other module
spells an API path.

Who may call (`caller`), told by the `Authorization: Bearer` token, checked by the server's
adapter before the body is read:

    public   nobody checked
    admin    the admin token only
    user     any valid token; a cluster's token or a node's credential sees its own cluster's
    cluster  a cluster's token (a node joining; the installers); a node's credential
             registers again with its own (checked by the handler)
    node     a node's own credential, acting as the node the path names (`denied`: what it
             is refused for, said to any other token)
    hook     a policy's own hook token (that policy only), or the admin token

Requests and answers are the typed dicts of stasis.controlplane.wire and, for commands,
stasis.controlplane.commands. Errors: {"error": {"type", "message"}} (stasis.errors).
"""

from __future__ import annotations

from stasis.controlplane import wire
from stasis.controlplane.commands import Command
from stasis.routes import AnyRoute, Route

HEALTH: Route[None, wire.Health] = Route(
    "health",
    "GET",
    "/api/v1/health",
    answer=wire.Health,
    caller="public",
)
ADD_CLUSTER: Route[wire.NewCluster, wire.ClusterAdded] = Route(
    "add_cluster",
    "POST",
    "/api/v1/clusters",
    request=wire.NewCluster,
    answer=wire.Cluster,
    caller="admin",
)
LIST_CLUSTERS: Route[None, list[wire.Cluster]] = Route(
    "list_clusters",
    "GET",
    "/api/v1/clusters",
    answer=list[wire.Cluster],
    caller="admin",
)
ROTATE: Route[wire.Rotation, wire.Rotated] = Route(
    "rotate",
    "POST",
    "/api/v1/clusters/{id}/rotate",
    request=wire.Rotation,
    answer=wire.Cluster,
    caller="admin",
)
CLUSTER_SETTINGS: Route[wire.ClusterSettings, wire.ClusterApproval] = Route(
    "cluster_settings",
    "POST",
    "/api/v1/clusters/{id}/settings",
    request=wire.ClusterSettings,
    answer=wire.Cluster,
    caller="admin",
)
LIST_TOKENS: Route[None, list[wire.Token]] = Route(
    "list_tokens",
    "GET",
    "/api/v1/tokens",
    answer=list[wire.Token],
    caller="admin",
)
REVOKE: Route[None, wire.Revoked] = Route(
    "revoke",
    "POST",
    "/api/v1/tokens/{id}/revoke",
    answer=wire.Token,
    caller="admin",
)
REGISTER: Route[wire.NodeReport, wire.Registered] = Route(
    "register",
    "POST",
    "/api/v1/nodes/register",
    request=wire.NodeReport,
    answer=wire.Registered,
    caller="cluster",
)
HEARTBEAT: Route[wire.Heartbeat, wire.Heard] = Route(
    "heartbeat",
    "POST",
    "/api/v1/nodes/{name}/heartbeat",
    request=wire.Heartbeat,
    answer=wire.Node,
    caller="node",
    denied="a heartbeat",
)
RESET_NODE: Route[wire.NodeReset, wire.NodeWasReset] = Route(
    "reset_node",
    "POST",
    "/api/v1/nodes/{name}/reset",
    request=wire.NodeReset,
    answer=wire.Node,
    caller="admin",
)
APPROVE_NODE: Route[wire.NodeReset, wire.NodeApproved] = Route(
    "approve_node",
    "POST",
    "/api/v1/nodes/{name}/approve",
    request=wire.NodeReset,
    answer=wire.Node,
    caller="admin",
)
LIST_NODES: Route[None, list[wire.Node]] = Route(
    "list_nodes",
    "GET",
    "/api/v1/nodes",
    answer=list[wire.Node],
    caller="user",
)
LIST_JOBS: Route[None, list[wire.Job]] = Route(
    "list_jobs",
    "GET",
    "/api/v1/jobs",
    answer=list[wire.Job],
    caller="user",
)
NEW_COMMAND: Route[wire.NewCommand, Command] = Route(
    "new_command",
    "POST",
    "/api/v1/commands",
    request=wire.NewCommand,
    answer=Command,
    caller="admin",
)
LIST_COMMANDS: Route[None, list[Command]] = Route(
    "list_commands",
    "GET",
    "/api/v1/commands",
    answer=list[Command],
    caller="user",
)
GET_COMMAND: Route[None, Command] = Route(
    "get_command",
    "GET",
    "/api/v1/commands/{id}",
    answer=Command,
    caller="user",
)
LEASE: Route[None, Command | None] = Route(
    "lease",
    "POST",
    "/api/v1/nodes/{name}/commands/lease",
    answer=Command | None,
    caller="node",
    denied="leasing a node's commands",
)
RENEW: Route[wire.Renewal, wire.Renewed] = Route(
    "renew",
    "POST",
    "/api/v1/nodes/{name}/commands/{id}/renew",
    request=wire.Renewal,
    answer=wire.Renewed,
    caller="node",
    denied="renewing a command's lease",
)
COMMIT: Route[wire.Renewal, wire.Committed] = Route(
    "commit",
    "POST",
    "/api/v1/nodes/{name}/commands/{id}/commit",
    request=wire.Renewal,
    answer=wire.Committed,
    caller="node",
    denied="committing a restore",
)
ACK: Route[wire.Ack, Command] = Route(
    "ack",
    "POST",
    "/api/v1/commands/{id}/ack",
    request=wire.Ack,
    answer=Command,
    caller="node",
    denied="acknowledging a command",
)
MIGRATE: Route[wire.Migration, Command] = Route(
    "migrate",
    "POST",
    "/api/v1/migrations",
    request=wire.Migration,
    answer=Command,
    caller="admin",
)
DRAIN: Route[wire.Drain, wire.Drained] = Route(
    "drain",
    "POST",
    "/api/v1/nodes/{name}/drain",
    request=wire.Drain,
    answer=wire.Drained,
    caller="admin",
)
METRICS: Route[None, str] = Route(
    "metrics",
    "GET",
    "/metrics",
    answer=str,
    caller="admin",
)
LIST_EVENTS: Route[None, list[wire.Event]] = Route(
    "list_events",
    "GET",
    "/api/v1/events",
    answer=list[wire.Event],
    caller="user",
    query=('limit',),
)
LIST_CHECKPOINTS: Route[None, list[wire.Checkpoint]] = Route(
    "list_checkpoints",
    "GET",
    "/api/v1/checkpoints",
    answer=list[wire.Checkpoint],
    caller="user",
    query=('limit', 'deleted'),
)
VERIFY_CHECKPOINT: Route[None, Command] = Route(
    "verify_checkpoint",
    "POST",
    "/api/v1/checkpoints/{id}/verify",
    answer=Command,
    caller="admin",
)
SAVINGS: Route[None, wire.Savings] = Route(
    "savings",
    "GET",
    "/api/v1/savings",
    answer=wire.Savings,
    caller="user",
)
RUN_POLICY: Route[None, wire.PolicyRun] = Route(
    "run_policy",
    "POST",
    "/api/v1/policies/{name}/run",
    answer=wire.PolicyRun,
    caller="hook",
)
INSTALL_KUBERNETES: Route[None, str] = Route(
    "install_kubernetes",
    "GET",
    "/install/kubernetes",
    answer=str,
    caller="cluster",
)
INSTALL_SLURM: Route[None, str] = Route(
    "install_slurm",
    "GET",
    "/install/slurm",
    answer=str,
    caller="cluster",
)
INSTALL_WHEEL: Route[None, bytes] = Route(
    "install_wheel",
    "GET",
    "/install/stasis.whl",
    answer=bytes,
    caller="cluster",
)
LIST_POLICIES: Route[None, list[wire.Policy]] = Route(
    "list_policies",
    "GET",
    "/api/v1/policies",
    answer=list[wire.Policy],
    caller="admin",
)
ADD_POLICY: Route[wire.NewPolicy, wire.Policy] = Route(
    "add_policy",
    "POST",
    "/api/v1/policies",
    request=wire.NewPolicy,
    answer=wire.Policy,
    caller="admin",
)
EDIT_POLICY: Route[wire.PolicyEdit, wire.Policy] = Route(
    "edit_policy",
    "PATCH",
    "/api/v1/policies/{name}",
    request=wire.PolicyEdit,
    answer=wire.Policy,
    caller="admin",
)
REMOVE_POLICY: Route[None, wire.PolicyRemoved] = Route(
    "remove_policy",
    "DELETE",
    "/api/v1/policies/{name}",
    answer=wire.Policy,
    caller="admin",
)
ROTATE_HOOK: Route[None, wire.HookRotated] = Route(
    "rotate_hook",
    "POST",
    "/api/v1/policies/{name}/rotate-hook",
    answer=wire.Policy,
    caller="admin",
)

API: tuple[AnyRoute, ...] = (
    HEALTH,
    ADD_CLUSTER,
    LIST_CLUSTERS,
    ROTATE,
    CLUSTER_SETTINGS,
    LIST_TOKENS,
    REVOKE,
    REGISTER,
    HEARTBEAT,
    RESET_NODE,
    APPROVE_NODE,
    LIST_NODES,
    LIST_JOBS,
    NEW_COMMAND,
    LIST_COMMANDS,
    GET_COMMAND,
    LEASE,
    RENEW,
    COMMIT,
    ACK,
    MIGRATE,
    DRAIN,
    METRICS,
    LIST_EVENTS,
    LIST_CHECKPOINTS,
    VERIFY_CHECKPOINT,
    SAVINGS,
    RUN_POLICY,
    INSTALL_KUBERNETES,
    INSTALL_SLURM,
    INSTALL_WHEEL,
    LIST_POLICIES,
    ADD_POLICY,
    EDIT_POLICY,
    REMOVE_POLICY,
    ROTATE_HOOK,
)


# -- the dashboard (stasis.controlplane.dashboard): pages (HTML) and their forms (POSTed
# fields, each with the session's CSRF token; answered with a redirect). `user`: a session of
# the dashboard's log-in (its cookie), checked by the page or form; `public`: none needed.

UI_HOME: Route[None, str] = Route("ui_home", "GET", "/", answer=str, caller="public")
UI_BARE: Route[None, str] = Route("ui_bare", "GET", "/ui", answer=str, caller="public")
UI_LOGIN_PAGE: Route[None, str] = Route(
    "ui_login_page", "GET", "/ui/login", answer=str, caller="public"
)
UI_LOGIN: Route[None, str] = Route("ui_login", "POST", "/ui/login", answer=str, caller="public")
UI_LOGOUT: Route[None, str] = Route("ui_logout", "POST", "/ui/logout", answer=str, caller="user")
UI_STATIC: Route[None, str] = Route(
    "ui_static", "GET", "/ui/static/{name}", answer=str, caller="public"
)
UI_NODES: Route[None, str] = Route("ui_nodes", "GET", "/ui/", answer=str, caller="user")
UI_JOBS: Route[None, str] = Route("ui_jobs", "GET", "/ui/jobs", answer=str, caller="user")
UI_CHECKPOINT_JOB: Route[None, str] = Route(
    "ui_checkpoint_job", "POST", "/ui/jobs/{job}/checkpoint", answer=str, caller="user"
)
UI_MIGRATE_JOB: Route[None, str] = Route(
    "ui_migrate_job", "POST", "/ui/jobs/{job}/migrate", answer=str, caller="user"
)
UI_CHECKPOINTS: Route[None, str] = Route(
    "ui_checkpoints", "GET", "/ui/checkpoints", answer=str, caller="user"
)
UI_VERIFY: Route[None, str] = Route(
    "ui_verify", "POST", "/ui/checkpoints/{checkpoint}/verify", answer=str, caller="user"
)
UI_POLICIES: Route[None, str] = Route(
    "ui_policies", "GET", "/ui/policies", answer=str, caller="user"
)
UI_ADD_POLICY: Route[None, str] = Route(
    "ui_add_policy", "POST", "/ui/policies", answer=str, caller="user"
)
UI_RUN_POLICY: Route[None, str] = Route(
    "ui_run_policy", "POST", "/ui/policies/{name}/run", answer=str, caller="user"
)
UI_REMOVE_POLICY: Route[None, str] = Route(
    "ui_remove_policy", "POST", "/ui/policies/{name}/delete", answer=str, caller="user"
)
UI_POLICY_EDIT_PAGE: Route[None, str] = Route(
    "ui_policy_edit_page", "GET", "/ui/policies/{name}/edit", answer=str, caller="user"
)
UI_EDIT_POLICY: Route[None, str] = Route(
    "ui_edit_policy", "POST", "/ui/policies/{name}/edit", answer=str, caller="user"
)
UI_ACTIONS: Route[None, str] = Route("ui_actions", "GET", "/ui/actions", answer=str, caller="user")
UI_EVENTS: Route[None, str] = Route("ui_events", "GET", "/ui/events", answer=str, caller="user")
UI_SAVINGS: Route[None, str] = Route("ui_savings", "GET", "/ui/savings", answer=str, caller="user")

UI: tuple[AnyRoute, ...] = (
    UI_HOME,
    UI_BARE,
    UI_LOGIN_PAGE,
    UI_LOGIN,
    UI_LOGOUT,
    UI_STATIC,
    UI_NODES,
    UI_JOBS,
    UI_CHECKPOINT_JOB,
    UI_MIGRATE_JOB,
    UI_CHECKPOINTS,
    UI_VERIFY,
    UI_POLICIES,
    UI_ADD_POLICY,
    UI_RUN_POLICY,
    UI_REMOVE_POLICY,
    UI_POLICY_EDIT_PAGE,
    UI_EDIT_POLICY,
    UI_ACTIONS,
    UI_EVENTS,
    UI_SAVINGS,
)
