"""The Kubernetes permissions the chart (charts/stasis) gives its service accounts: the rules
of every ClusterRole bound to one, rendered from the chart's own templates, for
tests/k8s/apiserver.py to enforce. `agent_rules`: the node agent's; `hook_rules`: the
pre-delete hook's (stasis k8s uninstall-nodes)."""

from __future__ import annotations

from typing import Any

from tests.k8s.test_chart import render


def rules_of(account_name: str, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    docs = render(values or {})
    accounts = [
        d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == account_name
    ]
    assert len(accounts) == 1, accounts
    account = accounts[0]["metadata"]
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    rules: list[dict[str, Any]] = []
    for binding in (d for d in docs if d["kind"] == "ClusterRoleBinding"):
        if any(
            s["kind"] == "ServiceAccount"
            and s["name"] == account["name"]
            and s["namespace"] == account["namespace"]
            for s in binding["subjects"]
        ):
            rules += roles[binding["roleRef"]["name"]]["rules"]
    # A Role would bind only in its namespace: the agent works across every namespace, so the
    # chart must not lean on one (the emulator enforces cluster-wide rules only).
    assert not any(d["kind"] in ("Role", "RoleBinding") for d in docs)
    assert rules
    return rules


def agent_rules(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return rules_of("stasis-agent", values)


def hook_rules(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return rules_of("stasis-uninstall", values)
