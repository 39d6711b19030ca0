"""What a restore depends on, through a real daemon and real CRIU: a dump records it in the
manifest, a restore on a node that differs in a way CRIU cannot cope with is refused before CRIU
runs (one line naming the difference, nothing restored, the checkpoint kept), and `stasis check
--checkpoint ID` prints the comparison. The differences are real where this machine can make
them (a file the job had open, changed); CPU flags cannot change here, so a published manifest
is rewritten with a flag this CPU lacks and signed again with the node's key."""

from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
from pathlib import Path
from typing import Any

from stasis import __version__, wire
from stasis.engine.nodefacts import X86_INSTRUCTION_FLAGS
from stasis.store.signing import load_keyring
from stasis.store.store import MANIFEST_PURPOSE
from tests.conftest import TEST_USER, Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error
from tests.daemon.test_restore_state import last_number, numbers
from tests.test_wire import conforms


def _files(tmp: Path) -> tuple[Path, Path, Path]:
    read, append, rw = tmp / "input.bin", tmp / "out.log", tmp / "state.bin"
    read.write_bytes(b"r" * 2048)
    append.write_bytes(b"a" * 10)
    rw.write_bytes(b"w" * 100)
    os.chmod(read, 0o640)
    return read, append, rw


def _holding(d: Daemon, files: tuple[Path, Path, Path], label: str, user: str | None = None) -> Any:
    job = d.json("run", "--label", label, "--", *workload("holdfiles.py", *files), user=user)
    wait_for(lambda: last_number(d, job["job"]) >= 3, what="counting")
    return job


def _manifest_path(d: Daemon, checkpoint: str) -> Path:
    return Path(d.store) / checkpoint / "manifest.json"


def _manifest(d: Daemon, checkpoint: str) -> Any:
    return json.loads(_manifest_path(d, checkpoint).read_text())


def _resign(d: Daemon, checkpoint: str, document: dict[str, Any]) -> None:
    """Write `document` as the checkpoint's manifest, signed with the daemon's node key: what
    a node whose facts were those would have published."""
    document.pop("signature", None)
    keys = load_keyring(d.state_dir / "keys", "", [], False)
    signature = keys.sign(MANIFEST_PURPOSE, document)
    document["signature"] = {"key_id": signature.key_id, "hmac_sha256": signature.hmac_sha256}
    _manifest_path(d, checkpoint).write_text(json.dumps(document))


def _cpuinfo() -> tuple[str, list[str]]:
    """This machine's CPU model and the flags all its CPUs share, read here independently."""
    model, common = "", set[str]()
    first = True
    for block in Path("/proc/cpuinfo").read_text().split("\n\n"):
        lines = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        lines = {k.strip(): v.strip() for k, v in lines.items()}
        if "flags" in lines:
            model = model or lines.get("model name", "")
            flags = set(lines["flags"].split())
            common, first = (flags if first else common & flags), False
    return model, sorted(common)


def _criu_version() -> str:
    out = subprocess.run(
        ["/usr/local/sbin/criu", "--version"], capture_output=True, text=True, check=True
    ).stdout
    found = re.search(r"Version: (\S+)", out)
    assert found is not None, out
    return found.group(1)


def _refused(d: Daemon, checkpoint: str, *words: str) -> str:
    jobs_before = d.json("ps")
    line = one_line_error(
        d.cli("restore", checkpoint, check=False),
        1,
        f"cannot restore checkpoint {checkpoint} on this node",
        *words,
    )
    assert d.json("ps") == jobs_before  # nothing restored, nothing left running
    assert checkpoint in [c["id"] for c in d.json("checkpoints")]  # and the checkpoint stays
    return line


def _check(d: Daemon, checkpoint: str, user: str | None = None) -> Any:
    """`check --checkpoint --json`: exit 0 when a restore here would go ahead, 1 when not."""
    result = d.cli("check", "--json", "--checkpoint", checkpoint, user=user, check=False)
    report = json.loads(result.stdout)
    assert result.returncode == (0 if report["restorable"] else 1), result.stderr
    return report


def _continues(d: Daemon, restored: Any, at_dump: int) -> None:
    wait_for(lambda: last_number(d, restored["job"]) >= at_dump + 3, what="counting on")
    values = numbers(d.log_of(restored["job"]))
    assert values == list(range(len(values)))  # the same counter, on from where it was
    d.cli("kill", restored["job"])


