"""Taking stasis off a cluster's nodes when its chart is uninstalled.

A DaemonSet cannot be a Helm hook, and its pods' SIGTERM cannot tell an uninstall from a
rolling update or a drained node: taking the runtime off at every SIGTERM would leave a node's
protected pods unprotected at each upgrade. So the chart's pre-delete hook (a Job running
`stasis k8s uninstall-nodes`) asks each node's agent, through its node's annotation
UNINSTALL_ANNOTATION (a new value: one request), and waits for the answers in
UNINSTALLED_ANNOTATION (JSON: the request, what was removed, an error). Only then does Helm
delete the DaemonSet. A node whose agent does not answer in time fails the hook, in one line
that names the node and what its administrator does instead.
"""

from __future__ import annotations

import json
import time
from typing import Any

from stasis.errors import ContainerError
from stasis.k8s import kube

UNINSTALL_ANNOTATION = "stasis.dev/uninstall"
UNINSTALLED_ANNOTATION = "stasis.dev/uninstalled"


def answered_request(raw: str | None) -> str | None:
    """The request an agent's answer (UNINSTALLED_ANNOTATION's value) is for."""
    try:
        answer = json.loads(raw or "")
    except ValueError:
        return None
    request = answer.get("request") if isinstance(answer, dict) else None
    return request if isinstance(request, str) else None


def _labels(selector: str) -> dict[str, str]:
    pairs = [p.partition("=") for p in selector.split(",") if p]
    return {k.strip(): v.strip() for k, _, v in pairs}


def agent_nodes(api: Any, namespace: str, selector: str) -> list[str]:
    """The nodes where an agent pod of the release runs (or is meant to)."""
    pods = kube.call(
        f"list the agent's pods in {namespace}",
        api.list_namespaced_pod,
        namespace,
        label_selector=selector,
    )
    wanted = _labels(selector)
    nodes = set()
    for pod in pods.items:
        labels = dict(getattr(pod.metadata, "labels", None) or {})
        node = getattr(pod.spec, "node_name", None)
        if node and all(labels.get(k) == v for k, v in wanted.items()):
            nodes.add(str(node))
    return sorted(nodes)


def uninstall_nodes(
    api: Any, namespace: str, selector: str, timeout_s: float, poll_s: float = 1.0
) -> dict[str, dict[str, Any]]:
    """Ask the agent of every node with one (`selector`: its pods' labels) to take stasis
    off its node, and wait for their answers: node -> answer. ContainerError (one line) when
    a node did not answer in time or failed."""
    nodes = agent_nodes(api, namespace, selector)
    request = f"{namespace}/{kube.now_token()}"
    for node in nodes:
        kube.call(
            f"annotate node {node}",
            api.patch_node,
            node,
            {"metadata": {"annotations": {UNINSTALL_ANNOTATION: request}}},
        )
    answers: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for node in nodes:
            if node in answers:
                continue
            try:
                obj = kube.call(f"read node {node}", api.read_node, node)
            except kube.KubeError as e:
                if " 404 " in str(e):  # the node is gone, and its host with it
                    answers[node] = {"request": request, "gone": True}
                continue
            raw = kube.annotations_of(obj).get(UNINSTALLED_ANNOTATION)
            if answered_request(raw) == request:
                answers[node] = json.loads(raw or "{}")
        if len(answers) == len(nodes) or time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    failed = [f"{n}: {a['error']}" for n, a in sorted(answers.items()) if a.get("error")]
    silent = [n for n in nodes if n not in answers]
    if silent:
        failed.append(
            f"{', '.join(silent)}: no answer from the stasis agent within " f"{timeout_s:.0f} s"
        )
    if failed:
        raise ContainerError(
            "stasis is still on some nodes (" + "; ".join(failed) + "): on each, run "
            "`stasis k8s uninstall-runtime` as root and remove /usr/local/lib/stasis, or "
            "uninstall anyway with `helm uninstall --no-hooks`"
        )
    return answers
