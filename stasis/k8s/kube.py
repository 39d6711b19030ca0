"""The Kubernetes API as the node agent, the daemon's drain and `stasis k8s checkpoint` use it
(the official client): one node, the pods on it, their annotations, the node's taints and
cordon, events on pods, and evictions of pods.

Only plain GET, PATCH, watch of nodes and pods, events created and the Eviction API: the calls
every API server serves alike (the tests run them against kmock's emulator, since no API server
runs on these machines). The agent never writes to a pod: a right to patch pods is a right to
change any pod's image, cluster-wide, and the agent runs privileged on every node.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from stasis.errors import KubernetesError

log = logging.getLogger("stasis.k8s.agent")

TAINT_KEY = "stasis.dev/not-ready"
TAINT_EFFECT = "NoSchedule"
# A new value asks the agent of the pod's node for a leave-running checkpoint of the pod's
# containers under stasis; the agent answers with an event on the pod (reason ANSWER_REASON)
# whose annotations carry the same value in CHECKPOINT_ANNOTATION and what became of each
# container in RESULT (JSON). Agents of stasis 0.1.0 answered in the pod's own annotations
# (CHECKPOINTED and RESULT): a request answered there is answered.
CHECKPOINT_ANNOTATION = "stasis.dev/checkpoint"
CHECKPOINTED_ANNOTATION = "stasis.dev/checkpointed"
RESULT_ANNOTATION = "stasis.dev/checkpoint-result"
ANSWER_REASON = "StasisCheckpoint"
# Seconds between leave-running checkpoints of the pod's containers, over their own
# STASIS_INTERVAL while the annotation is there.
INTERVAL_ANNOTATION = "stasis.dev/interval"
# On the node: what the agent checkpointed when the node was last cordoned (JSON).
CORDON_ANNOTATION = "stasis.dev/cordon-checkpoints"


class KubeError(KubernetesError):
    """The Kubernetes API could not be reached or refused a call (travels as KubernetesError)."""


def connect(kubeconfig: str) -> Any:
    """A CoreV1Api: from `kubeconfig` when given, else the pod's service account, else the
    usual kubeconfig ($KUBECONFIG, ~/.kube/config)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
    except (config.ConfigException, OSError) as e:
        where = kubeconfig or "the pod's service account or ~/.kube/config"
        raise KubeError(
            f"no Kubernetes API from {where}: {e}; give --kubeconfig " "(or STASIS_KUBECONFIG)"
        ) from None
    return client.CoreV1Api(client.ApiClient(cfg))


def connect_daemon(kubeconfig: str) -> Any | None:
    """The daemon's CoreV1Api, or None where this node has no Kubernetes API: from `kubeconfig`
    when given, else the pod's service account (the daemon runs in the agent's pod). Unlike
    `connect`, never an admin's ~/.kube/config: a daemon on a Slurm node must not cordon a
    node of whatever cluster root's kubeconfig names."""
    import os

    if not kubeconfig and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        # Not in a pod (the kubelet sets it in every pod): no need to import the client,
        # which every daemon's start, on every node, would pay for.
        return None
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            config.load_incluster_config(client_configuration=cfg)
    except (config.ConfigException, OSError) as e:
        if kubeconfig:
            log.warning("no Kubernetes API from %s: %s; no drain of this node", kubeconfig, e)
        return None
    # Asked at every heartbeat: an API server that is away is one failure, not three retries
    # (each a warning in the daemon's log).
    cfg.retries = 0
    return client.CoreV1Api(client.ApiClient(cfg))


