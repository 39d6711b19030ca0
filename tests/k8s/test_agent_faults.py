"""The node agent's readiness under faults (issue 28): a daemon that does not answer at all
(stopped, not dead: its socket still takes connections) puts the not-ready taint on within a
bound, as a dead one does, against kmock's API emulator with the chart's RBAC."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import STASIS, new_daemon, wait_for
from tests.k8s.apiserver import ApiServer
from tests.k8s.chart_rbac import agent_rules

NODE = "node-f"
TOKEN = "stasis-agent-token"
NOT_READY = "stasis.dev/not-ready"


def test_a_daemon_that_does_not_answer_taints_the_node_within_a_bound(
    world_tmp: Path, tmp_path: Path
) -> None:
    daemon = new_daemon(world_tmp, "agent-faults")
    daemon.start()
    api = ApiServer(tmp_path)
    api.start()
    agent: subprocess.Popen[bytes] | None = None
    log = tmp_path / "agent.log"
    try:
        kubeconfig = api.authorize(TOKEN, agent_rules())
        api.create(
            "nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": NODE},
                "spec": {"taints": [{"key": NOT_READY, "effect": "NoSchedule"}]},
            },
        )

        def taints() -> list[str]:
            return [t["key"] for t in api.get("nodes", NODE)["spec"].get("taints") or []]

        with log.open("ab") as out:
            agent = subprocess.Popen(
                [
                    STASIS,
                    "k8s",
                    "agent",
                    "--node",
                    NODE,
                    "--kubeconfig",
                    str(kubeconfig),
                    "--no-daemon",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**daemon.env, "STASIS_K8S_CHECK_INTERVAL_S": "0.5"},
            )
        wait_for(lambda: taints() == [], 30, f"the taint to come off ({log})")
        assert daemon.proc is not None
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # hung: connections queue, none answered
        try:
            began = time.monotonic()
            wait_for(lambda: taints() == [NOT_READY], 15, "the taint for a silent daemon")
            assert time.monotonic() - began < 15
            assert "stasis is not ready: cannot reach the stasis daemon" in log.read_text()
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        wait_for(lambda: taints() == [], 30, "the taint to come off again")
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
        api.stop()
        daemon.stop()
