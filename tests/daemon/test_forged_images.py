"""A store writer without any key rewrites a 1 KiB block of a real page image so that every xxh3
sum in the signed manifest still matches (tests/store/xxh3forge.py): the restore must refuse it,
and nothing of the attacker's runs, locally (full and lazy) and from S3.

The job holds a buffer of "SAFE" and says every tenth of a second whether it holds "PWNED"; the
forged block writes "PWNED" into that buffer's page, as attacker-chosen code or data would be."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import xxhash

from stasis.store.signing import NODE_KEY, Keyring, read_key
from stasis.store.store import MANIFEST_PURPOSE
from tests.conftest import TEST_USER, Daemon, MakeDaemon, wait_for
from tests.s3server import S3Server
from tests.store.xxh3forge import BLOCK, forge

MIB = 1 << 20
PROGRAM = """
import itertools, time
buf = bytearray(b"SAFE" * (64 << 10))
for i in itertools.count():
    print(i, "pwned" if b"PWNED" in buf else "safe", flush=True)
    time.sleep(0.1)
"""
PAYLOAD = b"PWNED!!!" * 96


def _dump(d: Daemon, label: str) -> tuple[str, str]:
    job = d.json("run", "--label", label, "--", "python3", "-u", "-c", PROGRAM, user=TEST_USER)
    wait_for(lambda: "1 safe" in d.log_of(job["job"]), what="the job counting")
    checkpoint: str = d.json("dump", job["job"], user=TEST_USER)["checkpoint"]
    return job["job"], checkpoint


def forged(data: bytes) -> bytes | None:
    """`data` (a page image) with a block of the job's buffer rewritten to hold the payload,
    every xxh3 the manifest has of it kept; None when the buffer is not in this image."""
    at = data.find(b"SAFE" * 512)
    while at >= 0:
        offset = -(-at // BLOCK) * BLOCK
        if data[offset : offset + BLOCK] == b"SAFE" * (BLOCK // 4):
            try:
                out = forge(data, offset, PAYLOAD)
            except ValueError:  # the last block of a chunk: the next one will do
                at = data.find(b"SAFE" * 512, offset + BLOCK)
                continue
            assert xxhash.xxh3_128_hexdigest(out) == xxhash.xxh3_128_hexdigest(data)
            return out
        at = data.find(b"SAFE" * 512, at + 4)
    return None


def _forge_local(d: Daemon, checkpoint: str) -> None:
    done = False
    for path in sorted((Path(d.store) / checkpoint).glob("pages-*.img")):
        out = forged(path.read_bytes())
        if out is not None:
            path.write_bytes(out)
            done = True
    assert done, "the job's buffer is in no page image"


def _forge_s3(s3: S3Server, bucket: str, checkpoint: str) -> None:
    fs = s3.filesystem()
    done = False
    for key in sorted(fs.find(f"{bucket}/")):
        if f"/{checkpoint}/pages-" in key:
            out = forged(fs.cat_file(key))
            if out is not None:
                fs.pipe_file(key, out)
                done = True
    assert done, "the job's buffer is in no page image"


def _refused(d: Daemon, job: str, checkpoint: str, *args: str) -> None:
    result = d.cli("restore", "--json", checkpoint, *args, user=TEST_USER, check=False)
    out = (result.stdout + result.stderr).strip()
    if result.returncode == 0:
        time.sleep(1.0)  # long enough for the restored job to say what it holds
        d.cli("kill", json.loads(result.stdout)["job"], check=False)
    # STATE first: the restored log (the job's own) never shows the attacker's bytes.
    assert "pwned" not in d.log_of(job), f"the forged image ran: {out}"
    assert result.returncode != 0, out
    assert len(out.splitlines()) == 1, out
    assert checkpoint in out and "pages-" in out, out
    assert not [j for j in d.json("ps") if j["state"] in ("running", "restored")]


@pytest.mark.parametrize("shared", [False, True], ids=["root-only", "shared"])
@pytest.mark.parametrize("lazy", [False, True], ids=["full", "lazy"])
def test_a_forged_page_image_in_a_local_store_is_refused(
    make_daemon: MakeDaemon, lazy: bool, shared: bool
) -> None:
    """`shared`: others may write the checkpoint's directory, so CRIU must not read it in
    place (streamed or served, each chunk checked as read); root-only: CRIU reads in place
    while the daemon hashes, and the tree never resumes on a mismatch."""
    d = make_daemon()
    job, checkpoint = _dump(d, "forged")
    _forge_local(d, checkpoint)
    if shared:
        os.chmod(Path(d.store) / checkpoint, 0o777)
    if lazy and not shared:
        _killed(d, checkpoint)
        return
    _refused(d, job, checkpoint, *(["--lazy"] if lazy else []))


def _killed(d: Daemon, checkpoint: str) -> None:
    """A lazy restore from a root-only store: lazy-pages reads the page images in place and
    they are hashed just after the tree runs. Only root writes there, so a mismatch is damage
    (this test, as root, plays it): the job is killed and the daemon says why."""
    restored = d.json("restore", "--lazy", checkpoint, user=TEST_USER)
    wait_for(
        lambda: not [
            j
            for j in d.json("ps")
            if j["job"] == restored["job"] and j["state"] in ("running", "restored")
        ],
        what="the damaged job killed",
    )
    log = (d.root / "daemon.log").read_text()
    assert f"killed lazily restored job {restored['job']}" in log
    assert "pages-" in log and "fails its checksum" in log


def test_a_forged_page_image_on_s3_is_refused(
    make_daemon: MakeDaemon, s3: S3Server, s3_bucket: str
) -> None:
    d = make_daemon(store=f"s3://{s3_bucket}/site", env=s3.env())
    job, checkpoint = _dump(d, "forged")
    _forge_s3(s3, s3_bucket, checkpoint)
    _refused(d, job, checkpoint)


def _as_format_2(d: Daemon, checkpoint: str) -> None:
    """Rewrite the checkpoint's manifest as a stasis before BLAKE3 wrote it (xxh3 sums only),
    signed with the node's own key: a genuine old checkpoint of this node."""
    directory = Path(d.store) / checkpoint
    document = json.loads((directory / "manifest.json").read_text())
    document["format"] = 2
    del document["signature"]
    for entry in document["files"]:
        data = (directory / entry["stored_name"]).read_bytes()
        del entry["blake3"]
        entry["xxh3_128"] = xxhash.xxh3_128_hexdigest(data)
        table = entry["chunks"]
        step = table["size_bytes"]
        del table["blake3"]
        table["xxh3_64"] = [
            xxhash.xxh3_64_hexdigest(data[i : i + step]) for i in range(0, len(data), step)
        ]
    keys = Keyring(read_key(d.state_dir / "keys" / NODE_KEY, "node key"))
    document["signature"] = keys.sign(MANIFEST_PURPOSE, document).model_dump()
    (directory / "manifest.json").write_text(json.dumps(document))


def test_an_old_unencrypted_checkpoint_is_listed_but_not_restored(make_daemon: MakeDaemon) -> None:
    d = make_daemon()
    job, checkpoint = _dump(d, "legacy")
    _as_format_2(d, checkpoint)
    assert [c["id"] for c in d.json("checkpoints", "--label", "legacy", user=TEST_USER)] == [
        checkpoint
    ]
    for args in ((checkpoint,), ("--label", "legacy"), (checkpoint, "--lazy")):
        result = d.cli("restore", *args, user=TEST_USER, check=False)
        out = (result.stdout + result.stderr).strip()
        assert result.returncode == 1 and len(out.splitlines()) == 1, out
        for words in (
            f"checkpoint {checkpoint} is not restored",
            "predates cryptographic image hashes",
            "dump the job again",
        ):
            assert words in out, out
    assert not [j for j in d.json("ps") if j["state"] in ("running", "restored")]
    assert (Path(d.store) / checkpoint / "manifest.json").exists()  # nothing lost
