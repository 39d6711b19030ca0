"""Two daemons standing in for two nodes share one real S3 bucket (SeaweedFS): a job dumped on
one resumes on the other, by id and by label; a wrong key or a missing bucket fails the dump
with one line and leaves the job running."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.conftest import TEST_USER, Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error
from tests.daemon.test_restore_state import last_number, numbers
from tests.s3server import REGION, S3Server


def _counter(d: Daemon, label: str) -> Any:
    job = d.json("run", "--label", label, "--", *workload("counter.py"), user=TEST_USER)
    wait_for(lambda: last_number(d, job["job"]) >= 3, what="counting")
    return job


def _continues(d: Daemon, restored: Any, at_dump: int) -> None:
    wait_for(lambda: last_number(d, restored["job"]) >= at_dump + 3, what="counting on")
    values = numbers(d.log_of(restored["job"]))
    assert values == list(range(len(values)))  # one count, continued, never restarted
    assert values[-1] >= at_dump + 3


def test_a_job_moves_between_nodes_through_s3_by_id_and_by_label(
    make_daemon: MakeDaemon, s3: S3Server, s3_bucket: str, site_key: Path
) -> None:
    url = f"s3://{s3_bucket}/site"
    env = {**s3.env(), "STASIS_SITE_KEY": str(site_key)}
    node_a = make_daemon(store=url, env=env)
    node_b = make_daemon(store=url, env=env)
    job = _counter(node_a, "roam")
    first = node_a.json("dump", job["job"])["checkpoint"]
    at_first = last_number(node_a, job["job"])
    assert [c["id"] for c in node_b.json("checkpoints", "--label", "roam", user=TEST_USER)] == [
        first
    ]

    on_b = node_b.json("restore", "--label", "roam", user=TEST_USER)
    assert on_b["checkpoint"] == first
    _continues(node_b, on_b, at_first)
    second = node_b.json("dump", on_b["job"])["checkpoint"]
    at_second = last_number(node_b, on_b["job"])
    assert at_second > at_first

    back_on_a = node_a.json("restore", second, user=TEST_USER)
    _continues(node_a, back_on_a, at_second)
    assert [c["id"] for c in node_a.json("checkpoints", "--label", "roam", user=TEST_USER)] == [
        second,
        first,
    ]
    node_a.cli("kill", back_on_a["job"])
    # The bucket holds checkpoints and the index, no key material.
    assert s3.secret_key not in (node_a.root / "daemon.log").read_text()


def test_credentials_from_the_config_file(
    make_daemon: MakeDaemon, s3: S3Server, s3_bucket: str, world_tmp: Path
) -> None:
    secret = world_tmp / f"s3-secret-{os.urandom(4).hex()}"
    secret.write_text(s3.secret_key + "\n")
    secret.chmod(0o600)
    config = world_tmp / f"config-{os.urandom(4).hex()}.toml"
    config.write_text(
        f'store = "s3://{s3_bucket}/cfg"\n'
        f's3_endpoint_url = "{s3.endpoint}"\n'
        f's3_region = "{REGION}"\n'
        f's3_access_key_id = "{s3.access_key}"\n'
        f's3_secret_access_key_file = "{secret}"\n'
    )
    config.chmod(0o644)  # users' commands read it too: the secret is elsewhere
    nowhere = {k: "/dev/null" for k in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")}
    node = make_daemon(
        store=f"s3://{s3_bucket}/cfg",
        env={"STASIS_CONFIG": str(config), "AWS_EC2_METADATA_DISABLED": "true", **nowhere},
    )
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        assert name not in node.env
    job = _counter(node, "cfg")
    checkpoint = node.json("dump", job["job"], "--leave-running")["checkpoint"]
    assert s3.filesystem().exists(f"{s3_bucket}/cfg/{checkpoint}/manifest.json")
    node.cli("kill", job["job"])
    assert s3.secret_key not in (node.root / "daemon.log").read_text()


def test_a_refused_key_or_a_missing_bucket_fails_the_dump_and_the_job_runs_on(
    make_daemon: MakeDaemon, s3: S3Server, s3_bucket: str
) -> None:
    wrong = make_daemon(
        store=f"s3://{s3_bucket}/w", env=s3.env(AWS_SECRET_ACCESS_KEY="not-the-secret")
    )
    no_bucket = make_daemon(store="s3://no-such-bucket-for-stasis/w", env=s3.env())
    cases = [
        (wrong, ("access to", "denied", "check the S3 credentials")),
        (no_bucket, ("bucket no-such-bucket-for-stasis", "does not exist: create it")),
    ]
    for node, words in cases:
        job = _counter(node, "doomed")
        for mode in ([], ["--leave-running"]):
            err = one_line_error(node.cli("dump", job["job"], *mode, check=False), 1, *words)
            assert "not-the-secret" not in err
            before = last_number(node, job["job"])
            wait_for(lambda: last_number(node, job["job"]) >= before + 2, what="running on")
            assert node.job(job["job"])["state"] == "running"
        one_line_error(node.cli("checkpoints", check=False), 1, *words)
        node.cli("kill", job["job"])
    assert not s3.filesystem().exists("no-such-bucket-for-stasis")
    assert s3.filesystem().find(s3_bucket) == []
