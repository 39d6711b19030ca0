"""The Helm chart (charts/stasis): renders with default and custom values, lints strictly with
Helm's own library (helm-python-sdk), and every manifest passes the Kubernetes schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helm_python import Chart, lint

CHART = Path(__file__).resolve().parents[2] / "charts" / "stasis"
KUBE_VERSION = "1.30.0"
CUSTOM = {"config": {"clusterId": "c-42", "url": "https://cp.example", "authToken": "s3cret"},
          "image": {"repository": "registry.example/stasis", "tag": "9.9"},
          "store": {"url": "s3://ckpt/site", "compression": "zstd", "encrypt": True,
                    "encryptionKeySecret": "stasis-key"},
          "nodeSelector": {"gpu": "true"}, "minIntervalSeconds": 300}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    rendered = Chart.load(CHART).render(values, name="stasis", namespace="stasis-system")
    docs = [d for text in rendered.values() for d in yaml.safe_load_all(text) if d]
    assert docs
    return docs


@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["defaults", "custom"])
def test_the_chart_renders_lints_and_validates(values: dict[str, Any]) -> None:
    report = lint(CHART, values, strict=True, namespace="stasis-system")
    # Severity 1 is Helm's INFO ("icon is recommended"); warnings and errors fail.
    assert report["errors"] == [] and all(m["severity"] <= 1 for m in report["messages"]), \
        report
    docs = render(values)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet",
                     "RuntimeClass", "Secret", "ServiceAccount"]


def test_values_reach_the_manifests_and_the_token_only_the_secret(tmp_path: Path) -> None:
    docs = {d["kind"]: d for d in render(CUSTOM)}
    assert docs["RuntimeClass"]["handler"] == "stasis"
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["nodeSelector"] == {"gpu": "true"}
    agent = pod["containers"][0]
    assert agent["image"] == "registry.example/stasis:9.9"
    assert agent["securityContext"]["privileged"] is True
    assert agent["readinessProbe"]["exec"]["command"] == ["stasis", "check"]
    assert agent["command"] == ["stasis"] and agent["args"][:3] == [
        "k8s", "agent", "--host-root=/host"]
    assert "--taint=stasis.dev/not-ready:NoSchedule" in agent["args"]
    # The agent's own CLI takes what the chart passes.
    from stasis.cli.main import parser

    parsed = parser("k8s").parse_args(agent["args"])
    assert parsed.host_root == Path("/host") and parsed.restart_containerd.startswith("nsenter")
    env = {e["name"]: e for e in agent["env"]}
    assert env["STASIS_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    assert mounts["/run/containerd"]["mountPropagation"] == "HostToContainer"
    config = docs["ConfigMap"]["data"]["config.toml"]
    assert 'store = "s3://ckpt/site"' in config and "encrypt = true" in config
    assert "s3cret" not in str(docs["ConfigMap"]) and "s3cret" not in str(docs["DaemonSet"])
    assert docs["Secret"]["stringData"]["authToken"] == "s3cret"
    # The daemon joins the control plane the values name, and may drain its node.
    assert 'controlplane_url = "https://cp.example"' in config
    assert 'cluster_id = "c-42"' in config
    assert env["STASIS_K8S_MIN_INTERVAL_S"]["value"] == "300"
    rules = docs["ClusterRole"]["rules"]
    assert {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]} in rules
    assert any("nodes" in r["resources"] and "patch" in r["verbs"] for r in rules)
    # Answers are events: no right to write to any pod (that is a right to change its image),
    # none to read Secrets, no wildcard. (What is used of it: tests/e2e/test_k8s_agent.py.)
    assert {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]} in rules
    for r in rules:
        assert "*" not in r["verbs"] + r["resources"] + r["apiGroups"], r
        assert "secrets" not in r["resources"], r
        if "pods" in r["resources"]:
            assert set(r["verbs"]) <= {"get", "list", "watch"}, r
    # The daemon reads that config file as it is (no setting it does not know).
    import tomllib

    from stasis.config import load_settings

    toml = tmp_path / "config.toml"
    toml.write_text(config)
    settings = load_settings({"STASIS_CONFIG": str(toml)})
    assert (settings.controlplane_url, settings.cluster_id) == ("https://cp.example", "c-42")
    assert tomllib.loads(config)["store"] == "s3://ckpt/site"
    default_image = {d["kind"]: d for d in render({})}["DaemonSet"]["spec"]["template"][
        "spec"]["containers"][0]["image"]
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert default_image == f"stasis/agent:{version}"


@pytest.mark.parametrize("given", [True, False, None])
def test_allow_plain_http_reaches_the_nodes_config(tmp_path: Path, given: bool | None) -> None:
    """config.allowPlainHttp: the node's controlplane_allow_plain_http (default false), so an
    http:// control plane off loopback is refused unless the chart's values allow it."""
    from stasis.config import load_settings
    from stasis.controlplane.client import ControlPlaneClient
    from stasis.errors import UsageError

    config: dict[str, Any] = {"clusterId": "c-42", "url": "http://cp.example:8000"}
    if given is not None:
        config["allowPlainHttp"] = given
    assert lint(CHART, {"config": config}, strict=True, namespace="stasis-system")["errors"] == []
    toml = tmp_path / "config.toml"
    toml.write_text({d["kind"]: d for d in render({"config": config})}["ConfigMap"]["data"][
        "config.toml"])
    settings = load_settings({"STASIS_CONFIG": str(toml)})
    assert settings.controlplane_allow_plain_http is bool(given)
    # What the node does with it (stasis.controlplane.node builds its client this way).
    if given:
        ControlPlaneClient(settings.controlplane_url, "",
                           allow_plain_http=settings.controlplane_allow_plain_http)
    else:
        with pytest.raises(UsageError, match="controlplane_allow_plain_http"):
            ControlPlaneClient(settings.controlplane_url, "",
                               allow_plain_http=settings.controlplane_allow_plain_http)
