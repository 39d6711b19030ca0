"""Full restores of images CRIU cannot read in place (encrypted or compressed, in a local store)
stream them: CRIU reads them from the daemon's image streamer, which decodes each chunk while
CRIU reads, and the tree resumes only once every page file was served and checked, so a page
that does not verify fails the restore (by label: the previous checkpoint is used) and never
kills a running job.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from tests.conftest import Daemon, MakeDaemon, wait_for, workload
from tests.daemon.test_encryption import _key
from tests.daemon.test_restore_state import workload_pid


def _digests(d: Daemon, job: str) -> list[str]:
    return re.findall(r"^digest (\w+)$", d.log_of(job), re.M)


def _lazy_pages_of(job: str) -> list[int]:
    """The `criu lazy-pages` processes of restore `job` (found by their work directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"lazy-pages" in argv and any(f"restore-{job}".encode() in a for a in argv):
            found.append(int(entry.name))
    return found


def _encrypting_daemon(make_daemon: MakeDaemon, world_tmp: Path, **env: str) -> Daemon:
    keys = world_tmp / f"keys-{os.urandom(3).hex()}"
    keys.mkdir(mode=0o700)
    _key(keys / "site.key", os.urandom(32))
    return make_daemon(env={"STASIS_ENCRYPTION_KEY_FILE": str(keys / "site.key"), **env})


def test_encrypted_and_compressed_restores_are_decoded_while_criu_reads(
    make_daemon: MakeDaemon, world_tmp: Path
) -> None:
    d = _encrypting_daemon(make_daemon, world_tmp)
    for how in (("--encrypt",), ("--compress", "zstd")):
        job = d.run(*workload("memhold.py", 32))
        wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
        cp = d.json("dump", *how, job["job"])
        restored = d.json("restore", cp["checkpoint"])
        # Not a lazy restore: all memory was in before the answer, read from our streamer.
        assert restored["lazy"] is False and restored["notes"] == []
        assert _lazy_pages_of(restored["job"]) == []
        criu_log = d.state_dir / "criu-logs" / f"restore-{restored['job']}.log"
        assert "Dismissing the image streamer" in criu_log.read_text()
        # The memory it held, byte for byte.
        os.kill(workload_pid(restored["pid"]), signal.SIGUSR1)
        wait_for(lambda: len(_digests(d, restored["job"])) == 2, 30, "digest")
        assert len(set(_digests(d, restored["job"]))) == 1
        assert _digests(d, restored["job"])[0] == _digests(d, job["job"])[0]
        # No plain copy of the images anywhere.
        assert not [p for p in Path("/dev/shm").glob(f"stasis-restore-{cp['checkpoint']}-*")]
        assert not list((d.state_dir / "scratch").glob("*-stream-*"))
        d.cli("kill", restored["job"])


def test_a_page_that_fails_fails_the_restore_and_the_label_goes_back_one(
    make_daemon: MakeDaemon, world_tmp: Path
) -> None:
    d = _encrypting_daemon(make_daemon, world_tmp)
    job = d.run(*workload("memhold.py", 16), label="streamed")
    wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
    older = d.json("dump", "--encrypt", "--leave-running", job["job"])
    newer = d.json("dump", "--encrypt", job["job"])
    pages = max(
        (Path(d.store) / newer["checkpoint"]).glob("pages-*.img*"), key=lambda p: p.stat().st_size
    )
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF  # in a page the restore leaves to lazy-pages
    pages.write_bytes(data)
    jobs = len(d.json("ps"))

    # By id: one line, nothing left running (the stopped tree was killed, never resumed).
    refused = d.cli("restore", newer["checkpoint"], check=False)
    assert refused.returncode != 0
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "authentication tag" in lines[0], refused.stderr
    assert len(d.json("ps")) == jobs

    # By label: the newest is skipped with its reason, the older one restored.
    restored = d.json("restore", "--label", "streamed")
    assert restored["checkpoint"] == older["checkpoint"]
    assert newer["checkpoint"] in restored["skipped"][0]
    assert "authentication tag" in restored["skipped"][0]
    os.kill(workload_pid(restored["pid"]), signal.SIGUSR1)
    wait_for(lambda: len(_digests(d, restored["job"])) == 2, 30, "digest")
    assert _digests(d, restored["job"])[1] == _digests(d, job["job"])[0]
    d.cli("kill", restored["job"])


def test_a_restore_that_fails_before_criu_reads_answers_at_once(
    make_daemon: MakeDaemon, world_tmp: Path
) -> None:
    # The supervisor cannot open the job's log (a directory stands there now): it fails before
    # CRIU ever connects to the streamer, and the answer must not wait for a connection.
    d = _encrypting_daemon(make_daemon, world_tmp)
    job = d.run(*workload("memhold.py", 8))
    wait_for(lambda: "ready" in d.log_of(job["job"]), what="ready")
    log = d.state_dir / "logs" / f"{job['job']}.log"
    cp = d.json("dump", "--encrypt", job["job"])
    log.unlink()
    log.mkdir()
    started = time.monotonic()
    refused = d.cli("restore", cp["checkpoint"], check=False)
    assert refused.returncode != 0
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot open the job's output" in lines[0], refused.stderr
    assert time.monotonic() - started < 20
    assert not list((d.state_dir / "scratch").glob("*-stream-*"))
