"""What a job keeps on its node moves with it (issue 29), between two real nodes of a local Slurm
cluster that share nothing but what a site shares (the cluster's directory as the shared file
system, the home directories, the installed software): each node has its own /tmp, /var/tmp,
/dev/shm and /run, its own host name and network address.

Each workload is checkpointed on n1 and resumes on n2 with its state, proved by a count that
goes on (not an exit code):
- by Slurm: n1 is drained (`stasis slurm drain n1`), its protected jobs checkpointed and requeued,
  and Slurm starts them on n2, the only node left, where they are restored. All five workloads
  move in one drain: a Python program with a named tempfile it keeps open under /tmp, one with a
  unix socket in /tmp, one with a SQLite database in /dev/shm, PostgreSQL with its socket in
  /run/postgresql, and a Java program (its /tmp/hsperfdata_<user>/<pid>).
- by the control plane: `stasis controlplane migrate JOB --to n2` of two jobs the node daemons
  run: the Java program, and one Python job holding a tempfile in /tmp and in /var/tmp, a unix
  socket in /tmp and a SQLite database in /dev/shm at once (each kind once more, in one move,
  to keep the suite short).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from stasis.dev import slurmcluster
from stasis.poll import poll
from tests.conftest import STASIS, TEST_USER, WORKLOADS, wait_for
from tests.controlplane.conftest import ControlPlane
from tests.e2e.conftest import Cluster, until
from tests.e2e.cpsite import joined_site

INTERVAL_S = 0.5
MOVE_TIMEOUT_S = 120


@dataclass
class Site:
    c: Cluster
    cp: ControlPlane
    pg_bin: Path
    java_classes: Path


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    with joined_site("nodelocal") as (c, cp):
        for node in ("n1", "n2"):
            # What Debian's postgresql package makes on every node at boot (tmpfiles.d): the
            # server's socket directory, on the node's own /run.
            c.on(
                node,
                "install",
                "-d",
                "-o",
                TEST_USER,
                "-g",
                TEST_USER,
                "-m",
                "2775",
                "/run/postgresql",
            )
        classes = c.work / "java"
        classes.mkdir()
        subprocess.run(
            ["javac", "-d", str(classes), str(WORKLOADS / "Counter.java")],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.chmod(classes, 0o755)
        shutil.copy(WORKLOADS / "nodelocal.py", c.work / "nodelocal.py")
        pg = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
        assert pg, "PostgreSQL is not installed (scripts/install-test-apps.sh)"
        yield Site(c, cp, Path(pg[-1]).parent, classes)


def counts(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^count (\d+)$", text, re.M)]


def continued(text: str, before: int) -> str | None:
    """Why the counts in `text` do not go on unbroken past `before` (None when they do)."""
    seen = counts(text)
    if "MISMATCH" in text:
        return "its stores disagreed: " + text[text.index("MISMATCH") :][:200]
    if not seen or seen[-1] < before + 3:
        return f"it counted no further than {seen[-1:] or 'nothing'} (had {before})"
    if seen != list(range(1, seen[-1] + 1)):
        return f"its count broke: {seen[:3]}...{seen[-3:]} is not 1..{seen[-1]} once each"
    return None


# -- the nodes share nothing but the site's shared files ----------------------------------------


def test_each_node_has_its_own_tmp_var_tmp_dev_shm_run_host_name_and_address(site: Site) -> None:
    c = site.c
    mark = f"stasis-sep-{os.urandom(4).hex()}"
    made = [f"{d}/{mark}" for d in ("/tmp", "/var/tmp", "/dev/shm", "/run")]
    c.on("n1", "touch", *made)
    try:
        assert c.on("n1", "ls", *made).returncode == 0
        gone = c.on("n2", "ls", *made, check=False)
        assert gone.returncode != 0 and gone.stderr.count("No such file") == len(made), (
            gone.stdout + gone.stderr
        )
        assert not [p for p in made if os.path.lexists(p)]  # nor on this machine
        # The private directories are fresh tmpfs with the modes of a booted host.
        for d, mode in slurmcluster.PRIVATE_DIRS:
            st = c.on("n2", "stat", "-f", "-c", "%T", d).stdout.strip()
            assert st == "tmpfs", (d, st)
            assert c.on("n2", "stat", "-c", "%a %U", d).stdout.split() == [f"{mode:o}", "root"]
    finally:
        c.on("n1", "rm", "-f", *made, check=False)
    # What a site shares is there on both: the cluster's directory (here under /tmp too).
    shared = c.work / f"{mark}.shared"
    c.on("n1", "touch", str(shared))
    assert shared.exists() and c.on("n2", "ls", str(shared)).returncode == 0
    assert {n: c.on(n, "hostname").stdout.strip() for n in ("n1", "n2")} == {"n1": "n1", "n2": "n2"}
    addrs = {
        n: c.on(n, "ip", "-4", "-o", "addr", "show", "eth0").stdout.split()[3] for n in ("n1", "n2")
    }
    assert addrs["n1"] != addrs["n2"]


# -- the workloads ----------------------------------------------------------------------------


@dataclass
class Work:
    """One workload: its command, and after the move, why its state did not come along."""

    name: str
    command: list[str]
    job: str = ""
    before: int = 0
    pg_port: int = 0
    pg_before: tuple[str, str, int] | None = None
    notes: list[str] = field(default_factory=list)


def _python(site: Site, kinds: str, tag: str) -> list[str]:
    return [
        "/usr/bin/python3",
        "-u",
        str(site.c.work / "nodelocal.py"),
        kinds,
        tag,
        str(INTERVAL_S),
    ]


def _java(site: Site) -> list[str]:
    return [
        "/usr/bin/java",
        "-Xmx48m",
        "-Xss512k",
        "-XX:+UseSerialGC",
        "-XX:TieredStopAtLevel=1",
        "-cp",
        str(site.java_classes),
        "Counter",
        str(INTERVAL_S),
    ]


def _psql(site: Site, node: str, port: int, query: str) -> str:
    r = site.c.on(
        node,
        str(site.pg_bin / "psql"),
        "-X",
        "-A",
        "-t",
        "-h",
        "/run/postgresql",
        "-p",
        str(port),
        "-U",
        "postgres",
        "-d",
        "postgres",
        "-v",
        "ON_ERROR_STOP=1",
        "-c",
        query,
        user=TEST_USER,
        check=False,
    )
    if r.returncode != 0:
        raise AssertionError(f"psql on {node}: {r.stderr.strip()}")
    return r.stdout.strip()


PG_STATE = (
    "SELECT pg_postmaster_start_time(), "
    "(SELECT md5(string_agg(word, ',' ORDER BY n)) FROM t), nextval('s')"
)


def _pg_state(site: Site, node: str, port: int) -> tuple[str, str, int]:
    started, digest, seq = _psql(site, node, port, PG_STATE).split("|")
    return started, digest, int(seq)


def _postgres(site: Site, tag: str) -> tuple[list[str], int]:
    data = site.c.work / f"pg-{tag}"
    r = subprocess.run(
        [
            "runuser",
            "-u",
            TEST_USER,
            "--",
            str(site.pg_bin / "initdb"),
            "-D",
            str(data),
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=site.c.work,
    )
    assert r.returncode == 0, r.stderr
    port = 20000 + int.from_bytes(os.urandom(2), "big") % 20000
    # Its only socket in /run/postgresql (no TCP), shared memory SysV (in the job's own IPC
    # namespace), as small as PostgreSQL goes.
    return [
        str(site.pg_bin / "postgres"),
        "-D",
        str(data),
        "-k",
        "/run/postgresql",
        "-p",
        str(port),
        "-c",
        "listen_addresses=",
        "-c",
        "shared_memory_type=sysv",
        "-c",
        "dynamic_shared_memory_type=sysv",
        "-c",
        "shared_buffers=8MB",
        "-c",
        "max_connections=10",
        "-c",
        "fsync=off",
    ], port


def _pg_ready(site: Site, w: Work, node: str) -> bool:
    try:
        _psql(site, node, w.pg_port, "CREATE TABLE IF NOT EXISTS t (n int, word text)")
    except AssertionError:
        return False
    return True


def _pg_fill(site: Site, w: Work, node: str) -> None:
    _psql(
        site,
        node,
        w.pg_port,
        "INSERT INTO t SELECT g, md5(g::text) " "FROM generate_series(1, 500) g",
    )
    _psql(site, node, w.pg_port, "CREATE SEQUENCE s")
    for _ in range(3):
        _psql(site, node, w.pg_port, "SELECT nextval('s')")
    w.pg_before = _pg_state(site, node, w.pg_port)


def _pg_moved(site: Site, w: Work, node: str) -> str | None:
    """Why the server on `node` is not the one from before with its data (None when it is)."""
    assert w.pg_before is not None
    try:
        after = _pg_state(site, node, w.pg_port)
    except AssertionError as e:
        return str(e)
    started, digest, seq = w.pg_before
    if after[0] != started:
        return f"a server started afresh at {after[0]}, not the one started at {started}"
    if after[1] != digest or after[2] != seq + 1:
        return f"its data or sequence did not come along: {after} after {w.pg_before}"
    _psql(site, node, w.pg_port, "INSERT INTO t VALUES (501, 'after the move')")
    if _psql(site, node, w.pg_port, "SELECT count(*) FROM t") != "501":
        return "a write after the move was not read back"
    return None


# -- by Slurm: n1 drained, its jobs checkpointed, requeued and restored on n2 -------------------


def _host(c: Cluster, job: str) -> str:
    return c.job(job).get("BatchHost", "")


@pytest.fixture(scope="module")
def requeued(site: Site) -> dict[str, Work]:
    """Every workload as an opted-in batch job on n1, then n1 drained: each job's outcome."""
    c = site.c
    tag = f"rq{os.urandom(3).hex()}"
    pg_command, pg_port = _postgres(site, tag)
    works = {
        "tempfile": Work("tempfile", _python(site, "tmp", f"{tag}-tmp")),
        "unix-socket": Work("unix-socket", _python(site, "sock", f"{tag}-sock")),
        "sqlite-dev-shm": Work("sqlite-dev-shm", _python(site, "shm", f"{tag}-shm")),
        "postgresql": Work("postgresql", pg_command, pg_port=pg_port),
        "java": Work("java", _java(site)),
    }
    # Only n1 takes them; n2 back in service once they run there.
    c.run("scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=nodelocal-first")
    try:
        for w in works.values():
            script = c.script(
                f"{tag}-{w.name}",
                "exec " + " ".join(w.command),
                f"--output={c.work}/{tag}-{w.name}-%j.out",
                f"--export=STASIS_ENABLE=1,STASIS_CHECKPOINT={tag}-{w.name}",
            )
            w.job = c.sbatch(script, user=TEST_USER)
        for w in works.values():
            c.wait_state(w.job, ("RUNNING",), 60)
            assert _host(c, w.job) == "n1"
    finally:
        c.run("scontrol", "update", "NodeName=n2", "State=RESUME")
    pg = works["postgresql"]
    until(lambda: _pg_ready(site, pg, "n1"), 60, "PostgreSQL answering on n1")
    _pg_fill(site, pg, "n1")
    for w in works.values():
        if w is not pg:
            until(lambda: len(counts(c.output(w.job))) >= 3, 60, f"{w.name} counting on n1")
    try:
        drained = json.loads(
            c.on("n2", STASIS, "slurm", "drain", "n1", "--reason", "nodelocal", "--json").stdout
        )
        assert sorted(r["job"] for r in drained["requeued"]) == sorted(
            w.job for w in works.values()
        ), drained
        for w in works.values():
            w.before = max(counts(c.output(w.job)), default=0)

        # Each restored on n2, or given up on (the test of each says why).
        poll(
            lambda: all(
                _host(c, w.job) == "n2" and "stasis: restored checkpoint" in c.output(w.job)
                for w in works.values()
            ),
            MOVE_TIMEOUT_S,
            1.0,
        )
    finally:
        c.run("scontrol", "update", "NodeName=n1", "State=RESUME", check=False)
    return works


