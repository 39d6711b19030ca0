"""The store on a real S3 server (SeaweedFS) under a slow network (issue 28): gc on another node
never removes what a publish still uploads, and retention never deletes a checkpoint while it
is being restored. The slowness is a proxy that holds one connection's bytes (tests/faultproxy.py)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from stasis.store import Manifest
from stasis.store import publisher as store_module
from tests.faultproxy import CutProxy
from tests.s3server import S3Server
from tests.store.helpers import SMALL_FILES, make_info, stage
from tests.store.test_s3 import options, s3_store


class StallProxy(CutProxy):
    """Holds any one connection, in `direction`, once it carried `after` bytes that way, until
    `release()`: a slow link under one transfer while the others go on."""

    def __init__(self, target: tuple[str, int], direction: str, after: int) -> None:
        self.direction = direction
        self.after = after
        self.stalled = threading.Event()
        self.released = threading.Event()
        super().__init__(target)

    def __enter__(self) -> StallProxy:
        return self

    def release(self) -> None:
        self.released.set()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        if direction != self.direction:
            super()._pump(src, dst, direction)
            return
        moved = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                moved += len(data)
                if moved > self.after and not self.released.is_set():
                    self.stalled.set()
                    self.released.wait(60)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_gc_leaves_a_publish_whose_multipart_upload_is_stalled(
    s3: S3Server, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "HEARTBEAT_S", 0.5, raising=False)
    url = f"s3://{s3_bucket}/slow"
    pages = os.urandom(12 << 20)
    with StallProxy(("127.0.0.1", s3.port), "upload", after=2 << 20) as proxy:
        node = s3_store(
            s3, url, tmp_path / "a", options=options(s3, proxy.endpoint, default_block_size=5 << 20)
        )
        other = s3_store(s3, url, tmp_path / "b")  # another node, on a fast link
        info = make_info()
        stage(node, info, {**SMALL_FILES, "pages-1.img": pages})
        thread, result = in_thread(lambda: node.publish(info))
        assert proxy.stalled.wait(30), "the upload never reached the proxy's stall"
        time.sleep(3)  # the small files are up, the big one's upload is older than idle_s
        report = other.gc(idle_s=2)
        proxy.release()
        thread.join(90)
    assert "error" not in result, f"the publish failed: {result.get('error')}"
    assert report.partial == [] and report.uploads == []
    manifest: Manifest = result["value"]
    assert [m.id for m in other.list()] == [manifest.id]
    with other.open_images(manifest.id, tmp_path / "scratch") as (_, images):
        assert (images / "pages-1.img").read_bytes() == pages
    # The heartbeat goes with the publish: only the images and the manifest stay.
    fs = s3.filesystem()
    assert sorted(os.path.basename(p) for p in fs.ls(f"{s3_bucket}/slow/{manifest.id}")) == sorted(
        ["manifest.json", *(e.stored_name for e in manifest.files)]
    )


def test_a_dead_publish_is_still_collected(
    s3: S3Server, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the heartbeat left when its node died: gc takes it once idle, as before.
    monkeypatch.setattr(store_module, "HEARTBEAT_S", 0.2, raising=False)
    url = f"s3://{s3_bucket}/dead"
    node = s3_store(s3, url, tmp_path / "a")
    checkpoint_id = make_info().id
    node._tree.heartbeat(checkpoint_id)
    fs = s3.filesystem()
    fs.pipe_file(f"{s3_bucket}/dead/{checkpoint_id}/core-1.img", b"half")
    assert node.gc(idle_s=60).partial == []
    time.sleep(2.5)
    assert node.gc(idle_s=2).partial == [checkpoint_id]


def test_retention_leaves_the_checkpoint_a_slow_restore_reads(
    s3: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    url = f"s3://{s3_bucket}/pinned"
    writer = s3_store(s3, url, tmp_path / "w")
    pages = os.urandom(8 << 20)
    info = make_info(minutes=0)
    stage(writer, info, {**SMALL_FILES, "pages-1.img": pages})
    oldest = writer.publish(info).id
    with StallProxy(("127.0.0.1", s3.port), "download", after=2 << 20) as proxy:
        restorer = s3_store(s3, url, tmp_path / "r", options=options(s3, proxy.endpoint))

        def restore() -> bytes:
            with restorer.pin(oldest, "restore of job-1"):
                with restorer.open_images(oldest, tmp_path / "scratch") as (_, images):
                    return (images / "pages-1.img").read_bytes()

        thread, result = in_thread(restore)
        assert proxy.stalled.wait(30), "the restore never reached the proxy's stall"
        # Meanwhile another node dumps the label again, keeping only the newest.
        other = s3_store(s3, url, tmp_path / "o", keep=1)
        newer = make_info(minutes=5)
        stage(other, newer, SMALL_FILES)
        other.publish(newer)
        assert other.expire() == []
        proxy.release()
        thread.join(90)
    assert "error" not in result, f"the restore failed: {result.get('error')}"
    assert result["value"] == pages
    # Released: the next retention takes it.
    assert other.expire() == [oldest]
