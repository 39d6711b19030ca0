"""The `stasis` command line as scripts and people use it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import STASIS, Daemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error


def test_help_lists_every_command() -> None:
    out = subprocess.run([STASIS, "--help"], capture_output=True, text=True, check=True).stdout
    for name in ("run", "dump", "restore", "ps", "checkpoints", "kill", "logs", "check", "daemon"):
        assert f"  {name} " in out or f"  {name}\n" in out


def test_bad_usage_exits_2(daemon: Daemon) -> None:
    one_line_error(daemon.cli("run", "--env", "NOEQUALS", "--", "true", check=False), 2, "--env")
    one_line_error(daemon.cli("restore", check=False), 2, "CHECKPOINT")
    one_line_error(daemon.cli("restore", "x", "--label", "y", check=False), 2)
    one_line_error(daemon.cli("dump", check=False), 2, "JOB")
    one_line_error(daemon.cli("ps", input_env={"STASIS_KEEP": "many"}, check=False), 2, "keep")


def test_everything_after_the_command_is_the_commands(daemon: Daemon) -> None:
    job = daemon.json("run", "--", "sh", "-c", 'echo "got: $*"', "sh", "--json", "--label", "x")
    wait_for(lambda: "got: --json --label x" in daemon.log_of(job["job"]), what="the echo")
    assert job["label"] == job["job"]  # that --label was the command's, not stasis'
    plain = json.loads(daemon.cli("run", "--json", "sh", "-c", "echo without dashes").stdout)
    wait_for(lambda: "without dashes" in daemon.log_of(plain["job"]), what="the echo")
    one_line_error(daemon.cli("run", "--label", "y", check=False), 2, "COMMAND")
    one_line_error(daemon.cli("no-such-command", check=False), 2, "no-such-command")


def test_json_shapes(daemon: Daemon, tmp_path: object) -> None:
    job = daemon.json(
        "run",
        "--label",
        "shapes",
        "--env",
        "GREETING=hi",
        "--",
        "sh",
        "-c",
        'echo "$GREETING from $PWD"; sleep 30',
    )
    assert set(job) == {"job", "pid", "label"} and job["label"] == "shapes"
    wait_for(lambda: "hi from" in daemon.log_of(job["job"]), what="output")
    rows = daemon.json("ps")
    row = next(r for r in rows if r["job"] == job["job"])
    assert set(row) == {
        "job",
        "pid",
        "state",
        "label",
        "exit_code",
        "command",
        "private_tmp",
        "frozen",
    }
    assert row["state"] == "running" and row["command"][:2] == ["sh", "-c"]
    assert row["private_tmp"] is False and row["frozen"] is False
    cp = daemon.json("dump", job["job"])
    assert set(cp) == {
        "checkpoint",
        "label",
        "job",
        "size_bytes",
        "duration_s",
        "elapsed_s",
        "staged",
        "notes",
    }
    assert 0 < cp["duration_s"] <= cp["elapsed_s"]  # CRIU's part of the daemon's whole answer
    listed = daemon.json("checkpoints", "--label", "shapes")
    assert [c["id"] for c in listed] == [cp["checkpoint"]]
    restored = daemon.json("restore", "--label", "shapes")
    assert {"job", "pid", "checkpoint"} <= set(restored)
    assert 0 < restored["duration_s"] <= restored["elapsed_s"]
    killed = daemon.json("kill", restored["job"])
    assert killed["state"] == "exited"


def test_progress_on_a_terminal_only(daemon: Daemon) -> None:
    job = daemon.run(*workload("memhold.py", 192))
    wait_for(lambda: "ready" in daemon.log_of(job["job"]), 60, what="memory")
    # `script` gives the command a pseudo-terminal, as a person at a shell would have, and a
    # terminal type that draws (under TERM=dumb, as a fresh root or a CI runner may have, rich
    # rightly draws no bar).
    env_args = " ".join(
        ["TERM=xterm", *(f"{k}={v}" for k, v in daemon.env.items() if k.startswith("STASIS_"))]
    )
    tty = subprocess.run(
        [
            "script",
            "-qec",
            f"env {env_args} {STASIS} dump --leave-running {job['job']}",
            "/dev/null",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tty.returncode == 0, tty.stdout
    assert "dumping" in tty.stdout and "MB" in tty.stdout  # bytes, rate and time left drawn
    piped = daemon.cli("dump", "--leave-running", "--json", job["job"])
    cp = json.loads(piped.stdout)  # nothing but the JSON answer when piped
    assert "dumping" not in piped.stdout + piped.stderr
    daemon.cli("kill", job["job"])
    tty = subprocess.run(
        ["script", "-qec", f"env {env_args} {STASIS} restore {cp['checkpoint']}", "/dev/null"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tty.returncode == 0, tty.stdout
    assert "restoring" in tty.stdout and "MB" in tty.stdout
    restored = next(
        j for j in daemon.json("ps") if j["state"] == "restored" and j["label"] == job["label"]
    )
    daemon.cli("kill", restored["job"])


def test_check_reports_a_ready_node(daemon: Daemon) -> None:
    report = daemon.json("check")
    assert report["ok"] is True, report["problems"]
    assert report["criu_version"].startswith("4.2")
    assert report["features"]["mem_track"] is False
    assert any("incremental" in n for n in report["notes"])
    missing = daemon.cli("check", input_env={"STASIS_CRIU": "/nonexistent/criu"}, check=False)
    assert missing.returncode == 1 and "problem" in missing.stdout


def test_check_says_not_ready_while_the_node_daemon_does_not_answer(
    daemon: Daemon, tmp_path: Path
) -> None:
    # A readiness probe (the Kubernetes agent's) or a site's monitoring: no daemon, no
    # protection, whatever CRIU can do.
    gone = daemon.cli(
        "check", input_env={"STASIS_SOCKET": str(tmp_path / "none.sock")}, check=False
    )
    assert gone.returncode == 1, gone.stdout
    assert gone.stdout.rstrip().endswith("NOT READY")
    assert "not ready: cannot reach the stasis daemon" in gone.stdout
