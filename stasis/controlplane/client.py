"""The control plane's API as the admin CLI and the node daemons call it (blocking, stdlib HTTP:
a call every few seconds needs no more): one method per route of stasis.controlplane.routes,
each typed with its route's request and answer (stasis.controlplane.wire)."""

from __future__ import annotations

import ipaddress
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, TypeVar, cast

from stasis.controlplane import routes, wire
from stasis.controlplane.commands import Command
from stasis.errors import (
    ConflictError,
    ControlPlaneUnreachableError,
    NotFoundError,
    PermissionDeniedError,
    StasisError,
    UnauthenticatedError,
    UsageError,
    error_from_wire,
)
from stasis.routes import Route

Req = TypeVar("Req")
Ans = TypeVar("Ans")

# What a status says when the body names no class of stasis.errors (a proxy's own page).
_BY_STATUS: dict[int, type[StasisError]] = {
    400: UsageError,
    401: UnauthenticatedError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: UsageError,
}


def loopback(host: str) -> bool:
    """Whether `host` names this host's loopback: localhost, 127.0.0.0/8 or ::1. A name is
    not resolved: only `localhost` itself counts (a resolver can be told anything)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_url(url: str, allow_plain_http: bool) -> None:
    """Refuse (UsageError, one line) a control plane URL that would send a token in the clear
    across a network: http:// to a host other than loopback, unless the site allows it."""
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"control plane URL {url!r} is not http:// or https://")
    host = urllib.parse.urlsplit(url).hostname or ""
    if url.startswith("http://") and not loopback(host) and not allow_plain_http:
        raise UsageError(
            f"refused control plane URL {url}: plain http:// to {host or '?'}, "
            "not this host's loopback, would send the token in the clear; use "
            "https://, or allow it with controlplane_allow_plain_http = true "
            "(STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP=1)"
        )


