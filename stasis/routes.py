"""Every route of the node daemon, declared once, as data: the server registers its handlers
from these declarations (stasis.daemon.http `add_routes`), the client builds its requests
from them (stasis.client `Client.call`), and tests/test_wire.py holds both to them. No other
module spells an API path.

How to declare a route (the control plane's surfaces use the same type):

    RUN: Route[wire.RunRequest, wire.RunAnswer] = Route("run", "POST", "/jobs", caller="local")

- `name`: the route's name: the server's handler and the client's method of that name serve it
  (a handler object's method `run`, `Client.run`); unique across a surface.
- `method`, `path`: HTTP method and path template; `{job}` is one path segment, filled by
  `route.url(job=...)` (quoted: an id never becomes another path) and handed to the handler
  by name.
- The annotation `Route[Req, Ans]`: the typed dict of the JSON body (stasis/wire.py; None for
  a route that reads no body) and what it answers (a typed dict, a list of them, another JSON
  type). mypy types the client's `call` with it, and `route.request` / `route.answer` read it
  from the module's annotations when first asked (the server, the tests), so that a CLI command
  never creates the wire's typed dicts. Or pass them: `Route(..., request=wire.X,
  answer=wire.Y)` (`answer` given: `request` is None unless given); a test holds them to the
  annotation. The server validates a body with the pydantic model paired with its typed dict.
- `query`: the query parameters it reads, if any.
- `streamed`: the answer is NDJSON: {"progress": ...} lines, then {"result": ...} or
  {"error": ...}.
- `caller`: who may call it (`Caller` below). The server's adapter identifies the caller and
  refuses those it may not at once for root-only routes (with `denied`, one line); for
  `owner` and `launcher` the handler checks the caller against the record the path names.

Errors, on every route, are {"error": {"type": <a StasisError class>, "message": <one line>}}
(stasis.errors: `wire_name`, `error_from_wire`).

This module imports only typing (and urllib.parse, to quote): the CLI imports it at every start.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Generic, Literal, TypeVar
from urllib.parse import quote

if TYPE_CHECKING:  # the annotations name them; `Route.request` and `.answer` resolve them
    from stasis import wire

Method = Literal["GET", "POST", "PUT", "PATCH", "DELETE"]

Caller = Literal[
    # -- the node daemon: identified by the socket's peer credentials (SO_PEERCRED) --------
    "local",  # any local user who reaches the socket; each sees and acts on their own
    "owner",  # root, or the owner of what the path names (its handler checks the record)
    "launcher",  # root, or the Slurm job's own launcher process (its handler checks)
    "root",  # uid 0 only: refused by the adapter, before the body is read
    # -- Slurm's remote listener: identified by a munge credential in the body -------------
    "cluster-user",  # a user of the Slurm cluster: root, or the job's owner
    "cluster-root",  # root of the Slurm cluster
    # -- the control plane (stasis.controlplane): identified by a token ---------------------
    "public",  # nobody checked (a login page)
    "user",  # a signed-in user of the control plane
    "admin",  # an administrator of the control plane
    "node",  # a node's own token (its daemon reporting and asking for commands)
    "cluster",  # the cluster token (a node enrolling)
    "hook",  # a scheduler hook's token
]

# Covariant: any route is an AnyRoute (the types are the client's; the class only carries them).
Req = TypeVar("Req", covariant=True)
Ans = TypeVar("Ans", covariant=True)


_FROM_ANNOTATION: object = object()  # `answer` not given: both types are the annotation's


class Route(Generic[Req, Ans]):
    """One route: see the module's docstring. Immutable."""

    __slots__ = (
        "_answer",
        "_module",
        "_request",
        "caller",
        "denied",
        "method",
        "name",
        "params",
        "path",
        "query",
        "streamed",
    )

    def __init__(
        self,
        name: str,
        method: Method,
        path: str,
        *,
        request: object | None = None,
        answer: object = _FROM_ANNOTATION,
        caller: Caller,
        streamed: bool = False,
        query: tuple[str, ...] = (),
        denied: str = "",
    ) -> None:
        set_ = object.__setattr__
        set_(self, "name", name)
        set_(self, "method", method)
        set_(self, "path", path)
        set_(self, "_request", request)
        set_(self, "_answer", answer)
        # Where the annotation that gives its types is (when `answer` is not given).
        set_(self, "_module", sys._getframe(1).f_globals.get("__name__", ""))
        set_(self, "caller", caller)
        set_(self, "streamed", streamed)
        set_(self, "query", query)
        # What a caller who may not is told, after "permission denied: " (root-only routes).
        set_(self, "denied", denied or f"only root may call {method} {path}")
        # The path's parameters, in order: "/jobs/{job}/kill" -> ("job",)
        set_(self, "params", tuple(p[1:-1] for p in path.split("/") if p.startswith("{")))

    name: str
    method: Method
    path: str
    _request: object | None
    _answer: object
    _module: str
    caller: Caller
    streamed: bool
    query: tuple[str, ...]
    denied: str
    params: tuple[str, ...]

    @property
    def request(self) -> object | None:
        """The typed dict of its body (None: it reads none)."""
        if self._answer is _FROM_ANNOTATION:
            self._resolve()
        return self._request

    @property
    def answer(self) -> object:
        """What it answers: a typed dict, a list of them, or another JSON type."""
        if self._answer is _FROM_ANNOTATION:
            self._resolve()
        return self._answer

    def _resolve(self) -> None:
        """The types of a route declared with its annotation alone, read from its module's
        annotations when first asked for (the server, the tests): the CLI, which only sends
        requests, never pays for creating the wire's typed dicts (~3 ms)."""
        import typing

        from stasis import wire

        module = sys.modules[self._module]
        hints = typing.get_type_hints(module, localns={"wire": wire})
        var = next(n for n, v in vars(module).items() if v is self)
        request, answer = typing.get_args(hints[var])
        set_ = object.__setattr__
        set_(self, "_request", None if request is type(None) else request)
        set_(self, "_answer", answer)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a Route is immutable ({name})")

    def url(self, **args: str) -> str:
        """The path with each parameter filled, as one quoted segment."""
        if set(args) != set(self.params):
            raise TypeError(f"{self.name}: the path {self.path} takes {self.params}, not {args}")
        parts = self.path.split("/")
        return "/".join(quote(args[p[1:-1]], safe="") if p.startswith("{") else p for p in parts)

    def __repr__(self) -> str:
        return f"<Route {self.name}: {self.method} {self.path} ({self.caller})>"


