"""The comparison of what a checkpoint recorded with the restoring node, fact by fact, and the
facts gathered from real processes and files. What a test cannot change on this machine (its
architecture, CPU, CRIU, kernel, its users) is changed on the recorded side: a manifest from
another node is exactly that."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stasis import __version__, wire
from stasis.engine import Owner, nodefacts
from stasis.engine.nodefacts import FileState, Node
from stasis.errors import IncompatibleNodeError

HERE = Node(
    arch="x86_64",
    cpu_model="AMD EPYC",
    cpu_flags=("avx", "avx2", "fpu", "sse2"),
    kernel="6.18.0",
    criu_version="4.2.1",
    stasis_version="0.1.0",
)


def recorded(**changes: Any) -> wire.RestoreFacts:
    facts = wire.RestoreFacts(
        arch="x86_64",
        cpu_model="AMD EPYC",
        cpu_flags=["avx", "avx2", "fpu", "sse2"],
        kernel="6.18.0",
        criu_version="4.2.1",
        stasis_version="0.1.0",
        user="root",
        uid=0,
        files=[],
    )
    facts.update(changes)  # type: ignore[typeddict-item]
    return facts


def verdicts(findings: list[wire.CompatFact]) -> dict[str, str]:
    return {f["what"]: f["verdict"] for f in findings}


def refused(facts: wire.RestoreFacts, files: dict[str, FileState] | None = None) -> str:
    line = nodefacts.refusal("20261130T001512Z-3f9a1c", nodefacts.compare(facts, HERE, files))
    assert line is not None
    return line


def test_the_same_node_is_ok_throughout() -> None:
    findings = nodefacts.compare(recorded(), HERE, {})
    assert verdicts(findings) == {
        "architecture": "ok",
        "CPU flags": "ok",
        "CRIU": "ok",
        "kernel": "ok",
        "stasis": "ok",
        "user": "ok",
    }
    assert nodefacts.refusal("20261130T001512Z-3f9a1c", findings) is None


def test_another_architecture_refuses() -> None:
    line = refused(recorded(arch="aarch64", cpu_flags=["fp", "asimd"]))
    assert line.startswith(
        "cannot restore checkpoint 20261130T001512Z-3f9a1c on this node: "
        "this node is x86_64, the checkpoint was dumped on aarch64"
    )
    # arm64's Features are all instructions: every missing one refuses too.
    assert "this CPU lacks asimd, fp" in line


def test_missing_instruction_flags_refuse_machine_flags_are_notes() -> None:
    findings = nodefacts.compare(
        recorded(
            cpu_flags=["avx", "avx2", "avx512bw", "avx512f", "fpu", "hypervisor", "pti", "sse2"]
        ),
        HERE,
        {},
    )
    assert verdicts(findings)["CPU flags"] == "refuses"
    assert verdicts(findings)["CPU flags (machine)"] == "note"
    line = nodefacts.refusal("20261130T001512Z-3f9a1c", findings)
    assert (
        line is not None
        and "this CPU lacks avx512bw, avx512f (the dumping node's had them" in line
        and "hypervisor" not in line
    )
    # More flags here than there is fine; another model is a note.
    assert verdicts(
        nodefacts.compare(recorded(cpu_flags=["fpu"], cpu_model="Intel Xeon"), HERE, {})
    ) == {
        "architecture": "ok",
        "CPU flags": "ok",
        "CPU model": "note",
        "CRIU": "ok",
        "kernel": "ok",
        "stasis": "ok",
        "user": "ok",
    }


def test_an_older_criu_refuses_a_newer_one_or_another_kernel_is_a_note() -> None:
    assert "CRIU 4.2.1 here is older than CRIU 4.10, which dumped it" in refused(
        recorded(criu_version="4.10")
    )
    notes = nodefacts.compare(
        recorded(criu_version="4.1", kernel="6.1.0-28-amd64", stasis_version="0.0.9"), HERE, {}
    )
    assert verdicts(notes) == {
        "architecture": "ok",
        "CPU flags": "ok",
        "CRIU": "note",
        "kernel": "note",
        "stasis": "note",
        "user": "ok",
    }
    assert nodefacts.refusal("20261130T001512Z-3f9a1c", notes) is None
    assert any("dumped on 6.1.0-28-amd64" in n for n in nodefacts.notes(notes))


def test_a_user_missing_here_or_under_another_uid_refuses() -> None:
    line = refused(recorded(user="nobody-such-user", uid=4242))
    assert "user nobody-such-user does not exist on this node" in line
    root_uid = pwd.getpwnam("root").pw_uid
    line = refused(recorded(user="root", uid=4242))
    assert f"user root is uid {root_uid} on this node, was uid 4242" in line


def _file(
    path: str,
    access: str,
    size: int = 100,
    mode: int = 0o644,
    mtime_ns: int = 1_700_000_000_000_000_000,
) -> wire.OpenFile:
    return wire.OpenFile(path=path, size_bytes=size, mtime_ns=mtime_ns, mode=mode, access=access)  # type: ignore[typeddict-item]


def _now(
    path: str, size: int = 100, mode: int = 0o644, mtime_ns: int = 1_700_000_000_000_000_000
) -> FileState:
    return FileState(path, regular=True, size_bytes=size, mode=mode, mtime_ns=mtime_ns)


@pytest.mark.parametrize(
    ("access", "now", "verdict", "words"),
    [
        ("read", _now("/f"), "ok", ""),
        (
            "read",
            FileState("/f", error="No such file or directory"),
            "refuses",
            "/f cannot be opened here (No such file or directory)",
        ),
        ("read", FileState("/f", regular=False), "refuses", "/f is no longer a regular file"),
        ("write", _now("/f", size=90), "refuses", "/f is 90 bytes, was 100 when dumped"),
        ("read", _now("/f", size=101), "refuses", "/f is 101 bytes, was 100 when dumped"),
        ("append", _now("/f", size=250), "note", "the job only appends to it"),
        ("read", _now("/f", mode=0o600), "refuses", "/f has mode 0600, was 0644 when dumped"),
        (
            "read",
            _now("/f", mtime_ns=1_700_000_000_000_000_001),
            "refuses",
            "/f was modified since the dump",
        ),
        (
            "write",
            _now("/f", mtime_ns=1_700_000_000_000_000_001),
            "note",
            "may have written it itself",
        ),
        ("append", _now("/f", mtime_ns=1_700_000_000_000_000_001), "note", "written it itself"),
    ],
)
def test_open_files(access: str, now: FileState, verdict: str, words: str) -> None:
    findings = nodefacts.compare(recorded(files=[_file("/f", access)]), HERE, {"/f": now})
    found = next(f for f in findings if f["what"] == "file /f")
    assert found["verdict"] == verdict and words in found["why"], found


def test_files_a_restore_repoints_or_that_were_not_recorded() -> None:
    facts = recorded(files=[_file("/var/log/job.log", "write")])
    gone = {"/var/log/job.log": FileState("/var/log/job.log", error="No such file")}
    assert "file /var/log/job.log" not in verdicts(
        nodefacts.compare(facts, HERE, gone, skip=["/var/log/job.log"])
    )
    assert verdicts(nodefacts.compare(facts, HERE, gone))["file /var/log/job.log"] == "refuses"
    unknown = verdicts(nodefacts.compare(recorded(files=None), HERE, {}))
    assert unknown["open files"] == "note"


def test_this_node_and_the_files_a_process_holds(tmp_path: Path) -> None:
    read, append, rw = tmp_path / "r", tmp_path / "a", tmp_path / "w"
    for path in (read, append, rw):
        path.write_bytes(b"x" * 7)
    os.chmod(read, 0o600)
    code = (
        "import os, sys, time; "
        f"fds = [os.open({str(read)!r}, os.O_RDONLY), "
        f"os.open({str(append)!r}, os.O_WRONLY | os.O_APPEND), "
        f"os.open({str(rw)!r}, os.O_RDONLY), os.open({str(rw)!r}, os.O_WRONLY | os.O_APPEND)]; "
        "print('ready', flush=True); time.sleep(30)"
    )
    log = tmp_path / "log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=out)
    try:
        while b"ready" not in log.read_bytes():
            assert proc.poll() is None
        got = nodefacts.open_files(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    st = read.stat()
    assert got == [
        wire.OpenFile(
            path=str(append),
            size_bytes=7,
            mtime_ns=append.stat().st_mtime_ns,
            mode=0o644,
            access="append",
        ),
        wire.OpenFile(
            path=str(read), size_bytes=7, mtime_ns=st.st_mtime_ns, mode=0o600, access="read"
        ),
        # Read on one fd, appended to on another: written to, size checked.
        wire.OpenFile(
            path=str(rw), size_bytes=7, mtime_ns=rw.stat().st_mtime_ns, mode=0o644, access="write"
        ),
    ]  # and not its stdout/stderr (the log), which a restore re-points
    here = nodefacts.node("4.2.1")
    assert here.arch == os.uname().machine and here.kernel == os.uname().release
    assert here.stasis_version == __version__ and "fpu" in here.cpu_flags
    assert list(here.cpu_flags) == sorted(set(here.cpu_flags))


def test_files_are_looked_at_with_the_owners_rights(
    world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    tmp_path = world_tmp / "owners-rights"
    tmp_path.mkdir()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    secret = private / "secret"
    secret.write_bytes(b"s" * 10)
    public = tmp_path / "public"
    public.write_bytes(b"p" * 5)
    owner = Owner(test_user.pw_uid, test_user.pw_gid, [test_user.pw_gid])
    got = nodefacts.stat_files_as(owner, [str(secret), str(public)])
    assert got[str(secret)] == FileState(str(secret), error="Permission denied")
    assert got[str(public)].size_bytes == 5 and got[str(public)].regular
    with nodefacts.owner_rights(owner):
        assert nodefacts.stat_files([str(secret)])[str(secret)].error == "Permission denied"
    assert os.geteuid() == 0 and nodefacts.stat_files([str(secret)])[str(secret)].size_bytes == 10


def test_require_raises_one_line_naming_every_difference(tmp_path: Path) -> None:
    from stasis.engine import CRIU, find_criu

    data = tmp_path / "data"
    data.write_bytes(b"d" * 10)
    facts = recorded(
        arch="riscv64",
        cpu_flags=[],
        kernel=os.uname().release,
        files=[_file(str(data), "read", size=20, mode=0o644, mtime_ns=data.stat().st_mtime_ns)],
    )
    with pytest.raises(IncompatibleNodeError) as e:
        nodefacts.require(
            "20261130T001512Z-3f9a1c", facts, CRIU(find_criu(), tmp_path), Owner(0, 0)
        )
    text = str(e.value)
    assert "\n" not in text and "dumped on riscv64" in text
    assert f"{data} is 10 bytes, was 20 when dumped" in text
