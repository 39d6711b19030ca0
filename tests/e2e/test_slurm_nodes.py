"""Slurm as multi-node sites run it, on a local cluster of three real slurmd nodes (each its own
network, UTS and mount namespace, its own stasis daemon; n3 without stasis): a job checkpointed
on one node resumes on another, a node killed without warning costs at most one checkpoint
interval, and an opted-in job on a node without stasis runs as it would without stasis."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.conftest import STASIS, STASIS_DEV, TEST_USER
from tests.e2e.conftest import Cluster, close_cluster, new_cluster, until


@pytest.fixture(scope="module")
def nodes() -> Iterator[Cluster]:
    c = new_cluster("nodes", nodes=3, without_stasis=("n3",))
    yield c
    close_cluster(c)


def _host(c: Cluster, job_id: str) -> str:
    return c.job(job_id).get("BatchHost", "")


def _resume(c: Cluster, node: str) -> None:
    c.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
    until(
        lambda: c.run("sinfo", "-h", "-n", node, "-o", "%T").stdout.split()[0].rstrip("*")
        in ("idle", "mixed"),
        90,
        f"node {node} back in service",
    )


def test_nodes_are_hosts_of_their_own(nodes: Cluster) -> None:
    hosts = {n: nodes.on(n, "hostname").stdout.strip() for n in ("n1", "n2", "n3")}
    assert hosts == {"n1": "n1", "n2": "n2", "n3": "n3"}
    addrs = {
        n: nodes.on(n, "ip", "-4", "-o", "addr", "show", "eth0").stdout.split()[3]
        for n in ("n1", "n2")
    }
    assert addrs["n1"] != addrs["n2"]
    # Each node's stasis daemon answers on its own socket; n3 has none.
    for n in ("n1", "n2"):
        assert nodes.on(n, STASIS, "ps", user=TEST_USER).returncode == 0
    assert nodes.on("n3", STASIS, "ps", check=False).returncode != 0


def test_checkpointed_job_resumes_on_another_node(nodes: Cluster) -> None:
    script = nodes.counter_script(
        "moving",
        "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=moving",
        "--exclude=n3",
        stop=20,
        interval=0.5,
    )
    job = nodes.sbatch(script, user=TEST_USER)
    nodes.wait_state(job, ("RUNNING",))
    first = _host(nodes, job)
    other = "n2" if first == "n1" else "n1"
    nodes.wait_number(job, 4)
    # Its node goes into maintenance; the job's owner checkpoints it from the OTHER node: the
    # request reaches the job's node (munge says who asks), which checkpoints and requeues it.
    nodes.run("scontrol", "update", f"NodeName={first}", "State=DRAIN", "Reason=e2e")
    try:
        out = nodes.on(other, STASIS, "dump", "--slurm-job", job, user=TEST_USER).stdout
        assert "requeued" in out
        until(lambda: "stasis: restored checkpoint" in nodes.output(job), 90, f"job {job} restored")
        assert _host(nodes, job) == other
        nodes.wait_state(job, ("COMPLETED",), 90)
    finally:
        _resume(nodes, first)
    numbers = nodes.numbers(job)
    # Each count once, in order: it went on from where it was, on the other node.
    assert numbers == list(range(20)), numbers
    assert nodes.job(job)["Restarts"] == "1"


def test_node_failure_costs_at_most_one_interval(nodes: Cluster) -> None:
    interval_s = 3
    script = nodes.counter_script(
        "survivor",
        f"--export=STASIS_ENABLE=1,STASIS_INTERVAL={interval_s}",
        "--exclude=n3",
        stop=90,
        interval=0.5,
    )
    job = nodes.sbatch(script, user=TEST_USER)
    nodes.wait_state(job, ("RUNNING",))
    victim = _host(nodes, job)
    until(
        lambda: nodes.output(job).count("periodic checkpoint") >= 2, 60, "two periodic checkpoints"
    )
    nodes.run(STASIS_DEV, "local-cluster", "kill-node", "--dir", str(nodes.root), victim)
    killed_at = time.monotonic()
    last = nodes.numbers(job)[-1]
    try:
        # Slurm finds the node DOWN (SlurmdTimeout) and requeues the job (NODE_FAIL).
        until(
            lambda: "stasis: restored checkpoint" in nodes.output(job),
            150,
            f"job {job} restored after its node failed",
        )
        assert _host(nodes, job) != victim
        nodes.wait_state(job, ("COMPLETED",), 120)
    finally:
        nodes.run(STASIS_DEV, "local-cluster", "start-node", "--dir", str(nodes.root), victim)
        _resume(nodes, victim)
    numbers = nodes.numbers(job)
    before = numbers[: numbers.index(last) + 1]
    after = numbers[len(before) :]
    assert before == list(range(last + 1))
    # The restored run starts from the last periodic checkpoint: at most one interval of
    # counts (2 a second) is done again, nothing from 0, and it counts on to the end.
    assert after and after[0] > 0 and last - after[0] + 1 <= interval_s * 2 + 2, (last, after[:3])
    assert after == list(range(after[0], 90))
    assert time.monotonic() - killed_at < 240


def test_opted_in_job_on_a_node_without_stasis_runs_as_without(nodes: Cluster) -> None:
    script = nodes.counter_script(
        "bare",
        "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=bare",
        "--nodelist=n3",
        # Long enough to be running still when a loaded machine gets round to the signal
        # (Debian 13 root, 2026-12-07: 12 numbers at 0.5 s were all out before it, and scancel
        # found the job done).
        stop=40,
        interval=0.5,
    )
    job = nodes.sbatch(script, user=TEST_USER)
    nodes.wait_number(job, 2)
    # What Slurm sends the batch shell at the preemption or time-limit warning cli_filter asked
    # for: on a node without stasis nothing handles it, and the job must not die of it.
    signalled = nodes.run("scancel", "--batch", "--signal=URG", job, check=False)
    assert signalled.returncode == 0, (signalled.stderr, nodes.why(job), nodes.output(job))
    nodes.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 90)
    info = nodes.job(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
    assert nodes.numbers(job) == list(range(40))
    assert "stasis:" not in nodes.output(job)


def test_multi_node_job_is_refused_at_submission_with_the_reason(nodes: Cluster) -> None:
    script = nodes.script("spread", "srun -l /bin/hostname", f"--output={nodes.work}/spread-%j.out")
    refused = nodes.run(
        "sbatch",
        "--parsable",
        "-N",
        "2",
        "--export=STASIS_ENABLE=1",
        str(script),
        user=TEST_USER,
        check=False,
    )
    assert refused.returncode != 0
    assert "stasis cannot checkpoint a job that spans nodes" in refused.stderr
    # Without stasis the same job runs on both nodes; opted in on one node it is kept there.
    plain = nodes.sbatch(script, "-N", "2", "--exclude=n3", user=TEST_USER)
    nodes.wait_state(plain, ("COMPLETED",), 60)
    assert sorted(nodes.output(plain).split()) == ["0:", "1:", "n1", "n2"]
    single = nodes.sbatch(
        script,
        "--export=STASIS_ENABLE=1,PATH=/usr/bin:/bin",
        "-n",
        "2",
        "--exclude=n3",
        user=TEST_USER,
    )
    nodes.wait_state(single, ("COMPLETED",), 60)
    assert nodes.job(single)["NumNodes"] == "1"


def test_drain_moves_protected_jobs_to_another_node(nodes: Cluster) -> None:
    script = nodes.counter_script(
        "drained",
        "--export=STASIS_ENABLE=1,STASIS_CHECKPOINT=drained",
        "--exclude=n3",
        stop=24,
        interval=0.5,
    )
    job = nodes.sbatch(script, user=TEST_USER)
    nodes.wait_state(job, ("RUNNING",))
    first = _host(nodes, job)
    nodes.wait_number(job, 3)
    # A user may not drain a node; root may, from any node.
    refused = nodes.on("n2", STASIS, "slurm", "drain", first, user=TEST_USER, check=False)
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1
    try:
        answer = json.loads(
            nodes.on(
                "n2" if first == "n1" else "n1",
                STASIS,
                "slurm",
                "drain",
                first,
                "--reason",
                "kernel update",
                "--json",
            ).stdout
        )
        assert [r["job"] for r in answer["requeued"]] == [job] and answer["empty"], answer
        state = nodes.run("sinfo", "-h", "-n", first, "-o", "%T").stdout.strip()
        assert "drain" in state, state
        until(lambda: "stasis: restored checkpoint" in nodes.output(job), 90, f"job {job} restored")
        assert _host(nodes, job) != first
        nodes.wait_state(job, ("COMPLETED",), 90)
    finally:
        _resume(nodes, first)
    assert nodes.numbers(job) == list(range(24))