def test_a_dump_records_what_its_restore_depends_on(daemon: Daemon, tmp_path: Path) -> None:
    read, append, rw = files = _files(tmp_path)
    job = _holding(daemon, files, "facts")
    checkpoint = daemon.json("dump", job["job"])["checkpoint"]
    facts = _manifest(daemon, checkpoint)["restore_facts"]
    model, flags = _cpuinfo()

    def entry(path: Path, access: str) -> dict[str, Any]:
        st = path.stat()
        return {
            "path": str(path),
            "size_bytes": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "mode": st.st_mode & 0o7777,
            "access": access,
        }

    assert facts == {
        "arch": os.uname().machine,
        "cpu_model": model,
        "cpu_flags": flags,
        "kernel": os.uname().release,
        "criu_version": _criu_version(),
        "stasis_version": __version__,
        "user": "root",
        "uid": 0,
        # Sorted by path; the job's log (its stdout and stderr) is not there: a restore
        # re-points it rather than reopening it.
        "files": [entry(read, "read"), entry(append, "append"), entry(rw, "write")],
    }
    assert facts["files"][0]["mode"] == 0o640 and facts["files"][0]["size_bytes"] == 2048


def test_a_changed_input_refuses_the_restore_until_it_is_put_back(
    daemon: Daemon, tmp_path: Path
) -> None:
    read, append, rw = files = _files(tmp_path)
    job = _holding(daemon, files, "changed-input")
    checkpoint = daemon.json("dump", job["job"])["checkpoint"]
    at_dump = last_number(daemon, job["job"])
    dumped = read.stat()

    with open(read, "ab") as f:
        f.write(b"more")
    _refused(daemon, checkpoint, f"{read} is 2052 bytes, was 2048 when dumped")
    # The size as it was, and other contents: still refused, saying why.
    os.truncate(read, 2048)
    line = _refused(daemon, checkpoint, f"{read} was modified since the dump", "same size")
    assert "bytes, was" not in line
    # An appended-to log of the job's own is no reason to refuse (CRIU appends on).
    with open(append, "ab") as f:
        f.write(b"appended after the dump")
    os.utime(read, ns=(dumped.st_atime_ns, dumped.st_mtime_ns))
    restored = daemon.json("restore", checkpoint)
    assert any(
        f"{append} is " in n and "goes on appending" in n for n in restored["notes"]
    ), restored["notes"]
    _continues(daemon, restored, at_dump)


def test_a_cpu_flag_this_node_lacks_refuses_and_a_machine_flag_is_a_note(daemon: Daemon) -> None:
    job = daemon.json("run", "--label", "cpuflags", "--", *workload("counter.py"))
    wait_for(lambda: last_number(daemon, job["job"]) >= 3, what="counting")
    checkpoint = daemon.json("dump", job["job"])["checkpoint"]
    at_dump = last_number(daemon, job["job"])
    document = _manifest(daemon, checkpoint)
    facts = document["restore_facts"]
    # Instructions the dumping CPU had and this one lacks: what a faster node would record.
    lacking = sorted(X86_INSTRUCTION_FLAGS - set(facts["cpu_flags"]))[:2]
    assert len(lacking) == 2
    original = list(facts["cpu_flags"])
    facts["cpu_flags"] = sorted(original + lacking)
    _resign(daemon, checkpoint, document)
    line = _refused(daemon, checkpoint, f"this CPU lacks {lacking[0]}, {lacking[1]}")
    assert "SIGILL" in line
    # By label too: it is not skipped for an older one (that is not what was asked for).
    one_line_error(
        daemon.cli("restore", "--label", "cpuflags", check=False),
        1,
        f"cannot restore checkpoint {checkpoint}",
        f"this CPU lacks {lacking[0]}",
    )
    check = daemon.cli("check", "--checkpoint", checkpoint, check=False)
    assert check.returncode == 1, check.stderr
    assert f"refuses: this CPU lacks {lacking[0]}, {lacking[1]}" in check.stdout
    assert "would be refused on this node" in check.stdout

    # A flag of the machine, not an instruction (a hypervisor's, a mitigation's): a note.
    facts["cpu_flags"] = sorted(original + ["made_up_hypervisor_flag"])
    _resign(daemon, checkpoint, document)
    restored = daemon.json("restore", checkpoint)
    assert any("made_up_hypervisor_flag" in n for n in restored["notes"]), restored["notes"]
    _continues(daemon, restored, at_dump)


