"""A node as the control plane sees it, spoken by the test over plain HTTP: joins with its
cluster's token and from then on speaks with the credential the join answered with; heartbeats
the jobs and scheduler state it is told to, leases commands and acknowledges them quoting the
lease. For the control plane's side of what a node reports (its drain plans, its scoping) where
no real daemon could report it here (a Kubernetes node's pods)."""

from __future__ import annotations

from typing import Any

from tests.controlplane.conftest import ControlPlane


class FakeNode:
    def __init__(self, cp: ControlPlane, cluster: dict[str, str], name: str) -> None:
        self.cp = cp
        self.cluster_token = cluster["token"]
        self.token = ""  # its own credential, once joined
        self.cluster_id = cluster["cluster_id"]
        self.name = name
        self.leases: dict[str, str] = {}  # command id -> the lease id it holds

    def call(self, method: str, path: str, body: Any = None) -> Any:
        status, answer = self.cp.call(method, path, self.token or self.cluster_token, body)
        assert status == 200, (status, answer)
        return answer

    def register(self) -> None:
        joined = self.call(
            "POST",
            "/api/v1/nodes/register",
            {
                "name": self.name,
                "cluster_id": self.cluster_id,
                "host": self.name,
                "stasis_version": "0.test",
                "criu_version": "4.0",
                "check_ok": True,
            },
        )
        if not self.token:
            # (a control plane without node credentials answers none: the cluster token)
            self.token = joined.get("node_token", "")

    def heartbeat(self, jobs: list[dict[str, Any]], scheduler_state: str | None = None) -> None:
        self.call(
            "POST",
            f"/api/v1/nodes/{self.name}/heartbeat",
            {
                "jobs": [
                    {"state": "running", "label": j["job"], "user": "alice", **j} for j in jobs
                ],
                "scheduler_state": scheduler_state,
            },
        )

    def beat(self, **body: Any) -> None:
        """A heartbeat with what the test gives (activity, verdicts, jobs...)."""
        self.call("POST", f"/api/v1/nodes/{self.name}/heartbeat", body)

    def took(self, checkpoint: str, label: str, at: float, user: str = "alice") -> None:
        """Reports a checkpoint it took (as its daemon's activity would)."""
        self.beat(
            activity=[
                {
                    "kind": "checkpoint",
                    "checkpoint": checkpoint,
                    "label": label,
                    "job": f"job-{label}",
                    "user": user,
                    "size_bytes": 4096,
                    "work_s": 1.0,
                    "duration_s": 0.1,
                    "at": at,
                }
            ]
        )

    def lease(self) -> dict[str, Any] | None:
        got: dict[str, Any] | None = self.call(
            "POST", f"/api/v1/nodes/{self.name}/commands/lease", {}
        )
        if got is not None:
            self.leases[got["id"]] = got["lease_id"]
        return got

    def ack(self, command_id: str, ok: bool, result: dict[str, Any]) -> dict[str, Any]:
        done: dict[str, Any] = self.call(
            "POST",
            f"/api/v1/commands/{command_id}/ack",
            {"lease_id": self.leases.get(command_id, ""), "ok": ok, "result": result},
        )
        return done