def _slurm_outcome(site: Site, w: Work) -> str | None:
    c = site.c
    out = c.output(w.job)
    if _host(c, w.job) != "n2" or "stasis: restored checkpoint" not in out:
        lines = [line for line in out.splitlines() if line.startswith("stasis")]
        return (
            f"job {w.job} on {_host(c, w.job)!r} ({c.state(w.job)}) was not restored on n2:"
            f" {lines[-3:]}"
        )
    if w.name == "postgresql":
        return _pg_moved(site, w, "n2")
    return continued(out, w.before)


@pytest.mark.parametrize(
    "name", ["tempfile", "unix-socket", "sqlite-dev-shm", "postgresql", "java"]
)
def test_a_job_requeued_by_slurm_resumes_on_another_node_with_its_node_local_state(
    site: Site, requeued: dict[str, Work], name: str
) -> None:
    w = requeued[name]
    try:
        if name != "postgresql":  # (its check writes: once)
            poll(lambda: _slurm_outcome(site, w) is None, 20, 0.5)  # a slow machine's counts
        why = _slurm_outcome(site, w)
        assert why is None, why
    finally:
        site.c.run("scancel", w.job, check=False)


# -- by the control plane: `stasis controlplane migrate JOB --to n2` ---------------------------


def _as_user(
    site: Site, node: str, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """`stasis ARGS` as the test user on `node`: through the node daemon's socket (the node's
    config holds the control plane's token: root's only)."""
    return site.c.on(
        node,
        "env",
        "STASIS_CONFIG=",
        f"STASIS_SOCKET={site.c.lay.node_socket(node)}",
        STASIS,
        *args,
        user=TEST_USER,
        check=check,
    )


@pytest.fixture(scope="module")
def migrated(site: Site) -> dict[str, Work]:
    """The Java program and a Python job holding every kind of node-local file, run by n1's
    daemon, then migrated to n2 by the control plane: each job's outcome (its log's path)."""
    c, cp = site.c, site.cp
    tag = f"mg{os.urandom(3).hex()}"
    works = {
        "java": Work("java", _java(site)),
        "all-kinds": Work("all-kinds", _python(site, "tmp,vartmp,sock,shm", tag)),
    }
    for w in works.values():
        log = c.work / f"{tag}-{w.name}.log"
        ran = json.loads(
            _as_user(
                site,
                "n1",
                "run",
                "--json",
                "--label",
                f"{tag}-{w.name}",
                "--cwd",
                str(c.work),
                "--log",
                str(log),
                "--",
                *w.command,
            ).stdout
        )
        w.job = ran["job"]
        w.notes.append(str(log))
    for w in works.values():
        until(
            lambda: len(counts(Path(w.notes[0]).read_text())) >= 3, 60, f"{w.name} counting on n1"
        )
    wait_for(
        lambda: {w.job for w in works.values()} <= {j["job"] for j in cp.json("jobs")},
        30,
        "the jobs in the control plane",
    )
    for w in works.values():
        moved = cp.cli("migrate", w.job, "--to", "n2", "--json")
        w.before = max(counts(Path(w.notes[0]).read_text()), default=0)
        if moved.returncode != 0:
            w.notes.append(f"migrate failed: {moved.stderr.strip()}")
            continue
        answer = json.loads(moved.stdout)
        w.notes.append(answer["job"])
    poll(
        lambda: all(
            continued(Path(w.notes[0]).read_text(), w.before) is None
            for w in works.values()
            if len(w.notes) == 2 and not w.notes[1].startswith("migrate failed")
        ),
        30,
        1.0,
    )
    return works


@pytest.mark.parametrize("name", ["java", "all-kinds"])
def test_a_job_migrated_by_the_control_plane_resumes_on_another_node_with_its_node_local_state(
    site: Site, migrated: dict[str, Work], name: str
) -> None:
    w = migrated[name]
    log, moved = w.notes[0], w.notes[1]
    try:
        assert not moved.startswith("migrate failed"), moved
        jobs = {j["job"]: j["node"] for j in site.cp.json("jobs")}
        assert jobs.get(moved) == "n2", jobs
        poll(lambda: continued(Path(log).read_text(), w.before) is None, 20, 0.5)
        why = continued(Path(log).read_text(), w.before)
        assert why is None, why
    finally:
        if not moved.startswith("migrate failed"):
            _as_user(site, "n2", "kill", moved, check=False)
        _as_user(site, "n1", "kill", w.job, check=False)
