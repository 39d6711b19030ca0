"""A Kubernetes API for the agent's tests: kmock's KubernetesEmulator (an in-memory API server:
objects created, patched, listed and watched over real HTTP), in a process of its own, since no
real API server can run on these machines. It is an emulator, not a cluster: nothing schedules
pods or runs a kubelet; the tests write what the kubelet would (a pod's container statuses).
An eviction (POST pods/NAME/eviction) deletes the pod as a real API server does (no disruption
budgets here) and is written, one JSON line each, to evictions.jsonl in its working directory.

RBAC, as a real API server authorizes: `ApiServer.authorize(token, rules)` (rbac.json in its
working directory, read at every request; one entry per token, so that several service
accounts can each have theirs) makes every request that bears that bearer token
checked against those PolicyRules (apiGroups, resources with their subresources as
"pods/eviction", verbs get/list/watch/create/update/patch/delete, resourceNames); a request
they do not allow is answered 403 Forbidden, as kube-apiserver answers it, and written to
rbac-denied.jsonl. Every request of that token is written to rbac-requests.jsonl. Requests
without a token (the tests' own, as the cluster's admin) are allowed.

    python tests/k8s/apiserver.py     prints its URL, then serves until killed
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__)


class ApiServer:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.kubeconfig = workdir / "kubeconfig"

    def start(self) -> None:
        with (self.workdir / "apiserver.log").open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE)],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=self.workdir,
            )
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        assert self.url.startswith("http://"), (self.workdir / "apiserver.log").read_text()
        self.kubeconfig.write_text(
            textwrap.dedent(f"""\
            apiVersion: v1
            kind: Config
            clusters: [{{name: kmock, cluster: {{server: "{self.url}"}}}}]
            users: [{{name: test, user: {{token: not-a-secret}}}}]
            contexts: [{{name: kmock, context: {{cluster: kmock, user: test}}}}]
            current-context: kmock
            """)
        )
        os.chmod(self.kubeconfig, 0o600)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()

    # What a test does to the cluster (as kubectl or the kubelet would), over HTTP.

    def _path(self, kind: str, namespace: str | None, name: str | None = None) -> str:
        base = "/api/v1" + (f"/namespaces/{namespace}" if namespace else "") + f"/{kind}"
        return base + (f"/{name}" if name else "")

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={
                "Content-Type": "application/merge-patch+json"
                if method == "PATCH"
                else "application/json"
            },
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                answer: dict[str, Any] = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{method} {path}: {e.code} {e.read()!r}") from None
        return answer

    def authorize(self, token: str, rules: list[dict[str, Any]]) -> Path:
        """Requests with bearer `token` get what `rules` allow and nothing else; a kubeconfig
        that uses that token (as a service account's would)."""
        tmp = self.workdir / "rbac.json.tmp"
        path = self.workdir / "rbac.json"
        tokens = json.loads(path.read_text())["tokens"] if path.exists() else {}
        tokens[token] = rules
        tmp.write_text(json.dumps({"tokens": tokens}))
        tmp.replace(path)
        config = self.workdir / f"kubeconfig-{token}"
        config.write_text(self.kubeconfig.read_text().replace("not-a-secret", token))
        os.chmod(config, 0o600)
        return config

    def requests(self, denied: bool = False, token: str | None = None) -> list[dict[str, Any]]:
        """The requests of the authorized tokens (only those refused: `denied`; only those of
        `token`)."""
        path = self.workdir / ("rbac-denied.jsonl" if denied else "rbac-requests.jsonl")
        if not path.exists():
            return []
        found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in found if token is None or r["token"] == token]

    def evictions(self) -> list[dict[str, Any]]:
        path = self.workdir / "evictions.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def exists(self, kind: str, name: str, namespace: str | None = None) -> bool:
        try:
            self.get(kind, name, namespace)
        except AssertionError as e:
            if ": 404 " in str(e):
                return False
            raise
        return True

    def create(self, kind: str, obj: dict[str, Any]) -> None:
        self._call("POST", self._path(kind, obj["metadata"].get("namespace")), obj)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        return self._call("GET", self._path(kind, namespace, name))

    def patch(
        self, kind: str, name: str, body: dict[str, Any], namespace: str | None = None
    ) -> None:
        self._call("PATCH", self._path(kind, namespace, name), body)

    def add_ready_node(self, name: str) -> None:
        """A node whose kubelet says Ready, with no taints."""
        self.create(
            "nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name},
                "spec": {},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            },
        )

    def bind_pod(
        self,
        name: str,
        containers: dict[str, str],
        *,
        namespace: str,
        node: str,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """A running pod bound to `node`, with the container statuses the kubelet would write
        (`containers`: each container's name and its containerd id)."""
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        if annotations is not None:
            metadata["annotations"] = annotations
        self.create(
            "pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": metadata,
                "spec": {
                    "nodeName": node,
                    "runtimeClassName": "stasis",
                    "containers": [{"name": c, "image": "busybox"} for c in containers],
                },
                "status": {
                    "phase": "Running",
                    "containerStatuses": [
                        {
                            "name": c,
                            "containerID": f"containerd://{cid}",
                            "image": "busybox",
                            "imageID": "",
                            "ready": True,
                            "restartCount": 0,
                        }
                        for c, cid in containers.items()
                    ],
                },
            },
        )