AnyRoute = Route[object, object]

# -- the daemon's core (stasis.daemon.api) -----------------------------------------------------

RUN: Route[wire.RunRequest, wire.RunAnswer] = Route("run", "POST", "/jobs", caller="local")
JOBS: Route[None, list[wire.Job]] = Route("jobs", "GET", "/jobs", caller="local")
JOB: Route[None, wire.Job] = Route("job", "GET", "/jobs/{job}", caller="owner")
KILL: Route[wire.KillRequest, wire.KillAnswer] = Route(
    "kill",
    "POST",
    "/jobs/{job}/kill",
    caller="owner",
)
DUMP: Route[wire.DumpRequest, wire.DumpAnswer] = Route(
    "dump",
    "POST",
    "/jobs/{job}/dump",
    caller="owner",
    streamed=True,
)
# A checkpoint cut across the nodes of a job that spans them (stasis/daemon/partfreeze.py): each
# part frozen, then dumped (DUMP with `frozen`), then stopped or thawed.
FREEZE: Route[wire.FreezeRequest, wire.FreezeAnswer] = Route(
    "freeze",
    "POST",
    "/jobs/{job}/freeze",
    caller="owner",
)
THAW: Route[wire.ThawRequest, wire.ThawAnswer] = Route(
    "thaw",
    "POST",
    "/jobs/{job}/thaw",
    caller="owner",
)
DUMP_CHECK: Route[None, wire.DumpCheckAnswer] = Route(
    "dump_check", "GET", "/jobs/{job}/dump-check", caller="owner"
)
RESTORE: Route[wire.RestoreRequest, wire.RestoreAnswer] = Route(
    "restore",
    "POST",
    "/restore",
    caller="owner",  # of the checkpoint, or of the label's (root: anyone's)
    streamed=True,
)
CHECKPOINTS: Route[None, list[wire.Checkpoint]] = Route(
    "checkpoints",
    "GET",
    "/checkpoints",
    caller="local",
    query=("label", "user"),
)
DELETE_CHECKPOINT: Route[None, wire.Deleted] = Route(
    "delete_checkpoint",
    "DELETE",
    "/checkpoints/{checkpoint}",
    caller="owner",
)
CHECK_CHECKPOINT: Route[None, wire.CheckpointCheck] = Route(
    "check_checkpoint",
    "GET",
    "/checkpoints/{checkpoint}/check",
    caller="owner",
)
VERIFY: Route[None, wire.VerifyVerdict] = Route(
    "verify",
    "POST",
    "/checkpoints/{checkpoint}/verify",
    caller="owner",
)
COLLECT_GARBAGE: Route[wire.GcRequest, wire.GcAnswer] = Route(
    "collect_garbage",
    "POST",
    "/checkpoints/gc",
    caller="root",
    denied="only root may collect the garbage of the store",
)
REKEY: Route[None, wire.RekeyAnswer] = Route(
    "rekey",
    "POST",
    "/checkpoints/rekey",
    caller="root",
    denied="only root may rekey checkpoints",
)
CHECK: Route[None, wire.CheckReport] = Route("check", "GET", "/check", caller="local")
NETWORK_LOCKS: Route[None, list[wire.NetworkLock]] = Route(
    "network_locks",
    "GET",
    "/network-locks",
    caller="root",  # the addresses and ports of every job's connections
    denied="only root may list network locks",
)
# Every periodic checkpoint interval of the node's integrations' jobs (root: all; a user: their
# own), for `stasis ps`.
INTERVALS: Route[None, list[wire.JobInterval]] = Route(
    "intervals", "GET", "/intervals", caller="local"
)

