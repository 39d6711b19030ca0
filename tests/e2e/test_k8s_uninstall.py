"""Uninstalling the chart takes stasis off the nodes: its pre-delete hook (`stasis k8s
uninstall-nodes`, with exactly the rights the chart gives the hook's service account) asks
each node's agent (`stasis k8s agent --host-root`, with the agent's rights), through kmock's
API emulator. The agent puts the runtime into a host root of its own (containerd's real
default config, written by the containerd installed here), and each "restart" of containerd
is containerd's own parser reading the config back. A SIGTERM alone (a rolling update) must
leave everything in place."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import tomllib
from pathlib import Path

from tests.conftest import STASIS, wait_for
from tests.k8s.apiserver import ApiServer
from tests.k8s.chart_rbac import agent_rules, hook_rules
from tests.k8s.test_chart import render

NODE = "node-u"
NOT_READY = "stasis.dev/not-ready"
RELEASE_NS = "stasis-system"


def test_uninstall_takes_the_runtime_entry_bundle_and_taint_off_and_a_sigterm_does_not(
    tmp_path: Path,
) -> None:
    host = tmp_path / "host"
    config = host / "etc" / "containerd" / "config.toml"
    config.parent.mkdir(parents=True)
    original = subprocess.run(
        ["containerd", "config", "default"], capture_output=True, check=True
    ).stdout
    config.write_bytes(original)
    runc = host / "usr" / "sbin" / "runc"
    runc.parent.mkdir(parents=True)
    runc.write_text("#!/bin/sh\n")
    runc.chmod(0o755)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    restart = tmp_path / "restart-containerd"
    # containerd "restarts": its own parser reads the config the agent left (a config it
    # cannot read fails the agent, as a real restart would fail containerd).
    restart.write_text(
        f"#!/bin/sh\nset -e\nn=$(ls {dumps} | wc -l)\n"
        f"containerd --config {config} config dump > {tmp_path}/dump.tmp\n"
        f"mv {tmp_path}/dump.tmp {dumps}/$n.toml\n"
    )
    restart.chmod(0o755)
    # The agent's own config: no daemon answers there, so the node stays not ready.
    agent_config = tmp_path / "stasis.toml"
    agent_config.write_text(f'socket = "{tmp_path}/none.sock"\nstate_dir = "{tmp_path}/state"\n')
    api = ApiServer(tmp_path)
    api.start()
    agent: subprocess.Popen[bytes] | None = None
    log = tmp_path / "agent.log"
    # The arguments the chart gives the agent, with the host root and restart of this test.
    args = {d["kind"]: d for d in render({})}["DaemonSet"]["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    args = [a for a in args if not a.startswith(("--host-root", "--restart-containerd"))]

    def start_agent() -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen(
                [
                    STASIS,
                    *args,
                    "--host-root",
                    str(host),
                    "--restart-containerd",
                    str(restart),
                    "--node",
                    NODE,
                    "--kubeconfig",
                    str(agent_kubeconfig),
                    "--no-daemon",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "STASIS_CONFIG": str(agent_config),
                    "STASIS_K8S_CHECK_INTERVAL_S": "0.3",
                },
            )

    def taints() -> list[str]:
        return [t["key"] for t in api.get("nodes", NODE)["spec"].get("taints") or []]

    def agent_pod(name: str, node: str) -> None:
        api.create(
            "pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": RELEASE_NS,
                    "labels": {
                        "app.kubernetes.io/name": "stasis",
                        "app.kubernetes.io/instance": "stasis",
                    },
                },
                "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "x"}]},
            },
        )

    def hook(timeout_s: float) -> subprocess.CompletedProcess[str]:
        job = {d["kind"]: d for d in render({})}["Job"]["spec"]["template"]["spec"]
        hook_args = [a for a in job["containers"][0]["args"] if not a.startswith("--timeout")]
        return subprocess.run(
            [STASIS, *hook_args, f"--timeout={timeout_s}", "--kubeconfig", str(hook_kubeconfig)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "STASIS_CONFIG": "/dev/null"},
        )

    bundle = host / "usr" / "local" / "lib" / "stasis"
    shim = host / "usr" / "local" / "bin" / "containerd-shim-stasis-v2"
    try:
        agent_kubeconfig = api.authorize("stasis-agent-token", agent_rules())
        hook_kubeconfig = api.authorize("stasis-uninstall-token", hook_rules())
        api.create(
            "nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": NODE},
                "spec": {
                    "taints": [
                        {"key": NOT_READY, "effect": "NoSchedule"},
                        {"key": "other", "value": "x", "effect": "NoExecute"},
                    ]
                },
            },
        )
        agent_pod("stasis-agent-u", NODE)
        agent = start_agent()
        wait_for(lambda: (dumps / "0.toml").exists(), 180, f"the runtime installed ({log})")
        dumped = tomllib.loads((dumps / "0.toml").read_text())
        assert (
            dumped["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["stasis"][
                "runtime_type"
            ]
            == "io.containerd.stasis.v2"
        )
        assert (bundle / "bin" / "stasis-runc").exists() and shim.exists()

        # A rolling update: the agent's pod gets SIGTERM and a new one starts. Nothing of
        # the runtime is taken off (the node's protected pods stay protected).
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
        installed = config.read_bytes()
        assert installed != original and bundle.exists() and shim.exists()
        agent = start_agent()
        wait_for(
            lambda: "running" in log.read_text().split("agent of node")[-1], 60, "the new agent"
        )
        assert config.read_bytes() == installed and taints() == [NOT_READY, "other"]

        # helm uninstall: the hook asks, the agent takes stasis off and answers.
        done = hook(60)
        assert done.returncode == 0, done.stderr + log.read_text()[-3000:]
        assert f"node {NODE}: stasis taken off" in done.stdout
        assert config.read_bytes() == original  # byte for byte
        assert not bundle.exists() and not shim.exists()
        assert not (host / "usr" / "local" / "bin" / "runc-wrapper").exists()
        assert not (host / "etc" / "stasis").exists()
        # containerd restarted once more, and its parser finds no stasis runtime now.
        last = tomllib.loads((dumps / "1.toml").read_text())
        assert (
            "stasis" not in last["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
        )
        assert taints() == ["other"]
        # Its daemon still does not answer: the taint is not put back.
        time.sleep(1.5)
        assert taints() == ["other"] and agent.poll() is None

        # A node whose agent never answers fails the hook in one line naming it.
        agent_pod("stasis-agent-v", "node-v")
        api.create(
            "nodes",
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-v"}, "spec": {}},
        )
        failed = hook(2)
        assert failed.returncode != 0
        lines = failed.stderr.strip().splitlines()
        assert len(lines) == 1 and "node-v: no answer from the stasis agent" in lines[0], lines
        assert "helm uninstall --no-hooks" in lines[0] and NODE not in lines[0]
        assert config.read_bytes() == original  # answered again, nothing left to take off

        # Both did only what the chart's RBAC grants them.
        assert api.requests(denied=True) == []
        hook_calls = {
            (r["verb"], r["resource"]) for r in api.requests(token="stasis-uninstall-token")
        }
        assert hook_calls == {("list", "pods"), ("patch", "nodes"), ("get", "nodes")}
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=60)
        api.stop()