class ControlPlaneClient:
    def __init__(
        self, url: str, token: str, timeout_s: float = 10.0, allow_plain_http: bool = False
    ) -> None:
        if not url:
            raise UsageError(
                "no control plane: set STASIS_CONTROLPLANE_URL (or "
                "controlplane_url in the config)"
            )
        check_url(url, allow_plain_http)
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self._ssl = ssl.create_default_context() if url.startswith("https://") else None

    def call(
        self,
        route: Route[Req, Ans],
        body: Req | None = None,
        *,
        query: dict[str, str] | None = None,
        timeout_s: float | None = None,
        **args: str,
    ) -> Ans:
        """Route `route` (stasis.controlplane.routes), its path filled with `args`: its answer
        (JSON; text or bytes for a route that answers str or bytes)."""
        path = route.url(**args) + (f"?{urllib.parse.urlencode(query)}" if query else "")
        raw = self._send(route.method, path, body, timeout_s)
        if route.answer is bytes:
            return cast(Ans, raw)
        if route.answer is str:
            return cast(Ans, raw.decode())
        return cast(Ans, json.loads(raw or b"null"))

    def _send(self, method: str, path: str, body: Any, timeout_s: float | None) -> bytes:
        """`timeout_s`: this request's own bound (the client's by default)."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(
                req, timeout=timeout_s or self.timeout_s, context=self._ssl
            ) as r:
                return bytes(r.read())
        except urllib.error.HTTPError as e:
            raise _answered(e) from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            why = getattr(e, "reason", e)
            raise ControlPlaneUnreachableError(
                f"cannot reach the control plane at {self.url} "
                f"({why}): is it running? (STASIS_CONTROLPLANE_URL)"
            ) from None

    # -- one method per route (stasis.controlplane.routes), in its order ----------------------

    def health(self) -> wire.Health:
        return self.call(routes.HEALTH)

    def add_cluster(self, body: wire.NewCluster) -> wire.ClusterAdded:
        return self.call(routes.ADD_CLUSTER, body)

    def list_clusters(self) -> list[wire.Cluster]:
        return self.call(routes.LIST_CLUSTERS)

    def rotate(self, cluster_id: str, body: wire.Rotation) -> wire.Rotated:
        return self.call(routes.ROTATE, body, id=cluster_id)

    def cluster_settings(self, cluster: str, body: wire.ClusterSettings) -> wire.ClusterApproval:
        return self.call(routes.CLUSTER_SETTINGS, body, id=cluster)

    def list_tokens(self) -> list[wire.Token]:
        return self.call(routes.LIST_TOKENS)

    def revoke(self, token_id: str) -> wire.Revoked:
        return self.call(routes.REVOKE, id=token_id)

    def register(self, body: wire.NodeReport) -> wire.Registered:
        return self.call(routes.REGISTER, body)

    def heartbeat(self, node: str, body: wire.Heartbeat) -> wire.Heard:
        return self.call(routes.HEARTBEAT, body, name=node)

    def reset_node(self, node: str, body: wire.NodeReset) -> wire.NodeWasReset:
        return self.call(routes.RESET_NODE, body, name=node)

    def approve_node(self, node: str, body: wire.NodeReset) -> wire.NodeApproved:
        return self.call(routes.APPROVE_NODE, body, name=node)

    def list_nodes(self) -> list[wire.Node]:
        return self.call(routes.LIST_NODES)

    def list_jobs(self) -> list[wire.Job]:
        return self.call(routes.LIST_JOBS)

    def new_command(self, body: wire.NewCommand) -> Command:
        return self.call(routes.NEW_COMMAND, body)

    def list_commands(self) -> list[Command]:
        return self.call(routes.LIST_COMMANDS)

    def get_command(self, command_id: str) -> Command:
        return self.call(routes.GET_COMMAND, id=command_id)

    def lease(self, node: str) -> Command | None:
        return self.call(routes.LEASE, {}, name=node)

    def renew(self, node: str, command_id: str, body: wire.Renewal) -> wire.Renewed:
        return self.call(routes.RENEW, body, name=node, id=command_id)

    def commit(
        self, node: str, command_id: str, body: wire.Renewal, timeout_s: float | None = None
    ) -> wire.Committed:
        return self.call(routes.COMMIT, body, timeout_s=timeout_s, name=node, id=command_id)

    def ack(self, command_id: str, body: wire.Ack) -> Command:
        return self.call(routes.ACK, body, id=command_id)

    def migrate(self, body: wire.Migration) -> Command:
        return self.call(routes.MIGRATE, body)

    def drain(self, node: str, body: wire.Drain) -> wire.Drained:
        return self.call(routes.DRAIN, body, name=node)

    def metrics(self) -> str:
        return self.call(routes.METRICS)

    def list_events(self, limit: int | None = None) -> list[wire.Event]:
        return self.call(routes.LIST_EVENTS, query=_given(limit=limit))

    def list_checkpoints(
        self, limit: int | None = None, deleted: bool = False
    ) -> list[wire.Checkpoint]:
        return self.call(
            routes.LIST_CHECKPOINTS, query=_given(limit=limit, deleted="1" if deleted else None)
        )

    def verify_checkpoint(self, checkpoint: str) -> Command:
        return self.call(routes.VERIFY_CHECKPOINT, id=checkpoint)

    def savings(self) -> wire.Savings:
        return self.call(routes.SAVINGS)

    def run_policy(self, name: str) -> wire.PolicyRun:
        return self.call(routes.RUN_POLICY, name=name)

    def install_kubernetes(self) -> str:
        return self.call(routes.INSTALL_KUBERNETES)

    def install_slurm(self) -> str:
        return self.call(routes.INSTALL_SLURM)

    def install_wheel(self) -> bytes:
        return self.call(routes.INSTALL_WHEEL)

    def list_policies(self) -> list[wire.Policy]:
        return self.call(routes.LIST_POLICIES)

    def add_policy(self, body: wire.NewPolicy) -> wire.Policy:
        return self.call(routes.ADD_POLICY, body)

    def edit_policy(self, name: str, body: wire.PolicyEdit) -> wire.Policy:
        return self.call(routes.EDIT_POLICY, body, name=name)

    def remove_policy(self, name: str) -> wire.PolicyRemoved:
        return self.call(routes.REMOVE_POLICY, name=name)

    def rotate_hook(self, name: str) -> wire.HookRotated:
        return self.call(routes.ROTATE_HOOK, name=name)


def _given(**query: object) -> dict[str, str]:
    return {k: str(v) for k, v in query.items() if v is not None}


def _answered(e: urllib.error.HTTPError) -> StasisError:
    """The error the control plane answered, as the class it named (stasis.errors)."""
    try:
        said = json.loads(e.read()).get("error")
    except (ValueError, AttributeError):
        said = None
    if isinstance(said, dict) and isinstance(said.get("message"), str):
        error = error_from_wire(str(said.get("type")), said["message"])
        if type(error) is StasisError:  # a class this side does not know: the status's
            error = _BY_STATUS.get(e.code, StasisError)(said["message"])
        return error
    return _BY_STATUS.get(e.code, StasisError)(f"{e.code} {e.reason}")