CORE: tuple[AnyRoute, ...] = (
    RUN,
    JOBS,
    JOB,
    KILL,
    DUMP,
    FREEZE,
    THAW,
    DUMP_CHECK,
    RESTORE,
    CHECKPOINTS,
    DELETE_CHECKPOINT,
    CHECK_CHECKPOINT,
    VERIFY,
    COLLECT_GARBAGE,
    REKEY,
    CHECK,
    NETWORK_LOCKS,
    INTERVALS,
)

# -- Slurm (stasis.slurm.integration) ----------------------------------------------------------

SLURM_HEALTH: Route[None, wire.Health] = Route(
    "slurm_health", "GET", "/slurm/health", caller="local"
)
SLURM_REGISTER: Route[wire.RegisterRequest, wire.Registration] = Route(
    "slurm_register",
    "POST",
    "/slurm/jobs",
    caller="launcher",  # a process of the Slurm job, for its own child
)
SLURM_JOB: Route[None, wire.Registration] = Route(
    "slurm_job", "GET", "/slurm/jobs/{job}", caller="owner"
)
SLURM_CHECKPOINT: Route[wire.SlurmCheckpointRequest, wire.SlurmCheckpointAnswer] = Route(
    "slurm_checkpoint",
    "POST",
    "/slurm/jobs/{job}/checkpoint",
    caller="owner",
)
SLURM_INTERVAL: Route[wire.SlurmIntervalRequest, wire.SlurmInterval] = Route(
    "slurm_interval",
    "POST",
    "/slurm/jobs/{job}/interval",
    caller="owner",
)
SLURM_INTERVALS: Route[None, list[wire.SlurmInterval]] = Route(
    "slurm_intervals",
    "GET",
    "/slurm/intervals",
    caller="local",  # root: every job's; a user: their own
)
SLURM_FINISH: Route[wire.FinishRequest, wire.FinishAnswer] = Route(
    "slurm_finish",
    "POST",
    "/slurm/jobs/{job}/finish",
    caller="launcher",
)

SLURM: tuple[AnyRoute, ...] = (
    SLURM_HEALTH,
    SLURM_REGISTER,
    SLURM_JOB,
    SLURM_CHECKPOINT,
    SLURM_INTERVAL,
    SLURM_INTERVALS,
    SLURM_FINISH,
)

