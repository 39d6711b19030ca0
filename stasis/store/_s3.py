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
"""

from __future__ import annotations

import posixpath
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from stasis.errors import StoreError
from stasis.store._remote import RemoteTree
from stasis.store.index import INDEX_DIR

# fsspec's S3 options that make it fit a store several nodes share (see the module docstring).
# Timeouts and retries: a server that is gone must fail a dump in seconds, not minutes (botocore's
# defaults retried a refused connection for over two minutes).
SHARED_OPTIONS: dict[str, Any] = {
    "use_listings_cache": False,
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                      "retries": {"max_attempts": 1}},
}


class S3Tree(RemoteTree):
    def __init__(self, fs: Any, root: str, where: str, staging_root: Path) -> None:
        super().__init__(fs, root, where, staging_root)
        self.bucket, _, self.prefix = self.root.partition("/")
        self._bucket_seen = False

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

    def remove(self, checkpoint_id: str) -> None:
        super().remove(checkpoint_id)
        # Servers built on a filer (SeaweedFS) keep an emptied "directory" listed until its
        # own key goes; on AWS this deletes a key that does not exist, which is no error.
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self._key(checkpoint_id) + "/")
        except Exception:
            pass  # it only stays listed, as a checkpoint without a manifest

    def _put_manifest(self, checkpoint_id: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(checkpoint_id, "manifest.json"), data)

    def _owner_entries(self, label: str, uid: int, limit: int | None) -> list[str]:
        if limit is None:
            return super()._owner_entries(label, uid, limit)
        prefix = self._key(INDEX_DIR, label, str(uid)) + "/"
        page = self.fs.call_s3("list_objects_v2", Bucket=self.bucket, Prefix=prefix,
                               MaxKeys=max(limit, 1))
        return [posixpath.basename(item["Key"]) for item in page.get("Contents", [])]

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def abandoned_uploads(self, idle_s: float, now: datetime | None = None
                          ) -> list[tuple[str, str]]:
        """Multipart uploads under this store's prefix started more than `idle_s` ago:
        (key, upload id) pairs. A dump's uploads finish within its publish."""
        now = now or datetime.now(UTC)
        found = []
        marker: dict[str, str] = {}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", Bucket=self.bucket,
                                   Prefix=self._key() + "/" if self.prefix else "", **marker)
            for upload in page.get("Uploads", []):
                started = upload["Initiated"]
                if (now - started).total_seconds() >= idle_s:
                    found.append((upload["Key"], upload["UploadId"]))
            if not page.get("IsTruncated"):
                return found
            marker = {"KeyMarker": page["NextKeyMarker"],
                      "UploadIdMarker": page["NextUploadIdMarker"]}

    def abort_upload(self, key: str, upload_id: str) -> None:
        self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=key,
                        UploadId=upload_id)


def describe(e: BaseException, where: str) -> str | None:
    """A line saying what an s3fs/botocore error means for a user, or None to use its own."""
    text = str(e)
    if isinstance(e, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text:
        return (f"access to {where} denied ({text.splitlines()[0] if text else 'no reason'}): "
                "check the S3 credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or s3_access_key_id and s3_secret_access_key in the config file)")
    if "bucket does not exist" in text or "NoSuchBucket" in text:
        return (f"the bucket of {where} does not exist: create it, or point STASIS_STORE "
                "at one that does")
    name = type(e).__name__
    if "EndpointConnectionError" in name or "ConnectTimeout" in name or \
            "Could not connect" in text or "Connect timeout" in text or \
            "Connection was closed" in text:
        return (f"cannot reach the S3 server of {where} ({text.splitlines()[0]}): is it up, "
                "and is the endpoint (AWS_ENDPOINT_URL or s3_endpoint_url) right?")
    return None
