"""`stasis checkpoints gc` on a daemon whose store is a real S3 bucket: what dead publishes left
(objects without a manifest, an unfinished multipart upload, an index entry leading nowhere)
goes, complete checkpoints stay; only root may run it."""

from __future__ import annotations

from stasis.store.index import entry_name
from tests.conftest import TEST_USER, MakeDaemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error
from tests.daemon.test_restore_state import last_number
from tests.s3server import S3Server
from tests.store.helpers import make_info


def test_gc_removes_what_dead_publishes_left_and_nothing_else(
    make_daemon: MakeDaemon, s3: S3Server, s3_bucket: str
) -> None:
    node = make_daemon(store=f"s3://{s3_bucket}/gc", env=s3.env())
    job = node.json("run", "--label", "kept", "--", *workload("counter.py"), user=TEST_USER)
    wait_for(lambda: last_number(node, job["job"]) >= 2, what="counting")
    kept = node.json("dump", job["job"], "--leave-running")["checkpoint"]

    fs = s3.filesystem()
    dead = make_info(minutes=1).id
    fs.pipe_file(f"{s3_bucket}/gc/{dead}/pages-1.img", b"half an upload")
    upload = fs.call_s3("create_multipart_upload", Bucket=s3_bucket, Key=f"gc/{dead}/big.img")
    fs.call_s3(
        "upload_part",
        Bucket=s3_bucket,
        Key=f"gc/{dead}/big.img",
        PartNumber=1,
        UploadId=upload["UploadId"],
        Body=b"x" * (5 << 20),
    )
    stale = entry_name(make_info(minutes=2).created, make_info(minutes=2).id)
    fs.pipe_file(f"{s3_bucket}/gc/.index/kept/1000/{stale}", b"")

    one_line_error(
        node.cli("checkpoints", "gc", user=TEST_USER, check=False),
        2,
        "only root may collect the garbage",
    )
    # The objects are seconds old: they stay. The entry says it was made two days ago (its name
    # holds the time) and leads nowhere: it goes.
    young = node.json("checkpoints", "gc")
    assert young["partial"] == [] and young["uploads"] == []
    assert young["index_entries_removed"] == 1
    report = node.json("checkpoints", "gc", "--idle", "0")
    assert report["partial"] == [dead]
    assert report["uploads"] == [f"gc/{dead}/big.img"]
    assert report["index_entries_removed"] == 0
    assert fs.call_s3("list_multipart_uploads", Bucket=s3_bucket).get("Uploads", []) == []
    assert not fs.exists(f"{s3_bucket}/gc/{dead}/pages-1.img")
    assert [c["id"] for c in node.json("checkpoints", "--label", "kept", user=TEST_USER)] == [kept]
    restored_from = node.json("restore", "--label", "kept", user=TEST_USER)["checkpoint"]
    assert restored_from == kept
    node.kill_all()
