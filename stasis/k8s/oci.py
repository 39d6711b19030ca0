"""Checkpoints as OCI image archives, in the layout CRI-O and Podman use for checkpoint images:
one layer holding `checkpoint/` (CRIU's images), `spec.dump` (the container's OCI spec),
`config.dump`, `rootfs-diff.tar` (the writable layer, deletions listed in `deleted.files`
instead of overlay whiteouts) and `stasis.json` (label and namespace), with the annotations
those tools look for on the image manifest. `stasis export --oci` / `stasis import`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from stasis.errors import UsageError

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
# CRI-O's (and Podman's) names for a checkpoint image's metadata.
NAME_ANNOTATIONS = ("io.kubernetes.cri-o.annotations.checkpoint.name",
                    "org.criu.checkpoint.container.name")
STASIS_JSON = "stasis.json"
SPEC_DUMP = "spec.dump"
_RW_DIFF = "rootfs-diff.tar"
_DELETED = "deleted.files"


def write_archive(out: Path, layers: list[bytes], config: dict[str, Any],
                  annotations: dict[str, str], ref: str) -> str:
    """Write an OCI image archive (a tar of an OCI layout); the manifest's digest."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> tuple[str, int]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest, len(data)

    config = {**config, "rootfs": {"type": "layers", "diff_ids": [
        "sha256:" + hashlib.sha256(layer).hexdigest() for layer in layers]}}
    config_digest, config_size = blob(json.dumps(config, sort_keys=True).encode())
    layer_refs = []
    for layer in layers:
        digest, size = blob(layer)
        layer_refs.append({"mediaType": LAYER_TYPE, "digest": digest, "size": size})
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE,
                "config": {"mediaType": CONFIG_TYPE, "digest": config_digest,
                           "size": config_size},
                "layers": layer_refs, "annotations": annotations}
    manifest_digest, manifest_size = blob(json.dumps(manifest, sort_keys=True).encode())
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": MANIFEST_TYPE, "digest": manifest_digest, "size": manifest_size,
        "annotations": {"org.opencontainers.image.ref.name": ref}}]}
    tmp = out.with_name(f".{out.name}.tmp")
    # Root's alone: a checkpoint image holds the container's memory in the clear.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w") as tar:
        _add_bytes(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add_bytes(tar, "index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            _add_bytes(tar, "blobs/sha256/" + digest.removeprefix("sha256:"), data)
    tmp.replace(out)
    return manifest_digest


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


@dataclass(frozen=True)
class Exported:
    digest: str
    size_bytes: int


def export_checkpoint(images: Path, names: list[str], meta: dict[str, Any], out: Path
                      ) -> Exported:
    """`images`: a directory of a checkpoint's verified plain images, `names` (the rest of
    the directory is the store's); `meta`: label, namespace, ids..."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for name in sorted(names):
            path = images / name
            if name == _RW_DIFF:
                diff, deleted = _to_deleted_files(path)
                _add_bytes(tar, _RW_DIFF, diff)
                _add_bytes(tar, _DELETED, json.dumps(deleted).encode())
            elif name == SPEC_DUMP:
                tar.add(path, arcname=SPEC_DUMP)
            else:
                tar.add(path, arcname=f"checkpoint/{name}")
        created = meta.get("created") or datetime.now(UTC).isoformat()
        _add_bytes(tar, "config.dump", json.dumps({
            "id": meta.get("container_id", ""), "name": meta.get("name") or meta["label"],
            "rootfsImageName": meta.get("image", ""), "createdTime": created,
            "checkpointedTime": created, "runtime": "runc", "engine": "stasis"}).encode())
        _add_bytes(tar, STASIS_JSON, json.dumps(meta).encode())
    annotations = {key: str(meta.get("name") or meta["label"]) for key in NAME_ANNOTATIONS}
    annotations.update({"io.kubernetes.cri-o.annotations.checkpoint.namespace":
                        str(meta.get("namespace", "")),
                        "org.criu.checkpoint.engine.name": "stasis",
                        "dev.stasis.checkpoint.label": str(meta["label"]),
                        "dev.stasis.checkpoint.id": str(meta.get("checkpoint", ""))})
    data = layer.getvalue()
    digest = write_archive(out, [data], {"architecture": "amd64", "os": "linux"}, annotations,
                           f"checkpoint-{meta['label']}")
    return Exported(digest=digest, size_bytes=out.stat().st_size)


def _to_deleted_files(diff: Path) -> tuple[bytes, list[str]]:
    """Our overlay-style diff (whiteouts as 0:0 character devices) as CRI-O's: the same tar
    without the whiteouts, and their paths as a list."""
    out = io.BytesIO()
    deleted: list[str] = []
    with tarfile.open(diff) as src, tarfile.open(fileobj=out, mode="w",
                                                 format=tarfile.PAX_FORMAT) as dst:
        for m in src:
            if m.ischr() and m.devmajor == 0 and m.devminor == 0:
                deleted.append("/" + m.name.lstrip("./"))
                continue
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    return out.getvalue(), deleted


def import_archive(archive: Path, into: Path) -> dict[str, Any]:
    """Unpack a checkpoint image archive's layer into `into` as stasis stores a checkpoint's
    images (flat; the diff with whiteouts again); the metadata of stasis.json, or {}."""
    with tempfile.TemporaryDirectory(prefix="stasis-import-") as tmp:
        root = Path(tmp)
        try:
            with tarfile.open(archive) as tar:
                index = json.load(_member(tar, "index.json"))
                manifest = json.load(_member(tar, _blob_name(index["manifests"][0]["digest"])))
                layers = manifest["layers"]
                if len(layers) != 1:
                    raise UsageError(f"{archive}: a checkpoint image has one layer, this one "
                                     f"{len(layers)}")
                layer = _member(tar, _blob_name(layers[0]["digest"])).read()
                if "sha256:" + hashlib.sha256(layer).hexdigest() != layers[0]["digest"]:
                    raise UsageError(f"{archive}: its layer does not match its digest")
        except (OSError, tarfile.TarError, ValueError, KeyError, IndexError) as e:
            raise UsageError(f"{archive} is not an OCI image archive: {e}") from e
        with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
            for m in tar:
                name = m.name.lstrip("./")
                if not m.isfile() or "/" in name.removeprefix("checkpoint/") or ".." in name:
                    continue
                data = tar.extractfile(m)
                assert data is not None
                (root / name.replace("/", "_", 1) if name.startswith("checkpoint/")
                 else root / name).write_bytes(data.read())
        meta: dict[str, Any] = {}
        if (root / STASIS_JSON).exists():
            meta = json.loads((root / STASIS_JSON).read_text())
        for f in root.iterdir():
            if f.name.startswith("checkpoint_"):
                shutil.move(str(f), into / f.name.removeprefix("checkpoint_"))
        if (root / SPEC_DUMP).exists():
            shutil.move(str(root / SPEC_DUMP), into / SPEC_DUMP)
        if (root / _RW_DIFF).exists():
            deleted = json.loads((root / _DELETED).read_text()) if (root / _DELETED).exists() \
                else []
            _from_deleted_files(root / _RW_DIFF, deleted, into / _RW_DIFF)
    return meta


def _from_deleted_files(diff: Path, deleted: list[str], out: Path) -> None:
    with tarfile.open(diff) as src, tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as dst:
        for m in src:
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
        for path in deleted:
            w = tarfile.TarInfo(path.lstrip("/"))
            w.type, w.devmajor, w.devminor = tarfile.CHRTYPE, 0, 0
            dst.addfile(w)


def _blob_name(digest: str) -> str:
    algo, _, hexdigest = digest.partition(":")
    if algo != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef"
                                                           for c in hexdigest):
        raise ValueError(f"unexpected digest {digest!r}")
    return f"blobs/sha256/{hexdigest}"


def _member(tar: tarfile.TarFile, name: str) -> io.BufferedReader:
    f = tar.extractfile(name)
    if f is None:
        raise KeyError(name)
    return f  # type: ignore[return-value]
