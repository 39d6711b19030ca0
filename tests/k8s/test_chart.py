"""The Helm chart (charts/stasis): renders with default and custom values, lints strictly with
Helm's own library (helm-python-sdk) against its values.schema.json, and every manifest passes
the Kubernetes schema of 1.30 and of the newest version kubernetes_validate knows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helm_python import Chart, lint

CHART = Path(__file__).resolve().parents[2] / "charts" / "stasis"
KUBE_VERSION = "1.30.0"
# The newest Kubernetes whose schema kubernetes_validate has here.
NEWEST = kubernetes_validate.utils.latest_version()
SITE_KEY = "k" * 44
CUSTOM = {
    "config": {"clusterId": "c-42", "url": "https://cp.example", "authToken": "s3cret"},
    "image": {"repository": "registry.example/stasis", "tag": "9.9"},
    "siteKey": {"value": SITE_KEY},
    "store": {
        "url": "s3://ckpt/site",
        "encrypt": True,
        "encryptionKeySecret": "stasis-key",
        "s3": {
            "endpoint": "http://10.0.0.5:8333",
            "region": "eu-west-3",
            "existingSecret": "stasis-s3",
        },
    },
    "resources": {"requests": {"cpu": "200m", "memory": "512Mi"}, "limits": {"memory": "4Gi"}},
    "priorityClassName": "stasis-critical",
    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "nodeSelector": {"gpu": "true"},
    "minIntervalSeconds": 300,
    "interruptionRatePerHour": 0.25,
    "defaultInterval": "auto",
}
# Secrets of the site's own; k3s with containerd 2 (config version 3).
EXISTING = {
    "siteKey": {"existingSecret": "site-key", "secretKey": "key.bin"},
    "store": {
        "url": "s3://ckpt/k3s",
        "s3": {
            "existingSecret": "minio",
            "accessKeyIdKey": "user",
            "secretAccessKeyKey": "password",
        },
    },
    "containerd": {
        "configPath": "/var/lib/rancher/k3s/agent/etc/containerd/config-v3.toml.tmpl",
        "configVersion": 3,
        "socket": "/run/k3s/containerd/containerd.sock",
        "stateDir": "/run/k3s/containerd",
        "rootDir": "/var/lib/rancher/k3s/agent/containerd",
        "restartCommand": "nsenter -t 1 -m -u -i -n -p -- systemctl restart k3s",
    },
    "uninstall": {"cleanup": False},
    "priorityClassName": "",
}
CASES = {"defaults": {}, "custom": CUSTOM, "existing-secrets-k3s-v3": EXISTING}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    rendered = Chart.load(CHART).render(values, name="stasis", namespace="stasis-system")
    docs = [
        d
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if d
    ]
    assert docs
    return docs


def notes(values: dict[str, Any]) -> str:
    rendered = Chart.load(CHART).render(values, name="stasis", namespace="stasis-system")
    return str(rendered["stasis/templates/NOTES.txt"])


def lint_ok(values: dict[str, Any]) -> None:
    report = lint(CHART, values, strict=True, namespace="stasis-system")
    # Severity 1 is Helm's INFO ("icon is recommended"); warnings and errors fail.
    assert report["errors"] == [] and all(m["severity"] <= 1 for m in report["messages"]), report


@pytest.mark.parametrize("kube_version", [KUBE_VERSION, NEWEST])
@pytest.mark.parametrize("case", list(CASES))
def test_the_chart_renders_lints_and_validates(case: str, kube_version: str) -> None:
    values = CASES[case]
    lint_ok(values)
    docs = render(values)
    for doc in docs:
        kubernetes_validate.validate(doc, kube_version, strict=True)
    kinds = sorted(d["kind"] for d in docs)
    hook = (
        []
        if case == "existing-secrets-k3s-v3"
        else ["ClusterRole", "ClusterRoleBinding", "Job", "ServiceAccount"]
    )
    site_secret = ["Secret"] if case == "custom" else []
    assert kinds == sorted(
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            "RuntimeClass",
            "Secret",
            "ServiceAccount",
            *hook,
            *site_secret,
        ]
    )
    assert "stasis" in notes(values)


def by_name(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def test_values_reach_the_manifests_and_the_token_only_the_secret(tmp_path: Path) -> None:
    docs = {d["kind"]: d for d in render(CUSTOM)}
    named = by_name(render(CUSTOM))
    assert docs["RuntimeClass"]["handler"] == "stasis"
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["nodeSelector"] == {"gpu": "true"}
    assert pod["priorityClassName"] == "stasis-critical"
    assert pod["tolerations"] == CUSTOM["tolerations"]
    agent = pod["containers"][0]
    assert agent["resources"] == CUSTOM["resources"]
    assert agent["image"] == "registry.example/stasis:9.9"
    assert agent["securityContext"]["privileged"] is True
    assert agent["readinessProbe"]["exec"]["command"] == ["stasis", "check"]
    assert agent["command"] == ["stasis"] and agent["args"][:3] == [
        "k8s",
        "agent",
        "--host-root=/host",
    ]
    assert "--taint=stasis.dev/not-ready:NoSchedule" in agent["args"]
    # The agent's own CLI takes what the chart passes.
    from stasis.cli.main import parser

    parsed = parser("k8s").parse_args(agent["args"])
    assert parsed.host_root == Path("/host") and parsed.restart_containerd.startswith("nsenter")
    assert parsed.containerd_config_version == 0
    assert parsed.bundle_dir == Path("/usr/local/lib/stasis")
    env = {e["name"]: e for e in agent["env"]}
    assert env["STASIS_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # S3's keys: from the site's Secret into the daemon's environment, where botocore reads
    # them; never a value in the manifests.
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "stasis-s3",
        "key": "AWS_ACCESS_KEY_ID",
    }
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "stasis-s3",
        "key": "AWS_SECRET_ACCESS_KEY",
    }
    assert all("value" not in e for e in env.values() if e["name"].startswith("AWS_"))
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    assert mounts["/run/containerd"]["mountPropagation"] == "HostToContainer"
    # Key files one by one (subPath): a Secret volume's own files are links, which the daemon
    # does not follow when it opens a key.
    assert mounts["/etc/stasis-secrets/site.key"]["subPath"] == "site.key"
    assert mounts["/etc/stasis-secrets/encryption.key"]["subPath"] == "key"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["site-key"]["secret"] == {"secretName": "stasis-site-key", "defaultMode": 0o400}
    config = docs["ConfigMap"]["data"]["config.toml"]
    assert 'store = "s3://ckpt/site"' in config and "encrypt = true" in config
    assert "s3cret" not in str(docs["ConfigMap"]) and "s3cret" not in str(docs["DaemonSet"])
    assert SITE_KEY not in str(docs["ConfigMap"]) + str(docs["DaemonSet"])
    assert "compression" not in str(docs["ConfigMap"])  # no such setting
    assert named["Secret/stasis-auth"]["stringData"]["authToken"] == "s3cret"
    assert named["Secret/stasis-site-key"]["stringData"] == {"site.key": SITE_KEY}
    # The daemon joins the control plane the values name, and may drain its node.
    assert 'controlplane_url = "https://cp.example"' in config
    assert 'cluster_id = "c-42"' in config
    assert env["STASIS_K8S_MIN_INTERVAL_S"]["value"] == "300"
    assert env["STASIS_K8S_INTERRUPTION_RATE_PER_HOUR"]["value"] == "0.25"
    assert env["STASIS_DEFAULT_INTERVAL"]["value"] == "auto"
    rules = named["ClusterRole/stasis-agent"]["rules"]
    assert {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]} in rules
    assert any("nodes" in r["resources"] and "patch" in r["verbs"] for r in rules)
    # Answers are events: no right to write to any pod (that is a right to change its image),
    # none to read Secrets, no wildcard. (What is used of it: tests/e2e/test_k8s_agent.py.)
    assert {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]} in rules
    for r in rules + named["ClusterRole/stasis-uninstall"]["rules"]:
        assert "*" not in r["verbs"] + r["resources"] + r["apiGroups"], r
        assert "secrets" not in r["resources"], r
        if "pods" in r["resources"]:
            assert set(r["verbs"]) <= {"get", "list", "watch"}, r
    # The daemon reads that config file as it is (no setting it does not know).
    import tomllib

    from stasis.config import load_settings
    from stasis.store.store import store_options

    toml = tmp_path / "config.toml"
    toml.write_text(config)
    settings = load_settings({"STASIS_CONFIG": str(toml)})
    assert (settings.controlplane_url, settings.cluster_id) == ("https://cp.example", "c-42")
    assert tomllib.loads(config)["store"] == "s3://ckpt/site"
    assert settings.site_key == "/etc/stasis-secrets/site.key"
    assert settings.encryption_key_file == "/etc/stasis-secrets/encryption.key"
    # Endpoint and region from the file; the keys left to botocore (AWS_* from the Secret).
    assert store_options(settings) == {
        "client_kwargs": {"endpoint_url": "http://10.0.0.5:8333", "region_name": "eu-west-3"}
    }
    default_image = {d["kind"]: d for d in render({})}["DaemonSet"]["spec"]["template"]["spec"][
        "containers"
    ][0]["image"]
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert default_image == f"stasis/agent:{version}"
    default_pod = {d["kind"]: d for d in render({})}["DaemonSet"]["spec"]["template"]["spec"]
    assert default_pod["priorityClassName"] == "system-node-critical"
    assert default_pod["containers"][0]["resources"]["requests"] == {
        "cpu": "100m",
        "memory": "256Mi",
    }
    assert default_pod["tolerations"] == [{"operator": "Exists"}]


def test_two_nodes_given_the_chart_s_site_key_trust_each_other_s_checkpoints(
    tmp_path: Path,
) -> None:
    """What the site key is for: a pod moved to another node resumes from its checkpoint only
    if that node trusts the key it was signed with. Each node reads the chart's config and the
    key file the chart mounts (the Secret's value, root-only as defaultMode 0400 makes it)."""
    from stasis.config import load_settings
    from stasis.store.signing import Verdict, node_keyring

    docs = by_name(render(CUSTOM))
    key = tmp_path / "site.key"
    key.write_text(docs["Secret/stasis-site-key"]["stringData"]["site.key"])
    key.chmod(0o400)
    config = docs["ConfigMap/stasis-config"]["data"]["config.toml"].replace(
        "/etc/stasis-secrets/site.key", str(key)
    )
    rings = []
    for node in ("a", "b"):
        (tmp_path / node).mkdir()
        (tmp_path / node / "config.toml").write_text(
            config.replace('state_dir = "/var/lib/stasis"', f'state_dir = "{tmp_path / node}"')
        )
        settings = load_settings({"STASIS_CONFIG": str(tmp_path / node / "config.toml")})
        rings.append(node_keyring(settings, create=True))
    signature = rings[0].sign("manifest", {"checkpoint": "c1"})
    assert rings[1].verify("manifest", {"checkpoint": "c1"}, signature) == Verdict.VALID
    # Without the site key (the chart's defaults), node b refuses node a's checkpoint.
    plain = by_name(render({}))["ConfigMap/stasis-config"]["data"]["config.toml"]
    assert "site_key" not in plain
    for node in ("c", "d"):
        (tmp_path / node).mkdir()
        (tmp_path / node / "config.toml").write_text(
            plain.replace('state_dir = "/var/lib/stasis"', f'state_dir = "{tmp_path / node}"')
        )
    c, d = (
        node_keyring(
            load_settings({"STASIS_CONFIG": str(tmp_path / n / "config.toml")}), create=True
        )
        for n in ("c", "d")
    )
    assert (
        d.verify("manifest", {"checkpoint": "c1"}, c.sign("manifest", {"checkpoint": "c1"}))
        == Verdict.UNKNOWN_KEY
    )
    assert "WARNING: no site key" in notes({}) and "WARNING" not in notes(CUSTOM)


def test_existing_secrets_and_k3s_with_containerd_2(tmp_path: Path) -> None:
    docs = by_name(render(EXISTING))
    assert "Secret/stasis-site-key" not in docs  # the site's own Secret is used
    assert not any(k.startswith("Job/") for k in docs)  # uninstall.cleanup false
    pod = docs["DaemonSet/stasis-agent"]["spec"]["template"]["spec"]
    assert "priorityClassName" not in pod
    agent = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["site-key"]["secret"]["secretName"] == "site-key"
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    assert mounts["/etc/stasis-secrets/site.key"]["subPath"] == "key.bin"
    env = {e["name"]: e for e in agent["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "minio", "key": "user"}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "minio",
        "key": "password",
    }
    # containerd where k3s keeps it, at the host's own paths in the agent.
    assert mounts["/run/k3s/containerd"]["mountPropagation"] == "HostToContainer"
    assert mounts["/var/lib/rancher/k3s/agent/containerd"]["mountPropagation"] == "HostToContainer"
    assert volumes["containerd-run"]["hostPath"]["path"] == "/run/k3s/containerd"
    from stasis.cli.main import parser

    parsed = parser("k8s").parse_args(agent["args"])
    assert parsed.containerd_config_version == 3
    assert str(parsed.containerd_config).endswith("config-v3.toml.tmpl")
    config = docs["ConfigMap/stasis-config"]["data"]["config.toml"]
    assert 'containerd_address = "/run/k3s/containerd/containerd.sock"' in config
    assert "s3_endpoint_url" not in config  # AWS's own, for the region


@pytest.mark.parametrize(
    "values,why",
    [
        ({"store": {"compression": "zstd"}}, "compression"),  # no such setting: removed
        ({"siteKey": {"value": "short"}}, "siteKey"),
        ({"containerd": {"configVersion": 1}}, "configVersion"),
        ({"containerd": {"socket": "run/containerd.sock"}}, "socket"),
        ({"taint": {"effect": "Never"}}, "effect"),
        ({"nonsense": 1}, "nonsense"),
    ],
)
def test_values_the_chart_cannot_use_fail_lint_in_one_message(
    values: dict[str, Any], why: str
) -> None:
    report = lint(CHART, values, strict=True, namespace="stasis-system")
    assert report["errors"] and why in str(report["errors"]), report


def test_encryption_without_a_key_fails_the_install_in_one_line() -> None:
    from helm_python.errors import HelmRenderError

    with pytest.raises(HelmRenderError, match="store.encryptionKeySecret names no Secret"):
        render({"store": {"encrypt": True}})


def leaves(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, dict) and value:
        return [k for key, v in value.items() for k in leaves(v, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def test_the_schema_knows_every_value_and_the_readme_documents_every_one() -> None:
    """values.schema.json describes each value (and refuses others); README.md is what
    `make docs` writes from values.yaml now, with a row per value and a comment for each."""
    import json

    from stasis.k8s import chartdoc

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    for leaf in leaves(values):
        node = schema
        for part in leaf.split("."):
            if part in ("requests", "limits") and leaf.startswith("resources."):
                node = node["properties"][part]
                break
            node = node["properties"][part]
        assert node, leaf
    assert chartdoc.undocumented() == []
    readme = (CHART / "README.md").read_text()
    assert readme == chartdoc.readme(), "charts/stasis/README.md is stale: run `make docs`"
    for leaf in leaves(values):
        assert f"| `{leaf}` |" in readme, leaf


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
    toml.write_text(
        {d["kind"]: d for d in render({"config": config})}["ConfigMap"]["data"]["config.toml"]
    )
    settings = load_settings({"STASIS_CONFIG": str(toml)})
    assert settings.controlplane_allow_plain_http is bool(given)
    # What the node does with it (stasis.controlplane.node builds its client this way).
    if given:
        ControlPlaneClient(
            settings.controlplane_url, "", allow_plain_http=settings.controlplane_allow_plain_http
        )
    else:
        with pytest.raises(UsageError, match="controlplane_allow_plain_http"):
            ControlPlaneClient(
                settings.controlplane_url,
                "",
                allow_plain_http=settings.controlplane_allow_plain_http,
            )