def call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """One API call; its failure as a KubeError that says what was being done."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return fn(*args, **kwargs)
    except ApiException as e:
        raise KubeError(f"{what}: the API server answered {e.status} {e.reason}") from None
    except (HTTPError, OSError) as e:
        raise KubeError(f"{what}: the API server cannot be reached: {e}") from None


def watch(
    api: Any, list_fn: Callable[..., Any], stop: threading.Event, **selectors: Any
) -> Iterator[tuple[str, Any]]:
    """(event type, object) of `list_fn`'s objects, forever: every object as ADDED first,
    then their changes; a dropped or timed-out watch is started again (after a pause when it
    failed), so a consumer sees every object again then and must be idempotent."""
    from kubernetes import watch as k8s_watch
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    pause = 1.0
    while not stop.is_set():
        w = k8s_watch.Watch()
        try:
            # The read timeout ends a watch whose server went quiet or away; the server's
            # own timeout ends a healthy one now and then, as clients are expected to.
            for event in w.stream(
                list_fn, timeout_seconds=300, _request_timeout=(10, 330), **selectors
            ):
                pause = 1.0
                if event.get("type") == "ERROR":
                    raise KubeError(f"watch error: {event.get('raw_object')}")
                yield str(event["type"]), event["object"]
                if stop.is_set():
                    return
        except (ApiException, HTTPError, OSError, KubeError, ValueError) as e:
            log.warning("watch of %s failed (%s); again in %.0f s", selectors or "all", e, pause)
            stop.wait(pause)
            pause = min(pause * 2, 30.0)
        finally:
            w.stop()


def annotations_of(obj: Any) -> dict[str, str]:
    return dict(getattr(obj.metadata, "annotations", None) or {})


def container_ids(pod: Any) -> dict[str, str]:
    """container name -> runtime container id, of a pod's containers that have started
    (containerd://ID in the kubelet's status)."""
    ids = {}
    for status in getattr(pod.status, "container_statuses", None) or []:
        cid = status.container_id or ""
        if "://" in cid:
            ids[status.name] = cid.split("://", 1)[1]
    return ids


def set_taint(
    api: Any, node: Any, present: bool, key: str = TAINT_KEY, effect: str = TAINT_EFFECT
) -> bool:
    """Put the not-ready taint on the node or take it off; whether the node was changed."""
    taints = list(getattr(node.spec, "taints", None) or [])
    has = any(t.key == key for t in taints)
    if has == present:
        return False
    sanitize = api.api_client.sanitize_for_serialization
    kept = [sanitize(t) for t in taints if t.key != key]
    if present:
        kept.append({"key": key, "effect": effect})
    body: dict[str, Any] = {"spec": {"taints": kept}}
    rv = getattr(node.metadata, "resource_version", None)
    if rv and rv.isdigit():
        # Optimistic concurrency: a taint someone else put on meanwhile is not dropped; the
        # conflict (409) is retried from the next look at the node.
        body["metadata"] = {"resourceVersion": rv}
    call(
        f"{'taint' if present else 'untaint'} node {node.metadata.name}",
        api.patch_node,
        node.metadata.name,
        body,
    )
    return True


def annotate(api: Any, kind: str, obj: Any, values: dict[str, str | None]) -> None:
    body = {"metadata": {"annotations": values}}
    name = obj.metadata.name
    if kind == "node":
        call(f"annotate node {name}", api.patch_node, name, body)
    else:
        call(
            f"annotate pod {obj.metadata.namespace}/{name}",
            api.patch_namespaced_pod,
            name,
            obj.metadata.namespace,
            body,
        )


def answer(api: Any, pod: Any, asked: str, result: dict[str, Any], message: str, node: str) -> None:
    """The agent's answer to a pod's request: an event on the pod (`kubectl describe pod`
    shows it; `stasis k8s checkpoint` waits for it), with the request's value and the result
    as annotations."""
    import hashlib

    meta = pod.metadata
    tag = hashlib.sha256(f"{meta.uid}/{asked}".encode()).hexdigest()[:16]
    body = _pod_event(
        f"{meta.name[:200]}.stasis-{tag}",
        meta.namespace,
        meta.name,
        ANSWER_REASON,
        message,
        "error" in result or any("error" in r for r in (result.get("containers") or {}).values()),
        node,
        "agent",
        annotations={CHECKPOINT_ANNOTATION: asked, RESULT_ANNOTATION: json.dumps(result)},
        uid=meta.uid,
    )
    call(
        f"answer pod {meta.namespace}/{meta.name}",
        api.create_namespaced_event,
        meta.namespace,
        body,
    )


def _pod_event(
    name: str,
    namespace: str,
    pod: str,
    reason: str,
    message: str,
    warning: bool,
    node: str,
    part: str,
    annotations: dict[str, str] | None = None,
    uid: str | None = None,
) -> Any:
    """Event `name` on pod `namespace/pod`, from the stasis `part` (agent, node) on `node`."""
    from datetime import UTC, datetime

    from kubernetes import client

    now = datetime.now(UTC)
    return client.CoreV1Event(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace, annotations=annotations),
        involved_object=client.V1ObjectReference(
            api_version="v1", kind="Pod", name=pod, namespace=namespace, uid=uid
        ),
        reason=reason,
        message=message[:1024],
        type="Warning" if warning else "Normal",
        source=client.V1EventSource(component=_COMPONENTS[part], host=node),
        reporting_component=f"stasis.dev/{part}",
        reporting_instance=node[:128],
        first_timestamp=now,
        last_timestamp=now,
        count=1,
    )


# Each part's name as an event's source (what `kubectl get events` shows as FROM).
_COMPONENTS: dict[str, str] = {"agent": "stasis-agent", "node": "stasis"}


