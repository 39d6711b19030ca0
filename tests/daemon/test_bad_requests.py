"""Requests no client of ours sends, and commands that cannot start: a 4xx with one JSON error
line, never a job id for a job that never ran, never a 500 with a traceback."""

from __future__ import annotations

import json
import pwd
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon
from tests.daemon.test_bad_input import one_line_error


def raw(d: Daemon, method: str, path: str, body: bytes) -> tuple[int, bytes, bytes]:
    """One HTTP request as bytes on the daemon's socket: (status, headers, body)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(d.socket))
        s.sendall(
            f"{method} {path} HTTP/1.0\r\nHost: stasis\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head, rest


def refused(d: Daemon, method: str, path: str, body: bytes, status: int, *words: str) -> str:
    got, head, answer = raw(d, method, path, body)
    assert got == status, (got, answer[:300])
    error = json.loads(answer)["error"]
    assert error["type"] == "UsageError", error
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    for w in words:
        assert w in error["message"], error["message"]
    return str(error["message"])


def _run_body(**fields: Any) -> bytes:
    return json.dumps({"command": ["sleep", "30"], "cwd": "/", **fields}).encode()


def _job_rows(d: Daemon) -> int:
    return len(d.json("ps"))


@pytest.mark.parametrize(
    "fields",
    [
        {"command": ["sleep\0", "30"]},
        {"command": ["sleep", "3\x000"]},
        {"env": {"API_TOKEN": "a\0b"}},
        {"env": {"API\0TOKEN": "ab"}},
        {"cwd": "/t\0mp"},
        {"label": "train\0x"},
        {"log": "/tmp/x\0.log"},
        {"user": "ro\0ot"},
    ],
    ids=["command", "argument", "env-value", "env-name", "cwd", "label", "log", "user"],
)
def test_nul_is_refused_and_nothing_starts(daemon: Daemon, fields: dict[str, Any]) -> None:
    rows = _job_rows(daemon)
    jobs_dirs = len(list((daemon.state_dir / "jobs").iterdir()))
    refused(daemon, "POST", "/jobs", _run_body(**fields), 400, "NUL")
    assert _job_rows(daemon) == rows
    assert len(list((daemon.state_dir / "jobs").iterdir())) == jobs_dirs


def test_nul_in_other_routes(daemon: Daemon) -> None:
    refused(daemon, "POST", "/restore", json.dumps({"label": "a\0b"}).encode(), 400, "NUL")
    refused(daemon, "POST", "/slurm/jobs", json.dumps({"job_id": "1\0"}).encode(), 400, "NUL")


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"command": ' + b"[" * 100_000 + b"]" * 100_000 + b', "cwd": "/"}',
        b'{"command": ["true"], "cwd": "/", "env": '
        + b'{"a": ' * 50_000
        + b"1"
        + b"}" * 50_000
        + b"}",
    ],
    ids=["array", "in-a-field", "objects"],
)
def test_deeply_nested_json_is_a_bad_request(daemon: Daemon, body: bytes) -> None:
    rows = _job_rows(daemon)
    refused(daemon, "POST", "/jobs", body, 400, "nested too deeply")
    assert _job_rows(daemon) == rows
    assert "Traceback" not in (daemon.root / "daemon.log").read_text()


def test_garbage_bodies(daemon: Daemon) -> None:
    refused(daemon, "POST", "/jobs", b"\xff\xfe not utf-8", 400, "not JSON")
    refused(daemon, "POST", "/jobs", b'{"command": ', 400, "not JSON")
    refused(daemon, "POST", "/jobs", b'["sleep", "1"]', 400, "bad request")
    refused(daemon, "POST", "/no/such/route", b"{}", 404)
    assert "Traceback" not in (daemon.root / "daemon.log").read_text()


def test_oversized_body_is_refused(daemon: Daemon) -> None:
    rows = _job_rows(daemon)
    big = _run_body(env={"BIG": "x" * (2 << 20)})
    refused(daemon, "POST", "/jobs", big, 413, "413")
    assert _job_rows(daemon) == rows
    daemon.cli("ps")  # and nothing else is disturbed


def _no_new_job(
    d: Daemon, *args: str, words: tuple[str, ...] = (), user: str | None = None
) -> None:
    rows = _job_rows(d)
    one_line_error(d.cli("run", "--", *args, check=False, user=user), 2, "cannot start", *words)
    assert _job_rows(d) == rows


def test_commands_that_cannot_start_are_errors_not_jobs(
    daemon: Daemon, world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    _no_new_job(daemon, "no-such-program-on-any-path", words=("no-such-program-on-any-path",))
    _no_new_job(daemon, str(world_tmp), words=("directory",))
    plain = world_tmp / "plain.txt"
    plain.write_text("echo not executable\n")
    _no_new_job(daemon, str(plain), words=("not an executable file",))
    # A script whose interpreter is missing: execve says "No such file", about the script.
    script = world_tmp / "script.sh"
    script.write_text("#!/no/such/interpreter\necho hi\n")
    script.chmod(0o755)
    _no_new_job(daemon, str(script), words=("/no/such/interpreter",))
    # A real program whose loader (ELF PT_INTERP) does not exist on this node.
    true = Path(shutil.which("true") or "/bin/true").read_bytes()
    loader = b"/lib64/ld-linux-x86-64.so.2"
    assert loader in true
    elf = world_tmp / "no-loader"
    elf.write_bytes(true.replace(loader, b"/lib64/ld-linux-x86-64.so.X"))
    elf.chmod(0o755)
    _no_new_job(daemon, str(elf), words=("ld-linux-x86-64.so.X",))
    # Root's own program: the ordinary user may not run it, and is told so.
    private = world_tmp / "roots-only"
    private.write_text("#!/bin/sh\necho root\n")
    private.chmod(0o700)
    _no_new_job(daemon, str(private), words=("not an executable file",), user=test_user.pw_name)
    # And a script whose interpreter does exist still starts.
    ok = world_tmp / "ok.sh"
    ok.write_text("#!/bin/sh\nexit 0\n")
    ok.chmod(0o755)
    assert daemon.json("run", "--", str(ok))["pid"] > 0