# Slurm's remote listener (TCP, `slurm_remote_port`): only these, for other nodes' daemons.
SLURM_REMOTE_CHECKPOINT: Route[wire.SlurmRemoteCheckpointRequest, wire.SlurmCheckpointAnswer] = (
    Route(
        "slurm_remote_checkpoint",
        "POST",
        "/slurm/remote/jobs/{job}/checkpoint",
        caller="cluster-user",
    )
)
SLURM_REMOTE_DRAIN: Route[wire.SlurmRemoteDrainRequest, wire.SlurmDrainAnswer] = Route(
    "slurm_remote_drain",
    "POST",
    "/slurm/remote/drain",
    caller="cluster-root",
    denied="only root drains a node",
)

# A part of a job on several nodes (stasis.slurm.parts), for its launch agent (stasis-rsh): the
# job's own user (or root), the job running with this node among its nodes.
SLURM_REMOTE_PART_START: Route[wire.SlurmPartStartRequest, wire.RunAnswer] = Route(
    "slurm_remote_part_start",
    "POST",
    "/slurm/remote/parts/{job}",
    caller="cluster-user",
)
SLURM_REMOTE_PART_OUTPUT: Route[wire.SlurmPartOutputRequest, wire.SlurmPartOutput] = Route(
    "slurm_remote_part_output",
    "POST",
    "/slurm/remote/parts/{job}/{part}/output",
    caller="cluster-user",
)
SLURM_REMOTE_PART_SIGNAL: Route[wire.SlurmPartSignalRequest, wire.SlurmPartSignalled] = Route(
    "slurm_remote_part_signal",
    "POST",
    "/slurm/remote/parts/{job}/{part}/signal",
    caller="cluster-user",
)
# A cut across nodes (stasis.slurm.cut, through stasis.slurm.partclient): root's alone (its
# coordinator is the batch node's daemon), on a part started for that Slurm job.
_CUTS = "only root (a cut's coordinator) freezes, dumps, thaws or stops a job's parts"
SLURM_REMOTE_PART_FREEZE: Route[wire.SlurmPartFreezeRequest, wire.FreezeAnswer] = Route(
    "slurm_remote_part_freeze",
    "POST",
    "/slurm/remote/parts/{job}/{part}/freeze",
    caller="cluster-root",
    denied=_CUTS,
)
SLURM_REMOTE_PART_DUMP: Route[wire.SlurmPartDumpRequest, wire.DumpAnswer] = Route(
    "slurm_remote_part_dump",
    "POST",
    "/slurm/remote/parts/{job}/{part}/dump",
    caller="cluster-root",
    denied=_CUTS,
)
SLURM_REMOTE_PART_THAW: Route[wire.SlurmPartThawRequest, wire.ThawAnswer] = Route(
    "slurm_remote_part_thaw",
    "POST",
    "/slurm/remote/parts/{job}/{part}/thaw",
    caller="cluster-root",
    denied=_CUTS,
)
SLURM_REMOTE_PART_DELETE: Route[wire.SlurmPartDeleteRequest, wire.Deleted] = Route(
    "slurm_remote_part_delete",
    "POST",
    "/slurm/remote/parts/{job}/checkpoints/{checkpoint}/delete",
    caller="cluster-root",
    denied=_CUTS,
)

SLURM_REMOTE_PART_LIST: Route[wire.SlurmPartListRequest, wire.SlurmPartList] = Route(
    "slurm_remote_part_list",
    "POST",
    "/slurm/remote/parts/{job}/list",
    caller="cluster-root",
    denied=_CUTS,
)
# A cut restored on requeue (stasis.slurm.taskinit on the new batch node): root's alone.
_RESTORES = "only root (a restore's coordinator) holds a job's network or restores its parts"
SLURM_REMOTE_PART_NET: Route[wire.SlurmPartNetRequest, wire.SlurmPartNet] = Route(
    "slurm_remote_part_net",
    "POST",
    "/slurm/remote/parts/{job}/net",
    caller="cluster-root",
    denied=_RESTORES,
)
SLURM_REMOTE_PART_RESTORE: Route[wire.SlurmPartRestoreRequest, wire.RestoreAnswer] = Route(
    "slurm_remote_part_restore",
    "POST",
    "/slurm/remote/parts/{job}/restore",
    caller="cluster-root",
    denied=_RESTORES,
)

