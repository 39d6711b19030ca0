"""The store on S3 (or any S3-compatible server: SeaweedFS, MinIO, Ceph RGW), through s3fs.

What differs from other fsspec filesystems (`_remote.RemoteTree`):
- There is no rename, and none is needed: one PUT of manifest.json is atomic (readers see the old
  object, none, or the whole new one), so the manifest is written in place, last.
- There are no directories: creating one would make s3fs create the *bucket*, so nothing is ever
  created but objects; a missing bucket is an error that says so.
- An upload cut off (a node or the server dying mid-dump) can leave a multipart upload behind:
  invisible to listings but holding space until aborted (`abandoned_uploads`, used by gc).
- A listing returns 1,000 keys a page: the index's newest entries are read from the first page
  only (`index_list` with a limit), while full listings page through everything (s3fs does).
- Listings are never cached: other nodes write the same bucket.
- Uploads are multipart uploads of several parts at once (`MultipartOutput`), whether a follower
  streams them while CRIU writes or publish sends whole files: s3fs's own files send one part
  after the other, a fraction of what the server takes.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from stasis.errors import StoreError
from stasis.store._remote import RemoteTree
from stasis.store.compression import Writer
from stasis.store.index import INDEX_DIR
from stasis.store.manifest import is_checkpoint_id
from stasis.store.tailhash import Opener, Output

# fsspec's S3 options that make it fit a store several nodes share (see the module docstring).
# Timeouts and retries: a server that is gone must fail a dump in seconds, not minutes (botocore's
# defaults retried a refused connection for over two minutes).
SHARED_OPTIONS: dict[str, Any] = {
    "use_listings_cache": False,
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 1}},
}


# Parts of an upload: S3 wants >= 5 MiB but for the last; 16 MiB keeps a streamed dump's tail
# (what is sent after CRIU finished) short. A smaller `default_block_size` option wins.
PART_BYTES = 16 << 20
MIN_PART_BYTES = 5 << 20
# Parts in flight per store, all uploads together: what the server takes in parallel, and a
# bound on the memory held (this many parts).
PARTS_IN_FLIGHT = 8


class MultipartOutput:
    """One object uploaded in parts as it is written: a part goes out (on the tree's upload
    threads, several at once) whenever `part_bytes` are buffered; `close` sends the rest and
    completes the upload (one PUT for an object smaller than a part); `discard` aborts it, or
    deletes the object once complete.

    `write` does not raise for the network: only waits when PARTS_IN_FLIGHT parts are out. A
    failed part is reported by `close` (which aborts the upload): a follower writing on must
    never find its writer ahead of its output.
    """

    def __init__(self, tree: S3Tree, key: str) -> None:
        self._tree = tree
        self.key = key
        self._buffer = bytearray()
        self._upload: Future[str] | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._closed = False
        self._completed = False

    @property
    def upload_started(self) -> bool:
        return self._upload is not None

    def write(self, data: bytes | memoryview, /) -> int:
        if not self._closed:
            self._buffer += data
            if len(self._buffer) >= self._tree.part_bytes:
                self._send()
        return len(data)

    def _send(self) -> None:
        body, self._buffer = bytes(self._buffer), bytearray()
        pool, slots = self._tree.uploads()
        if self._upload is None:
            # Queued before its parts, so it runs first: they wait on it, never the reverse.
            self._upload = pool.submit(self._create)
        number = len(self._parts) + 1
        slots.acquire()
        try:
            self._parts.append(pool.submit(self._put_part, number, body))
        except BaseException:
            slots.release()
            raise

    def _create(self) -> str:
        out = self._tree.fs.call_s3(
            "create_multipart_upload", Bucket=self._tree.bucket, Key=self.key
        )
        return str(out["UploadId"])

    def _put_part(self, number: int, body: bytes) -> dict[str, Any]:
        try:
            assert self._upload is not None
            upload_id = self._upload.result()
            out = self._tree.fs.call_s3(
                "upload_part",
                Bucket=self._tree.bucket,
                Key=self.key,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
            )
            return {"PartNumber": number, "ETag": out["ETag"]}
        finally:
            self._tree.uploads()[1].release()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        fs, bucket = self._tree.fs, self._tree.bucket
        try:
            if self._upload is None:
                fs.call_s3("put_object", Bucket=bucket, Key=self.key, Body=bytes(self._buffer))
            else:
                if self._buffer:
                    self._send()
                upload_id = self._upload.result()
                parts = [part.result() for part in self._parts]
                fs.call_s3(
                    "complete_multipart_upload",
                    Bucket=bucket,
                    Key=self.key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            self._completed = True
        except BaseException:
            self._abort()
            raise
        finally:
            self._buffer = bytearray()

    def discard(self) -> None:
        self._closed = True
        self._buffer = bytearray()
        self._abort()
        if self._completed:
            try:
                self._tree.fs.call_s3("delete_object", Bucket=self._tree.bucket, Key=self.key)
            except Exception:
                pass  # removed with its checkpoint's directory, or by gc
            self._completed = False

    def _abort(self) -> None:
        """Stop the parts not yet sent, wait for those being sent, abort the upload (where
        the server is reachable; else `gc` aborts it later)."""
        for part in self._parts:
            if part.cancel():
                self._tree.uploads()[1].release()  # it never ran to release its slot
        wait(self._parts)
        self._parts = []
        if self._upload is None:
            return
        upload, self._upload = self._upload, None
        try:
            self._tree.fs.call_s3(
                "abort_multipart_upload",
                Bucket=self._tree.bucket,
                Key=self.key,
                UploadId=upload.result(),
            )
        except Exception:
            pass


class S3Tree(RemoteTree):
    def __init__(self, fs: Any, root: str, where: str, staging_root: Path) -> None:
        super().__init__(fs, root, where, staging_root)
        self.bucket, _, self.prefix = self.root.partition("/")
        self._bucket_seen = False
        block = int(getattr(fs, "default_block_size", 0) or PART_BYTES)
        self.part_bytes = max(MIN_PART_BYTES, min(PART_BYTES, block))
        self._pool: ThreadPoolExecutor | None = None
        self._slots = threading.BoundedSemaphore(PARTS_IN_FLIGHT)
        self._pool_lock = threading.Lock()

    def uploads(self) -> tuple[ThreadPoolExecutor, threading.BoundedSemaphore]:
        """The threads that send parts (made at the first upload) and the slots of parts in
        flight."""
        with self._pool_lock:
            if self._pool is None:
                # One more than the slots: the creation of an upload never waits behind parts.
                self._pool = ThreadPoolExecutor(
                    PARTS_IN_FLIGHT + 1, thread_name_prefix="stasis-s3-upload"
                )
            return self._pool, self._slots

    def stream_opener(self, checkpoint_id: str) -> Opener:
        self._check_bucket()  # SeaweedFS would make a missing bucket on the first upload
        return super().stream_opener(checkpoint_id)

    def _open_output(self, path: str) -> Output:
        return MultipartOutput(self, self._key_of(path))

    def _open_write(self, path: str) -> AbstractContextManager[Writer]:
        output = MultipartOutput(self, self._key_of(path))
        return cast(AbstractContextManager[Writer], _writing(output))

    def _key_of(self, path: str) -> str:
        bucket, _, key = path.partition("/")
        assert bucket == self.bucket
        return key

    def ids(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            self._check_bucket()
            return []
        return self._ids_in(entries)

    def _check_bucket(self) -> None:
        # ls of a prefix that holds nothing yet is not an error; of a bucket that is missing it
        # is. Checked before writing too: some servers (SeaweedFS) make a bucket on a PUT.
        if self._bucket_seen:
            return
        try:
            # Not fs.exists: it says False for a key that is refused too.
            self.fs.call_s3("head_bucket", Bucket=self.bucket)
        except FileNotFoundError:
            raise StoreError(
                f"bucket {self.bucket} of checkpoint store {self.where} does not exist: create "
                f"it, or point STASIS_STORE at one that does"
            ) from None
        self._bucket_seen = True

    def index_put(self, label: str, uid: int, name: str) -> None:
        self._check_bucket()  # the first write of a publish
        super().index_put(label, uid, name)

    def _make_dir(self, path: str) -> None:
        pass

    def _remove_empty_dir(self, path: str) -> None:
        pass  # none made; and s3fs's rmdir of a bucket's path deletes the bucket

    def remove(self, checkpoint_id: str) -> None:
        super().remove(checkpoint_id)
        # Servers built on a filer (SeaweedFS) keep an emptied "directory" listed until its
        # own key goes; on AWS this deletes a key that does not exist, which is no error.
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self._key(checkpoint_id) + "/")
        except Exception:
            pass  # it only stays listed, as a checkpoint without a manifest

    def end_heartbeat(self, checkpoint_id: str) -> None:
        super().end_heartbeat(checkpoint_id)
        # A publish that ended without files (a dump discarded): the "directory" the heartbeat
        # made on a filer-based server goes too, as in `remove`.
        try:
            path = self._path(checkpoint_id)
            if all(str(p).rstrip("/") == path for p in self.fs.ls(path)):
                self.fs.call_s3(
                    "delete_object", Bucket=self.bucket, Key=self._key(checkpoint_id) + "/"
                )
        except FileNotFoundError:
            pass

    def _put_manifest(self, checkpoint_id: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(checkpoint_id, "manifest.json"), data)

    def _owner_entries(self, label: str, uid: int, limit: int | None) -> list[str]:
        if limit is None:
            return super()._owner_entries(label, uid, limit)
        prefix = self._key(INDEX_DIR, label, str(uid)) + "/"
        page = self.fs.call_s3(
            "list_objects_v2", Bucket=self.bucket, Prefix=prefix, MaxKeys=max(limit, 1)
        )
        return [posixpath.basename(item["Key"]) for item in page.get("Contents", [])]

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def abandoned_uploads(
        self, idle_s: float, now: datetime | None = None
    ) -> list[tuple[str, str]]:
        """Multipart uploads under this store's prefix started more than `idle_s` ago:
        (key, upload id) pairs. A dump's uploads finish within its publish."""
        now = now or datetime.now(UTC)
        found = []
        marker: dict[str, str] = {}
        while True:
            page = self.fs.call_s3(
                "list_multipart_uploads",
                Bucket=self.bucket,
                Prefix=self._key() + "/" if self.prefix else "",
                **marker,
            )
            for upload in page.get("Uploads", []):
                started = upload["Initiated"]
                if (now - started).total_seconds() >= idle_s:
                    found.append((upload["Key"], upload["UploadId"]))
            if not page.get("IsTruncated"):
                return found
            marker = {
                "KeyMarker": page["NextKeyMarker"],
                "UploadIdMarker": page["NextUploadIdMarker"],
            }

    def checkpoint_of(self, key: str) -> str | None:
        """The checkpoint whose file an object key (from `abandoned_uploads`) names."""
        rest = key[len(self._key()) + 1 :] if self.prefix else key
        first = rest.split("/", 1)[0]
        return first if is_checkpoint_id(first) else None

    def abort_upload(self, key: str, upload_id: str) -> None:
        self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=key, UploadId=upload_id)

    def abort_abandoned_uploads(self, idle_s: float, now: datetime, alive: set[str]) -> list[str]:
        aborted = []
        for key, upload_id in self.abandoned_uploads(idle_s, now):
            if self.checkpoint_of(key) in alive:
                continue  # its publish is alive, only slow: it ends the upload
            self.abort_upload(key, upload_id)
            aborted.append(key)
        return aborted

    def describe(self, e: BaseException) -> str | None:
        return describe(e, self.where)


@contextmanager
def _writing(output: MultipartOutput) -> Iterator[MultipartOutput]:
    try:
        yield output
    except BaseException:
        output.discard()
        raise
    output.close()


def describe(e: BaseException, where: str) -> str | None:
    """A line saying what an s3fs/botocore error means for a user, or None to use its own."""
    text = str(e)
    if isinstance(e, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text:
        return (
            f"access to {where} denied ({text.splitlines()[0] if text else 'no reason'}): "
            "check the S3 credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or s3_access_key_id and s3_secret_access_key in the config file)"
        )
    if "bucket does not exist" in text or "NoSuchBucket" in text:
        return (
            f"the bucket of {where} does not exist: create it, or point STASIS_STORE "
            "at one that does"
        )
    name = type(e).__name__
    if (
        "EndpointConnectionError" in name
        or "ConnectTimeout" in name
        or "Could not connect" in text
        or "Connect timeout" in text
        or "Connection was closed" in text
    ):
        return (
            f"cannot reach the S3 server of {where} ({text.splitlines()[0]}): is it up, "
            "and is the endpoint (AWS_ENDPOINT_URL or s3_endpoint_url) right?"
        )
    return None