def warn(api: Any, namespace: str, pod: str, reason: str, message: str, node: str) -> None:
    """A Warning event on a pod (`kubectl describe pod`, `kubectl get events`), from the
    node's stasis: what the kubelet's own event about the same failure cannot say."""
    import secrets

    name = f"{pod[:200]}.stasis-{secrets.token_hex(8)}"
    body = _pod_event(name, namespace, pod, reason, message, True, node, "node")
    call(
        f"tell pod {namespace}/{pod}",
        api.create_namespaced_event,
        namespace,
        body,
        _request_timeout=_SHORT,
    )


def answer_of(api: Any, namespace: str, pod: str, asked: str) -> dict[str, Any] | None:
    """The result the agent answered request `asked` of pod `pod` with, or None yet: from
    its event, else (agents before 0.2) from the pod's annotations."""
    found = call(
        f"list the events of pod {namespace}/{pod}",
        api.list_namespaced_event,
        namespace,
        field_selector=f"involvedObject.name={pod}",
    )
    for event in found.items:
        ann = annotations_of(event)
        # Selectors are the server's to apply; an emulator may not.
        if (
            event.involved_object.name == pod
            and event.reason == ANSWER_REASON
            and ann.get(CHECKPOINT_ANNOTATION) == asked
        ):
            answered: dict[str, Any] = json.loads(ann.get(RESULT_ANNOTATION) or "{}")
            return answered
    obj = call(f"read pod {namespace}/{pod}", api.read_namespaced_pod, pod, namespace)
    ann = annotations_of(obj)
    if ann.get(CHECKPOINTED_ANNOTATION) == asked:
        legacy: dict[str, Any] = json.loads(ann.get(RESULT_ANNOTATION) or "{}")
        return legacy
    return None


def now_token() -> str:
    """A fresh value for CHECKPOINT_ANNOTATION."""
    import secrets

    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"


# The daemon asks with these (seconds): a heartbeat must not hang on a slow API server.
_SHORT = (5, 10)


def node_state(api: Any, node: str) -> str:
    """The node as `kubectl get nodes` shows its STATUS (Ready, NotReady, Unknown), with
    ",SchedulingDisabled+DRAIN" while it is cordoned (DRAIN: the word the control plane's drain
    policies look for, as in Slurm's MIXED+DRAIN)."""
    obj = call(f"read node {node}", api.read_node, node, _request_timeout=_SHORT)
    ready = "Unknown"
    for cond in (getattr(obj.status, "conditions", None) or []) if obj.status else []:
        if cond.type == "Ready":
            ready = {"True": "Ready", "False": "NotReady"}.get(cond.status, "Unknown")
    return ready + (",SchedulingDisabled+DRAIN" if obj.spec and obj.spec.unschedulable else "")


def cordon(api: Any, node: str) -> bool:
    """Mark the node unschedulable; whether it was schedulable before."""
    obj = call(f"read node {node}", api.read_node, node, _request_timeout=_SHORT)
    if obj.spec is not None and obj.spec.unschedulable:
        return False
    call(
        f"cordon node {node}",
        api.patch_node,
        node,
        {"spec": {"unschedulable": True}},
        _request_timeout=_SHORT,
    )
    return True


def pods_of_containers(api: Any, node: str) -> dict[str, tuple[str, str]]:
    """runtime container id -> (namespace, pod) of the pods bound to `node`."""
    found = call(
        f"list the pods of node {node}",
        api.list_pod_for_all_namespaces,
        field_selector=f"spec.nodeName={node}",
        _request_timeout=_SHORT,
    )
    out: dict[str, tuple[str, str]] = {}
    for pod in found.items:
        # Selectors are the server's to apply; an emulator may not.
        if getattr(pod.spec, "node_name", None) != node:
            continue
        for cid in container_ids(pod).values():
            out[cid] = (pod.metadata.namespace, pod.metadata.name)
    return out


def evict(api: Any, namespace: str, pod: str) -> None:
    """The Eviction API: the pod is deleted within its disruption budget (a refusal, 429, is a
    KubeError) and its controller (Deployment, StatefulSet, ...) makes a new one elsewhere."""
    from kubernetes import client

    body = client.V1Eviction(
        api_version="policy/v1",
        kind="Eviction",
        metadata=client.V1ObjectMeta(name=pod, namespace=namespace),
    )
    call(
        f"evict pod {namespace}/{pod}",
        api.create_namespaced_pod_eviction,
        pod,
        namespace,
        body,
        _preload_content=False,
        _request_timeout=_SHORT,
    )