SLURM_REMOTE: tuple[AnyRoute, ...] = (
    SLURM_REMOTE_CHECKPOINT,
    SLURM_REMOTE_DRAIN,
    SLURM_REMOTE_PART_START,
    SLURM_REMOTE_PART_OUTPUT,
    SLURM_REMOTE_PART_SIGNAL,
    SLURM_REMOTE_PART_FREEZE,
    SLURM_REMOTE_PART_DUMP,
    SLURM_REMOTE_PART_THAW,
    SLURM_REMOTE_PART_DELETE,
    SLURM_REMOTE_PART_LIST,
    SLURM_REMOTE_PART_NET,
    SLURM_REMOTE_PART_RESTORE,
)

# -- Kubernetes (stasis.k8s.integration): all root's (containerd's shim runs the wrapper as
# root; the agent and `stasis k8s` run as root) ------------------------------------------------

_CONTAINERS = "only root (the container runtime) acts on containers"

K8S_CONTAINERS: Route[None, list[wire.ContainerInfo]] = Route(
    "k8s_containers",
    "GET",
    "/k8s/containers",
    caller="root",
    denied=_CONTAINERS,
)
K8S_REGISTER: Route[wire.ContainerRegisterRequest, wire.ContainerInfo] = Route(
    "k8s_register",
    "POST",
    "/k8s/containers",
    caller="root",
    denied=_CONTAINERS,
)
K8S_CHECKPOINT: Route[wire.ContainerCheckpointRequest, wire.ContainerCheckpointAnswer] = Route(
    "k8s_checkpoint",
    "POST",
    "/k8s/containers/{container}/checkpoint",
    caller="root",
    denied=_CONTAINERS,
)
K8S_INTERVAL: Route[wire.ContainerIntervalRequest, wire.ContainerInfo] = Route(
    "k8s_interval",
    "POST",
    "/k8s/containers/{container}/interval",
    caller="root",
    denied=_CONTAINERS,
)
K8S_FORGET: Route[None, wire.Forgotten] = Route(
    "k8s_forget",
    "POST",
    "/k8s/containers/{container}/forget",
    caller="root",
    denied=_CONTAINERS,
)
K8S_PLAN_RESTORE: Route[wire.ContainerRestoreRequest, wire.RestorePlan] = Route(
    "k8s_plan_restore",
    "POST",
    "/k8s/restores",
    caller="root",
    denied=_CONTAINERS,
)
K8S_RESTORE_DONE: Route[wire.RestoreDoneRequest, wire.RestoreDone] = Route(
    "k8s_restore_done",
    "POST",
    "/k8s/restores/{container}/done",
    caller="root",
    denied=_CONTAINERS,
)
K8S_EXPORT: Route[wire.ExportRequest, wire.ExportAnswer] = Route(
    "k8s_export",
    "POST",
    "/k8s/checkpoints/{checkpoint}/export",
    caller="root",
    denied=_CONTAINERS,
)
K8S_IMPORT: Route[wire.ImportRequest, wire.ContainerCheckpointAnswer] = Route(
    "k8s_import",
    "POST",
    "/k8s/checkpoints/import",
    caller="root",
    denied=_CONTAINERS,
)
K8S_NODE: Route[None, wire.NodeInfo] = Route(
    "k8s_node",
    "GET",
    "/k8s/node",
    caller="root",
    denied="only root drains the node",
)
K8S_DRAIN: Route[wire.K8sDrainRequest, wire.K8sDrainAnswer] = Route(
    "k8s_drain",
    "POST",
    "/k8s/node/drain",
    caller="root",
    denied="only root drains the node",
)

K8S: tuple[AnyRoute, ...] = (
    K8S_CONTAINERS,
    K8S_REGISTER,
    K8S_CHECKPOINT,
    K8S_INTERVAL,
    K8S_FORGET,
    K8S_PLAN_RESTORE,
    K8S_RESTORE_DONE,
    K8S_EXPORT,
    K8S_IMPORT,
    K8S_NODE,
    K8S_DRAIN,
)

# Everything the daemon's unix socket serves (with both integrations loaded).
SOCKET: tuple[AnyRoute, ...] = CORE + SLURM + K8S