def test_check_compares_the_owners_checkpoint_and_nobody_elses(
    daemon: Daemon, world_tmp: Path
) -> None:
    tmp = world_tmp / "check-owner"
    tmp.mkdir()
    os.chmod(tmp, 0o777)
    read, append, rw = files = _files(tmp)
    for path in files:
        os.chmod(path, 0o666)
    job = _holding(daemon, files, "check-owner", TEST_USER)
    checkpoint = daemon.json("dump", job["job"], user=TEST_USER)["checkpoint"]

    report = daemon.json("check", "--checkpoint", checkpoint, user=TEST_USER)
    assert conforms(report, wire.CheckpointCheck), report
    assert report["checkpoint"] == checkpoint and report["recorded"] is True
    assert report["restorable"] is True
    verdicts = {f["what"]: f["verdict"] for f in report["facts"]}
    assert verdicts == {
        "architecture": "ok",
        "CPU flags": "ok",
        "CRIU": "ok",
        "kernel": "ok",
        "stasis": "ok",
        "user": "ok",
        f"file {read}": "ok",
        f"file {append}": "ok",
        f"file {rw}": "ok",
    }
    user = next(f for f in report["facts"] if f["what"] == "user")
    assert user["recorded"] == user["here"] == f"{TEST_USER} (uid {pwd.getpwnam(TEST_USER).pw_uid})"
    table = daemon.cli("check", "--checkpoint", checkpoint, user=TEST_USER).stdout
    assert re.search(rf"file {re.escape(str(read))}\s+2048 bytes, mode 0666", table), table
    assert "can be restored on this node" in table

    # The path swapped for one the owner may not open: refused, and the owner learns no more.
    os.rename(read, tmp / "input.moved")
    secret = tmp / "private"
    secret.mkdir(mode=0o700)
    (secret / "x").write_bytes(b"s" * 2048)
    os.symlink(secret / "x", read)
    report = _check(daemon, checkpoint, TEST_USER)
    found = next(f for f in report["facts"] if f["what"] == f"file {read}")
    assert found["verdict"] == "refuses" and found["here"] == "Permission denied", found
    assert report["restorable"] is False
    # Root sees it the way the owner would, and another user not at all.
    as_root = _check(daemon, checkpoint)
    assert as_root["facts"] == report["facts"]
    job_root = daemon.json("run", "--", *workload("counter.py"))
    wait_for(lambda: last_number(daemon, job_root["job"]) >= 1, what="counting")
    roots = daemon.json("dump", job_root["job"])["checkpoint"]
    one_line_error(
        daemon.cli("check", "--checkpoint", roots, user=TEST_USER, check=False),
        2,
        "permission denied",
        f"checkpoint {roots} belongs to another user",
    )
    daemon.cli("checkpoints", "rm", checkpoint)
    daemon.cli("checkpoints", "rm", roots)


def test_a_checkpoint_that_records_nothing_restores_as_before(daemon: Daemon) -> None:
    job = daemon.json("run", "--label", "unrecorded", "--", *workload("counter.py"))
    wait_for(lambda: last_number(daemon, job["job"]) >= 3, what="counting")
    checkpoint = daemon.json("dump", job["job"])["checkpoint"]
    at_dump = last_number(daemon, job["job"])
    document = _manifest(daemon, checkpoint)
    del document["restore_facts"]  # as stasis wrote manifests before it recorded them
    document["criu_version"] = "99.0"  # nothing would compare it now anyway
    _resign(daemon, checkpoint, document)
    out = daemon.cli("check", "--checkpoint", checkpoint).stdout
    assert f"checkpoint {checkpoint} records nothing to compare" in out
    report = daemon.json("check", "--checkpoint", checkpoint)
    assert report == {
        "checkpoint": checkpoint,
        "node": report["node"],
        "recorded": False,
        "restorable": True,
        "facts": [],
    }
    assert report["node"]  # this node's name
    restored = daemon.json("restore", checkpoint)
    assert restored["notes"] == []
    _continues(daemon, restored, at_dump)


def test_from_a_store_it_fetches_from_a_changed_file_refuses_before_anything_is_fetched(
    make_daemon: MakeDaemon, world_tmp: Path
) -> None:
    store = world_tmp / f"fetched-store-{os.urandom(3).hex()}"
    store.mkdir(mode=0o700)
    d = make_daemon(store=f"dir::file://{store}")
    tmp = world_tmp / f"fetched-{os.urandom(3).hex()}"
    tmp.mkdir()
    os.chmod(tmp, 0o777)
    read, append, rw = files = _files(tmp)
    for path in files:
        os.chmod(path, 0o666)
    job = _holding(d, files, "fetched", TEST_USER)
    checkpoint = d.json("dump", job["job"], user=TEST_USER)["checkpoint"]
    at_dump = last_number(d, job["job"])
    dumped = rw.stat()
    rw.write_bytes(b"w" * 50)  # the job wrote 100 bytes of it: CRIU would refuse it half-way
    # Its page images taken away: a restore that fetched anything would fail on them first.
    pages = sorted((store / checkpoint).glob("pages-*"))
    assert pages
    aside = world_tmp / f"aside-{os.urandom(3).hex()}"
    aside.mkdir()
    for path in pages:
        path.rename(aside / path.name)
    line = one_line_error(
        d.cli("restore", checkpoint, user=TEST_USER, check=False),
        1,
        f"cannot restore checkpoint {checkpoint} on this node",
        f"{rw} is 50 bytes, was 100 when dumped",
    )
    assert "pages-" not in line
    for path in pages:
        (aside / path.name).rename(path)
    rw.write_bytes(b"w" * 100)
    os.utime(rw, ns=(dumped.st_atime_ns, dumped.st_mtime_ns))
    restored = d.json("restore", checkpoint, user=TEST_USER)
    _continues(d, restored, at_dump)
