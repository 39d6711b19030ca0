"""Checked before restore: a dump records what its restore depends on (this node's architecture,
kernel, CPU flags, stasis, the files the job holds open); a restore on a node (here: the same
one, changed) where one of those differs in a way CRIU cannot cope with is refused before CRIU
runs, naming the difference, and `stasis check --checkpoint` shows the comparison."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import stasis
from stasis.config import load_settings
from stasis.daemon.compat import compare
from stasis.engine.nodefacts import Node, cpu_flags
from stasis.store import Manifest, node_keyring
from stasis.store.store import MANIFEST_PURPOSE
from tests.conftest import TEST_USER, Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error
from tests.daemon.test_restore_state import numbers


def _first_numbers(d: Daemon, job: str) -> list[int]:
    return [int(line.split()[0]) for line in d.log_of(job).splitlines()
            if line.split() and line.split()[0].isdigit()]


def _resign(d: Daemon, checkpoint: str, **requires: Any) -> None:
    """Rewrite the manifest's `requires` and sign it with the node's own key, as a genuine
    dump on a node with those facts would have."""
    path = Path(d.store) / checkpoint / "manifest.json"
    document = json.loads(path.read_text())
    document["requires"].update(requires)
    del document["signature"]
    keys = node_keyring(load_settings({"STASIS_STATE_DIR": str(d.state_dir)}))
    document["signature"] = keys.sign(MANIFEST_PURPOSE, document).model_dump()
    path.write_text(json.dumps(document))


def test_dump_records_the_node_and_the_open_files_and_restore_checks_them(
        make_daemon: MakeDaemon, world_tmp: Path) -> None:
    d = make_daemon()
    data = world_tmp / f"input-{os.urandom(3).hex()}.txt"
    data.write_text("ABCDEFGH and more")
    os.chmod(data, 0o644)
    job = d.json("run", "--label", "compat", "--", *workload("readsfile.py", data),
                 user=TEST_USER)
    wait_for(lambda: len(_first_numbers(d, job["job"])) >= 3, what="counting")
    cp = d.json("dump", job["job"])["checkpoint"]
    at_dump = _first_numbers(d, job["job"])[-1]

    manifest = next(c for c in d.json("checkpoints") if c["id"] == cp)
    uname = os.uname()
    req = json.loads((Path(d.store) / cp / "manifest.json").read_text())["requires"]
    assert req["arch"] == uname.machine and req["kernel"] == uname.release
    assert req["cpu_flags"] == cpu_flags() and req["stasis_version"] == stasis.__version__
    st = data.stat()
    assert {"path": str(data), "size_bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "writable": False} in req["files"]
    assert manifest["id"] == cp

    # The input changed since: refused before CRIU runs, naming the file; the checkpoint stays.
    original = data.read_bytes()
    data.write_text("ABCDEFGH and more, appended")
    err = one_line_error(d.cli("restore", cp, user=TEST_USER, check=False), 1,
                         f"cannot restore checkpoint {cp} on this node",
                         f"{data} is 27 bytes, was 17 when dumped")
    assert "stasis check --checkpoint" in err
    assert [j for j in d.json("ps") if j["state"] == "restored"] == []
    table = d.json("check", "--checkpoint", cp, user=TEST_USER)
    assert table["restorable"] is False and table["recorded"] is True
    verdicts = {f["what"]: f["verdict"] for f in table["facts"]}
    assert verdicts[f"file {data}"] == "refuses"
    assert verdicts["architecture"] == verdicts["CPU flags"] == verdicts["CRIU"] == "ok"
    assert verdicts["user"] == "ok"
    assert d.cli("check", "--checkpoint", cp, check=False).returncode == 1

    # Same size, other contents: still refused (by its modification time).
    data.write_bytes(original[::-1])
    one_line_error(d.cli("restore", cp, check=False), 1, f"{data} was modified since the dump")

    # Put back as it was: restored, and it goes on from where it was.
    data.write_bytes(original)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert d.json("check", "--checkpoint", cp)["restorable"] is True
    restored = d.json("restore", cp, user=TEST_USER)
    wait_for(lambda: _first_numbers(d, restored["job"])[-1] >= at_dump + 3, what="counting on")
    values = _first_numbers(d, restored["job"])
    assert values == list(range(len(values)))
    d.cli("kill", restored["job"])


def test_a_cpu_flag_this_node_lacks_refuses_the_restore(daemon: Daemon) -> None:
    job = daemon.json("run", "--label", "cpu", "--", *workload("counter.py"))
    wait_for(lambda: len(numbers(daemon.log_of(job["job"]))) >= 2, what="counting")
    cp = daemon.json("dump", job["job"])["checkpoint"]
    _resign(daemon, cp, cpu_flags=[*cpu_flags(), "avx10_9_fake"])
    one_line_error(daemon.cli("restore", cp, check=False), 1,
                   "cannot restore checkpoint", "this CPU lacks avx10_9_fake")
    one_line_error(daemon.cli("restore", "--label", "cpu", check=False), 1,
                   "this CPU lacks avx10_9_fake")
    assert [c["id"] for c in daemon.json("checkpoints", "--label", "cpu")] == [cp]


def _manifest(**requires: Any) -> Manifest:
    base = {"arch": "x86_64", "kernel": "6.1.0", "stasis_version": stasis.__version__,
            "cpu_flags": ["fpu", "sse2", "avx2"], "files": []}
    base.update(requires)
    return Manifest.model_validate({
        "id": "20261202T000000Z-abcdef", "label": "l", "job": "j", "host": "n1",
        "criu_version": "4.2.1", "command": ["x"], "cwd": "/", "user": "root", "uid": 0,
        "gid": 0, "size_bytes": 0, "stored_size_bytes": 0, "compression": "none", "files": [],
        "requires": base})


def test_what_refuses_and_what_is_only_noted() -> None:
    node = Node(arch="x86_64", kernel="6.18.0", cpu_flags=frozenset({"fpu", "sse2", "avx2",
                                                                    "avx512f"}))

    def verdicts(m: Manifest, criu: str = "4.2.1") -> dict[str, str]:
        return {f.what: f.verdict for f in compare(m, criu, node)}

    same = verdicts(_manifest())
    assert same["architecture"] == same["CPU flags"] == same["CRIU"] == same["user"] == "ok"
    assert same["kernel"] == "note"  # another kernel: CRIU copes
    assert verdicts(_manifest(arch="aarch64"))["architecture"] == "refuses"
    assert verdicts(_manifest(cpu_flags=["fpu", "amx_tile"]))["CPU flags"] == "refuses"
    assert verdicts(_manifest(), criu="4.1")["CRIU"] == "refuses"
    assert verdicts(_manifest(), criu="4.3")["CRIU"] == "note"
    assert verdicts(_manifest(stasis_version="0.0.1"))["stasis"] == "note"
    gone = verdicts(_manifest(files=[{"path": "/nonexistent/x", "size_bytes": 1, "mtime_ns": 0,
                                      "writable": True}]))
    assert gone["file /nonexistent/x"] == "refuses"
    old = _manifest().model_copy(update={"requires": None})
    assert compare(old, "4.2.1", node) == []