_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def _attributes(request: Any) -> dict[str, Any] | None:
    """What RBAC authorizes of a request (as kube-apiserver's RequestInfo): None for a path
    that is not a resource (discovery, /version: every authenticated user's)."""
    resource = request.resource
    if resource is None or resource.group is None:
        return None
    plural, name, namespace = resource.plural, request.name, request.namespace
    if plural is None and namespace is not None:  # /api/v1/namespaces/NAME
        plural, name, namespace = "namespaces", namespace, None
    if plural is None:
        return None
    method = str(request.method.value if hasattr(request.method, "value") else request.method)
    method = method.upper()
    if method == "GET":
        watch = str(request.params.get("watch", "")).lower() in ("1", "t", "true")
        verb = "watch" if watch else "get" if name else "list"
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = _VERBS.get(method, method.lower())
    full = plural + (f"/{request.subresource}" if request.subresource else "")
    return {
        "verb": verb,
        "apiGroup": resource.group,
        "resource": full,
        "name": name,
        "namespace": namespace,
    }


def _allows(rule: dict[str, Any], attrs: dict[str, Any]) -> bool:
    def has(key: str, value: str) -> bool:
        return "*" in rule.get(key, []) or value in rule.get(key, [])

    if not (
        has("apiGroups", attrs["apiGroup"])
        and has("resources", attrs["resource"])
        and has("verbs", attrs["verb"])
    ):
        return False
    names = rule.get("resourceNames")
    return not names or attrs["name"] in names


def _forbidden(request: Any) -> dict[str, Any] | None:
    """kube-apiserver's 403 Status for a request the authorized token may not make, else
    None. Only requests with that token are checked."""
    try:
        policy = json.loads(Path("rbac.json").read_text())
    except FileNotFoundError:
        return None
    header = request.headers.get("Authorization") or request.headers.get("authorization") or ""
    token = header.removeprefix("Bearer ")
    if token not in policy["tokens"]:
        return None
    attrs = _attributes(request)
    if attrs is None:
        return None
    allowed = any(_allows(rule, attrs) for rule in policy["tokens"][token])
    attrs["token"] = token
    with open("rbac-requests.jsonl", "a") as out:
        out.write(json.dumps({**attrs, "allowed": allowed}) + "\n")
    if allowed:
        return None
    with open("rbac-denied.jsonl", "a") as out:
        out.write(json.dumps(attrs) + "\n")
    what = attrs["resource"] + (f' "{attrs["name"]}"' if attrs["name"] else "")
    where = (
        f' in the namespace "{attrs["namespace"]}"'
        if attrs["namespace"]
        else " at the cluster scope"
    )
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": "Forbidden",
        "code": 403,
        "message": f'{what} is forbidden: User "{token}" cannot {attrs["verb"]} '
        f'resource "{attrs["resource"]}" in API group "{attrs["apiGroup"]}"'
        f"{where}",
    }


async def _serve() -> None:
    import kmock
    from aiohttp import web
    from kmock._internal import parsing

    # The official Python client asks for `watch=True`; a real API server takes any Go bool
    # there, kmock 0.8 only `true`.
    guess = parsing.guess_k8s

    def lenient(k8s: Any, method: Any, query: dict[str, str]) -> Any:
        if "watch" in query:
            query = {**query, "watch": str(query["watch"].lower() in ("1", "t", "true")).lower()}
        return guess(k8s, method, query)

    parsing.guess_k8s = lenient

    core = [kmock.resource("", "v1", plural) for plural in ("pods", "nodes", "events")]

    class Emulator(kmock.KubernetesEmulator):
        def _get_resources(self) -> Any:
            # An API server serves these before any object of them exists (an empty list,
            # not kmock's 404 for a resource it has not seen).
            return list({*super()._get_resources(), *core})

        async def _handle(self, request: Any) -> Any:
            refused = _forbidden(request)
            if refused is not None:
                return web.json_response(refused, status=403)
            if request.subresource != "eviction" or request.method != kmock.method.POST:
                return await super()._handle(request)
            key = (request.resource, request.namespace, request.name)
            async with self._lock:
                if key not in self._objects or self._objects[key].deleted:
                    return web.json_response(
                        {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "status": "Failure",
                            "reason": "NotFound",
                            "code": 404,
                        },
                        status=404,
                    )
                self._objects[key].delete()
                await self._buses[request.resource].put(
                    {"type": "DELETED", "object": self._objects[key].last.raw}
                )
            with open("evictions.jsonl", "a") as out:
                out.write(
                    json.dumps(
                        {"namespace": request.namespace, "pod": request.name, "body": request.data}
                    )
                    + "\n"
                )
            return web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}, status=201
            )

    async with Emulator() as emulator, kmock.Server(emulator) as server:
        print(server.url, flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_serve())
