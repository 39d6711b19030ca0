"""Policies edited in place (CLI, PATCH; only what is given changes, checked as a new one is,
nothing changed when refused), the floor on their periods, and the hook token of a webhook
policy: it runs that policy and nothing else. On SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tests.controlplane.conftest import SQLITE_ONLY, ControlPlane, said
from tests.controlplane.fakenode import FakeNode


@pytest.fixture
def strict(db_url: str, world_tmp: Path) -> Iterator[ControlPlane]:
    """A control plane with the default floor on policy periods (60 s)."""
    cp = ControlPlane(Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)), db_url)
    cp.start("--min-interval", "60")
    try:
        yield cp
    finally:
        cp.stop()


def policy(cp: ControlPlane, name: str) -> dict[str, Any]:
    """The policy as listed, less when it last ran (the control plane runs it meanwhile)."""
    (p,) = [p for p in cp.json("policies", "list") if p["name"] == name]
    return {k: v for k, v in p.items() if k != "last_run"}


def refused(cp: ControlPlane, *args: str) -> str:
    r = cp.cli(*args)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1, r.stderr  # one line
    return r.stderr.strip().removeprefix("stasis: error: ")


def test_a_policy_is_edited_in_place_and_checked_like_a_new_one(strict: ControlPlane) -> None:
    cp = strict
    assert refused(cp, "policies", "add", "fast", "--every", "30s", "--action", "checkpoint") == (
        "every 30 s is below this control plane's floor of 60 s "
        "between runs (serve --min-interval)"
    )
    cp.json(
        "policies",
        "add",
        "nightly",
        "--every",
        "1h",
        "--action",
        "checkpoint",
        "--label",
        "train-*",
        "--user",
        "alice",
    )
    before = policy(cp, "nightly")
    assert (before["every_s"], before["filters"], before["hook"]) == (
        3600,
        {"label": "train-*", "user": "alice"},
        False,
    )

    edited = cp.json("policies", "edit", "nightly", "--every", "2h")
    assert edited["every_s"] == 7200 and "hook_token" not in edited
    now = policy(cp, "nightly")
    assert {k: v for k, v in now.items() if k != "every_s"} == {
        k: v for k, v in before.items() if k != "every_s"
    }  # nothing else changed
    cp.json("policies", "edit", "nightly", "--label", "", "--min-size", "1G", "--stop")
    now = policy(cp, "nightly")
    assert now["filters"] == {"user": "alice", "min_rss_bytes": str(1 << 30)}
    assert now["stop"] is True and now["every_s"] == 7200 and now["action"] == "checkpoint"
    r = cp.cli("policies", "edit", "nightly", "--no-stop", "--min-size", "0")
    assert r.returncode == 0 and r.stdout == "policy nightly saved\n", r.stderr

    # Refused with one line, and nothing changed.
    kept = policy(cp, "nightly")
    for args, said in (
        (
            ("--every", "59s"),
            "every 59 s is below this control plane's floor of 60 s "
            "between runs (serve --min-interval)",
        ),
        (
            ("--action", "retain"),
            "retain needs keep >= 1 (the newest checkpoints each "
            "label keeps), older_than_s or completed",
        ),
        (("--on", "memory"), "a memory trigger needs threshold_pct, above 0 and at most " "100"),
        (
            ("--min-age", "x"),
            "argument --min-age: 'x' is not a duration (90s, 10m, 1h) "
            "(see `stasis controlplane policies edit --help`)",
        ),
        (
            (),
            "nothing to change in policy nightly: give what changes (--every, --on, "
            "--action, a filter, ...; `policies edit -h`)",
        ),
        (
            ("--on", "webhook", "--every", "2h"),
            "--every with --on webhook: a webhook "
            "policy runs when it is called or "
            "triggered, not every N",
        ),
    ):
        assert refused(cp, "policies", "edit", "nightly", *args) == said
    assert policy(cp, "nightly") == kept
    assert refused(cp, "policies", "edit", "nope", "--every", "2h") == "no policy nope"

    # A retention policy: keep changed to an age, the keep limit lifted.
    cp.json("policies", "add", "tidy", "--every", "1d", "--action", "retain", "--keep", "3")
    cp.json("policies", "edit", "tidy", "--keep", "0", "--older-than", "7d")
    tidy = policy(cp, "tidy")
    assert (tidy["keep"], tidy["older_than_s"]) == (None, 7 * 86400)
    assert refused(cp, "policies", "edit", "tidy", "--older-than", "0") == (
        "retain needs keep >= 1 (the newest checkpoints each label keeps), older_than_s or "
        "completed"
    )

    # Disabled: it stays, and does not run.
    cp.json("policies", "edit", "nightly", "--disable")
    assert policy(cp, "nightly")["enabled"] is False
    assert refused(cp, "policies", "run", "nightly") == (
        "policy nightly is disabled (`policies edit nightly --enable`)"
    )
    cp.json("policies", "edit", "nightly", "--enable")
    assert cp.json("policies", "run", "nightly") == {"name": "nightly", "queued": 0}

    # Made a webhook policy: it gets a hook token, printed once.
    r = cp.cli("policies", "edit", "nightly", "--on", "webhook")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "policy nightly saved"
    assert re.fullmatch(
        r"hook token \(shown once; it runs policy nightly only\): "
        r"stasis_hook_[A-Za-z0-9_-]{43}",
        lines[1],
    ), lines
    assert lines[2] == (
        f"  curl -fsS -X POST -H 'Authorization: Bearer "
        f"{lines[1].rsplit(' ', 1)[1]}' {cp.url}/api/v1/policies/nightly/run"
    )
    assert (policy(cp, "nightly")["every_s"], policy(cp, "nightly")["hook"]) == (0, True)
    assert "hook_token" not in cp.json("policies", "edit", "nightly", "--label", "x")  # has one
    edits = [e["message"] for e in cp.json("events") if e["kind"] == "policy-edited"]
    assert edits[0] == "policy nightly edited: every_s 3600 -> 7200", edits


def test_the_policy_api_edits_only_what_is_given_and_refuses_hostile_input(
    controlplane: ControlPlane,
) -> None:
    cp = controlplane
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    status, added = cp.call(
        "POST",
        "/api/v1/policies",
        cp.admin,
        {"name": "p", "every_s": 600, "action": "checkpoint", "filters": {"label": "a*"}},
    )
    assert status == 201 and added["hook"] is False
    status, got = cp.call(
        "PATCH", "/api/v1/policies/p", cp.admin, {"filters": {"user": "bob"}, "threshold_pct": None}
    )
    assert status == 200 and got["filters"] == {"label": "a*", "user": "bob"}, got
    status, got = cp.call(
        "PATCH", "/api/v1/policies/p", cp.admin, {"filters": {"label": None}, "every_s": 1200}
    )
    assert status == 200 and (got["filters"], got["every_s"]) == ({"user": "bob"}, 1200)
    kept = policy(cp, "p")
    for body, code, said in (
        ({"name": "q"}, 400, "bad request: name: Extra inputs are not permitted"),
        (
            {"hook_sha256": "0" * 64},
            400,
            "bad request: hook_sha256: Extra inputs are not " "permitted",
        ),
        (
            {"every_s": "1; DROP TABLE policies"},
            400,
            "bad request: every_s: Input should "
            "be a valid integer, unable to parse "
            "string as an integer",
        ),
        ({"every_s": None}, 400, "bad request: every_s: cannot be null"),
        (
            {"every_s": -1},
            400,
            "bad request: every_s: Input should be greater than or " "equal to 0",
        ),
        (
            {"filters": {"label' OR 1=1--": "x"}},
            400,
            "bad filter \"label' OR 1=1--\": "
            "cluster, node, label, user, "
            "partition, min_age_s, "
            "min_rss_bytes",
        ),
        (
            {"filters": {"min_age_s": "<script>"}},
            400,
            "filter min_age_s: a whole number, " "not '<script>'",
        ),
        ({"action": "rm -rf /"}, 400, None),
        (
            {"trigger": "drain", "action": "retain", "keep": 2},
            400,
            "a drain trigger takes the checkpoint or migrate action",
        ),
    ):
        status, answer = cp.call("PATCH", "/api/v1/policies/p", cp.admin, body)
        assert status == code, (body, status, answer)
        if said is not None:
            assert answer == {"error": said}, (body, answer)
    status, answer = cp.call("PATCH", "/api/v1/policies/p", cp.admin, raw=b"{not json")
    assert (status, answer) == (400, {"error": "bad request: body is not JSON"})
    status, answer = cp.call(
        "PATCH",
        "/api/v1/policies/p",
        cp.admin,
        raw=b'{"filters": {"label": "' + b"x" * (2 << 20) + b'"}}',
    )
    assert status == 413
    for token, code in ((hpc["token"], 403), (None, 401), ("stasis_wrong", 401)):
        status, answer = cp.call("PATCH", "/api/v1/policies/p", token, {"every_s": 3600})
        assert status == code, (token, status, answer)
    status, answer = cp.call(
        "PATCH", "/api/v1/policies/%3Cscript%3E'%20OR%201=1--", cp.admin, {"every_s": 3600}
    )
    assert (status, answer) == (404, {"error": "no policy <script>' OR 1=1--"})
    assert policy(cp, "p") == kept
    # The floor this control plane was served with (the tests' 1 s) holds in the API too.
    status, answer = cp.call("PATCH", "/api/v1/policies/p", cp.admin, {"every_s": 1})
    assert status == 200 and answer["every_s"] == 1


# SQLite only: the hook token's hash is compared in Python (editing, FOR UPDATE, on both).
@SQLITE_ONLY
def test_a_webhook_policy_runs_with_its_own_hook_token_and_nothing_else(
    controlplane: ControlPlane, db_url: str
) -> None:
    cp = controlplane
    hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    node = FakeNode(cp, hpc, "n1")
    node.register()
    node.heartbeat([{"job": "j1"}, {"job": "j2"}])
    r = cp.cli(
        "policies", "add", "one", "--on", "webhook", "--action", "checkpoint", "--label", "j1"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "policy one added"
    one = r.stdout.splitlines()[1].rsplit(" ", 1)[1]
    assert one.startswith("stasis_hook_")
    two = cp.json(
        "policies", "add", "two", "--on", "webhook", "--action", "checkpoint", "--label", "j2"
    )["hook_token"]
    assert "hook_token" not in cp.json(
        "policies", "add", "timed", "--every", "1h", "--action", "checkpoint"
    )  # not a webhook policy

    # Its own token runs it.
    assert cp.call("POST", "/api/v1/policies/one/run", one) == (200, {"name": "one", "queued": 1})
    # The timed policy is due at once: the server's policy loop may queue its own meanwhile.
    (queued,) = [a for a in cp.json("actions") if a["args"].get("policy") != "timed"]
    assert (queued["node"], queued["args"]["job"], queued["args"]["policy"]) == ("n1", "j1", "one")
    # Not another policy, whether it exists or not (the same answer: nothing learnt).
    for name in ("two", "timed", "nope"):
        assert cp.call("POST", f"/api/v1/policies/{name}/run", one) == (
            401,
            {"error": f"not the hook token of policy {name}"},
        )
    # Nothing else.
    said = (
        "this is the hook token of policy one: it runs that policy only (POST "
        "/api/v1/policies/one/run)"
    )
    for method, path, body in (
        ("GET", "/api/v1/policies", None),
        ("PATCH", "/api/v1/policies/one", {"every_s": 0}),
        ("POST", "/api/v1/policies/one/rotate-hook", None),
        ("DELETE", "/api/v1/policies/one", None),
        ("GET", "/api/v1/nodes", None),
        ("GET", "/api/v1/jobs", None),
        ("POST", "/api/v1/commands", {"kind": "checkpoint", "job": "j1"}),
        ("POST", "/api/v1/nodes/n1/commands/lease", {}),
        ("POST", "/api/v1/nodes/n1/heartbeat", {"jobs": []}),
        ("GET", "/metrics", None),
    ):
        status, answer = (
            cp.call(method, path, one, body) if path != "/metrics" else _metrics(cp, one)
        )
        assert (status, answer) == (403, {"error": said}), (method, path, status, answer)
    r = cp.cli("jobs", token=one)
    assert (r.returncode, r.stderr.strip()) == (2, f"stasis: error: {said}")
    # A wrong hook token: 401, here and anywhere.
    wrong = "stasis_hook_" + "A" * 43
    assert cp.call("POST", "/api/v1/policies/one/run", wrong) == (
        401,
        {"error": "not the hook token of policy one"},
    )
    assert cp.call("GET", "/api/v1/policies", wrong) == (401, {"error": "unknown token"})
    # The admin token runs it too (the job already has a command of it under way: none more).
    assert cp.call("POST", "/api/v1/policies/one/run", cp.admin) == (
        200,
        {"name": "one", "queued": 0},
    )
    assert cp.call("POST", "/api/v1/policies/two/run", two)[0] == 200

    # Rotated: the old token stops, the new one runs it.
    r = cp.cli("policies", "rotate-hook", "one")
    assert r.returncode == 0, r.stderr
    new = r.stdout.splitlines()[0].rsplit(" ", 1)[1]
    assert new.startswith("stasis_hook_") and new != one
    assert cp.call("POST", "/api/v1/policies/one/run", one)[0] == 401
    assert cp.call("POST", "/api/v1/policies/one/run", new)[0] == 200
    status, answer = cp.call("POST", "/api/v1/policies/nope/rotate-hook", cp.admin)
    assert (status, answer) == (404, {"error": "no policy nope"})
    status, answer = cp.call("POST", "/api/v1/policies/one/rotate-hook", hpc["token"])
    assert status == 403

    # Kept hashed: neither token is in the database, their SHA-256 are.
    engine = create_engine(db_url if "://" in db_url else f"sqlite:///{db_url}")
    try:
        with engine.begin() as conn:
            rows = [tuple(r) for r in conn.execute(text("SELECT * FROM policies"))]
    finally:
        engine.dispose()
    stored = repr(rows)
    assert new not in stored and two not in stored
    assert hashlib.sha256(new.encode()).hexdigest() in stored
    assert all("hook_sha256" not in p for p in cp.json("policies", "list"))


def _metrics(cp: ControlPlane, token: str) -> tuple[int, Any]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(cp.url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, said(json.loads(e.read()))
