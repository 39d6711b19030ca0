"""Checkpoints as OCI image archives, in the layout CRI-O and Podman use for checkpoint images:
one layer holding `checkpoint/` (CRIU's images), `spec.dump` (the container's OCI spec),
`config.dump`, `rootfs-diff.tar` (the writable layer, deletions listed in `deleted.files`
instead of overlay whiteouts) and `stasis.json` (label and namespace), with the annotations
those tools look for on the image manifest. `stasis export --oci` / `stasis import`.

An archive to import is anyone's bytes: it is unpacked by a bounded child, never extracted as
a tree (see "import" below), and its writable layer is checked as a restore will check it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, cast

from stasis.errors import UsageError
from stasis.fdio import create_new
from stasis.k8s import child, confined, rootfs
from stasis.store.manifest import is_safe_file_name

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
# CRI-O's (and Podman's) names for a checkpoint image's metadata.
NAME_ANNOTATIONS = (
    "io.kubernetes.cri-o.annotations.checkpoint.name",
    "org.criu.checkpoint.container.name",
)
STASIS_JSON = "stasis.json"
SPEC_DUMP = "spec.dump"
_RW_DIFF = "rootfs-diff.tar"
_DELETED = "deleted.files"


def write_archive(
    out: Path, layers: list[bytes], config: dict[str, Any], annotations: dict[str, str], ref: str
) -> str:
    """Write an OCI image archive (a tar of an OCI layout); the manifest's digest."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> tuple[str, int]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest, len(data)

    config = {
        **config,
        "rootfs": {
            "type": "layers",
            "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest() for layer in layers],
        },
    }
    config_digest, config_size = blob(json.dumps(config, sort_keys=True).encode())
    layer_refs = []
    for layer in layers:
        digest, size = blob(layer)
        layer_refs.append({"mediaType": LAYER_TYPE, "digest": digest, "size": size})
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": config_size},
        "layers": layer_refs,
        "annotations": annotations,
    }
    manifest_digest, manifest_size = blob(json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": MANIFEST_TYPE,
                "digest": manifest_digest,
                "size": manifest_size,
                "annotations": {"org.opencontainers.image.ref.name": ref},
            }
        ],
    }
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


def export_checkpoint(images: Path, names: list[str], meta: dict[str, Any], out: Path) -> Exported:
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
        _add_bytes(
            tar,
            "config.dump",
            json.dumps(
                {
                    "id": meta.get("container_id", ""),
                    "name": meta.get("name") or meta["label"],
                    "rootfsImageName": meta.get("image", ""),
                    "createdTime": created,
                    "checkpointedTime": created,
                    "runtime": "runc",
                    "engine": "stasis",
                }
            ).encode(),
        )
        _add_bytes(tar, STASIS_JSON, json.dumps(meta).encode())
    annotations = {key: str(meta.get("name") or meta["label"]) for key in NAME_ANNOTATIONS}
    annotations.update(
        {
            "io.kubernetes.cri-o.annotations.checkpoint.namespace": str(meta.get("namespace", "")),
            "org.criu.checkpoint.engine.name": "stasis",
            "dev.stasis.checkpoint.label": str(meta["label"]),
            "dev.stasis.checkpoint.id": str(meta.get("checkpoint", "")),
        }
    )
    data = layer.getvalue()
    digest = write_archive(
        out,
        [data],
        {"architecture": "amd64", "os": "linux"},
        annotations,
        f"checkpoint-{meta['label']}",
    )
    return Exported(digest=digest, size_bytes=out.stat().st_size)


def _to_deleted_files(diff: Path) -> tuple[bytes, list[str]]:
    """Our overlay-style diff (whiteouts as 0:0 character devices) as CRI-O's: the same tar
    without the whiteouts, and their paths as a list."""
    out = io.BytesIO()
    deleted: list[str] = []
    with (
        tarfile.open(diff) as src,
        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst,
    ):
        for m in src:
            if m.ischr() and m.devmajor == 0 and m.devminor == 0:
                deleted.append("/" + m.name.lstrip("./"))
                continue
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    return out.getvalue(), deleted


# -- import --------------------------------------------------------------------------------
# An archive to import comes from anywhere (another cluster, a registry, a tenant's hands): it is
# read by a child (`python -I -m stasis.k8s.oci import ARCHIVE INTO`) with a bounded address
# space and time, so that whatever its bytes make the parser do costs this one import; only
# its blobs are read, each bounded (JSON to MAX_JSON_BYTES, the layer's entries to
# MAX_LAYER_ENTRIES and its bytes to the space free where they go), the layer hashed as it is
# read and refused when its digest differs; nothing is extracted but plain files with plain
# names, created new (O_EXCL|O_NOFOLLOW) in the private staging directory.
MAX_ARCHIVE_ENTRIES = 10_000
MAX_LAYER_ENTRIES = 100_000
MAX_JSON_BYTES = 1 << 20
MAX_DELETED_BYTES = 64 << 20
_GZIP_TYPES = (
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
)
_TAR_TYPES = (LAYER_TYPE, "application/vnd.docker.image.rootfs.diff.tar")
_META_STRINGS = (
    "label",
    "namespace",
    "name",
    "checkpoint",
    "container_id",
    "user",
    "created",
    "cwd",
    "criu_version",
    "image",
)
_RAW_DIFF = ".rootfs-diff.import"
_BAD_EXIT, _FAILED_EXIT = 3, 4
_CHUNK = 1 << 20


class BadArchive(Exception):
    """The archive is not one stasis imports; why, in one line."""


def import_archive(archive: Path, into: Path, timeout_s: float = 1800.0) -> dict[str, Any]:
    """Unpack a checkpoint image archive's layer into `into` as stasis stores a checkpoint's
    images (flat; the diff with whiteouts again); the metadata of stasis.json, or {}.
    UsageError, one line, when the archive is not one (nothing kept: the caller discards
    `into`)."""
    try:
        r = child.run_module("stasis.k8s.oci", ["import", str(archive), str(into)], timeout_s)
    except subprocess.TimeoutExpired as e:
        raise UsageError(
            f"cannot import {archive}: unpacking it took more than " f"{timeout_s:.0f} s"
        ) from e
    except OSError as e:
        raise UsageError(f"cannot import {archive}: {e}") from e
    if r.returncode == 0:
        try:
            meta = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError) as e:
            raise UsageError(f"cannot import {archive}: its unpacker said nothing") from e
        return meta if isinstance(meta, dict) else {}
    line = child.last_line(r)
    if r.returncode == _BAD_EXIT:
        raise UsageError(
            f"{archive} is not an OCI image archive stasis can import: {line} "
            "(give an uncompressed archive of one checkpoint image, as `stasis "
            "export --oci`, CRI-O or Podman write it)"
        )
    raise UsageError(f"cannot import {archive}: {line}")


def unpack(archive: Path, into: Path) -> dict[str, Any]:
    """In the child (or a test): what `import_archive` does; BadArchive when the archive is not
    one, OSError when writing failed."""
    try:
        fd = os.open(archive, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise BadArchive(f"cannot open it: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadArchive("it is not a regular file")
        blobs = _members(f, st.st_size)
        index = _object(_json(fd, blobs, "index.json"), "index.json")
        manifests = index.get("manifests")
        if not isinstance(manifests, list) or not manifests:
            raise BadArchive("its index.json lists no manifest")
        digest = _digest_of(manifests[0], "the index's first manifest")
        manifest = _object(_json(fd, blobs, _blob_name(digest), digest), "its manifest")
        layers = manifest.get("layers")
        if not isinstance(layers, list) or len(layers) != 1:
            n = len(layers) if isinstance(layers, list) else 0
            raise BadArchive(f"a checkpoint image has one layer, this one {n}")
        layer = _object(layers[0], "its layer")
        layer_digest = _digest_of(layer, "its layer")
        media = layer.get("mediaType", LAYER_TYPE)
        if media not in _TAR_TYPES + _GZIP_TYPES:
            raise BadArchive(f"its layer is of type {str(media)[:100]!r}, not a tar")
        offset, size = _blob(blobs, _blob_name(layer_digest))
        if "size" in layer and layer["size"] != size:
            raise BadArchive("its layer's size is not the manifest's")
        reader = _Verified(fd, offset, size)
        into_fd = os.open(into, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            kept = _unpack_layer(reader, media in _GZIP_TYPES, into_fd, into)
            reader.finish(layer_digest)
            if _RAW_DIFF in kept:
                _rebuild_diff(into_fd, into, _deleted(kept.get(_DELETED)))
            return _meta(kept.get(STASIS_JSON))
        finally:
            try:
                os.unlink(_RAW_DIFF, dir_fd=into_fd)
            except FileNotFoundError:
                pass
            os.close(into_fd)


def _members(f: BinaryIO, end: int) -> dict[str, tuple[int, int]]:
    """The archive's plain files: name -> (offset of the data, size)."""
    found: dict[str, tuple[int, int]] = {}
    try:
        tar = tarfile.open(fileobj=f, mode="r:")
        for count in range(MAX_ARCHIVE_ENTRIES + 1):
            m = tar.next()
            tar.members.clear()  # type: ignore[attr-defined]  # (typeshed lacks it)
            if m is None:
                return found
            if m.isreg():
                if m.offset_data + m.size > end:
                    raise BadArchive(f"{m.name[:100]!r} ends past the end of the archive")
                found[m.name.removeprefix("./")] = (m.offset_data, m.size)
    except BadArchive:
        raise
    except Exception as e:  # whatever the bytes make tarfile raise
        raise BadArchive(f"not a readable (uncompressed) tar: {child.short(e)}") from None
    raise BadArchive(f"more than {MAX_ARCHIVE_ENTRIES} entries")


def _blob(blobs: dict[str, tuple[int, int]], name: str) -> tuple[int, int]:
    if name not in blobs:
        raise BadArchive(f"it has no {name}")
    return blobs[name]


def _json(fd: int, blobs: dict[str, tuple[int, int]], name: str, digest: str | None = None) -> Any:
    offset, size = _blob(blobs, name)
    if size > MAX_JSON_BYTES:
        raise BadArchive(f"its {name} is {size} bytes, more than {MAX_JSON_BYTES}")
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise BadArchive("it changed while it was read")
    if digest is not None and "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise BadArchive(f"its {name} does not match its digest")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise BadArchive(f"its {name} is not JSON: {child.short(e)}") from None


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadArchive(f"{what} is not a JSON object")
    return value


def _digest_of(desc: Any, what: str) -> str:
    digest = _object(desc, what).get("digest")
    if not isinstance(digest, str):
        raise BadArchive(f"{what} has no digest")
    _blob_name(digest)
    return digest


class _Verified:
    """The bytes [offset, offset + size) of `fd`, hashed as they are read: the digest checked
    at the end is that of the bytes the layer was unpacked from."""

    def __init__(self, fd: int, offset: int, size: int) -> None:
        self.fd, self.pos, self.end = fd, offset, offset + size
        self.hash = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        left = self.end - self.pos
        n = left if n is None or n < 0 else min(n, left)
        if n <= 0:
            return b""
        data = os.pread(self.fd, n, self.pos)
        if not data:
            raise BadArchive("it changed while it was read")
        self.pos += len(data)
        self.hash.update(data)
        return data

    def finish(self, digest: str) -> None:
        while self.read(_CHUNK):
            pass
        if "sha256:" + self.hash.hexdigest() != digest:
            raise BadArchive("its layer does not match its digest")


def _unpack_layer(reader: _Verified, gzipped: bool, into_fd: int, into: Path) -> dict[str, bytes]:
    """Images into `into`; the small files stasis reads (stasis.json, deleted.files) returned,
    and _RAW_DIFF as a key when the layer had a rootfs-diff.tar (written beside the images)."""
    free = os.statvfs(into)
    room = free.f_bavail * free.f_frsize
    kept: dict[str, bytes] = {}
    total = 0
    try:
        tar = tarfile.open(fileobj=cast(BinaryIO, reader), mode="r|gz" if gzipped else "r|")
        for count in range(MAX_LAYER_ENTRIES + 1):
            m = tar.next()
            tar.members.clear()  # type: ignore[attr-defined]
            if m is None:
                return kept
            total += max(m.size, 0)
            if total > room:
                raise BadArchive(
                    f"its layer unpacks to more than the {room} bytes free in " f"{into}"
                )
            if not m.isreg():
                continue
            try:
                parts = confined.split(m.name)
            except ValueError as e:
                raise BadArchive(f"its layer's entry {m.name[:100]!r} has {e}") from None
            if len(parts) == 2 and parts[0] == "checkpoint":
                name = parts[1]
                if not is_safe_file_name(name) or name in (SPEC_DUMP, _RW_DIFF, _RAW_DIFF):
                    raise BadArchive(
                        f"its layer's entry {m.name[:100]!r} is not a name " "CRIU gives an image"
                    )
                _write(tar, m, into_fd, name)
            elif parts == (SPEC_DUMP,):
                _write(tar, m, into_fd, SPEC_DUMP)
            elif parts == (_RW_DIFF,):
                _write(tar, m, into_fd, _RAW_DIFF)
                kept[_RAW_DIFF] = b""
            elif parts in ((STASIS_JSON,), (_DELETED,)):
                limit = MAX_JSON_BYTES if parts == (STASIS_JSON,) else MAX_DELETED_BYTES
                if m.size > limit or parts[0] in kept:
                    raise BadArchive(
                        f"its {parts[0]} is larger than {limit} bytes or twice " "in it"
                    )
                src = tar.extractfile(m)
                kept[parts[0]] = src.read(m.size) if src is not None else b""
            # Anything else (config.dump, CRI-O's other files) is not used, never written.
    except (BadArchive, OSError):
        raise
    except Exception as e:  # whatever the bytes make tarfile or zlib raise
        raise BadArchive(f"its layer is not a readable tar: {child.short(e)}") from None
    raise BadArchive(f"its layer has more than {MAX_LAYER_ENTRIES} entries")


def _write(tar: tarfile.TarFile, m: tarfile.TarInfo, into_fd: int, name: str) -> None:
    try:
        fd = create_new(name, into_fd)
    except FileExistsError:
        raise BadArchive(f"its layer holds {m.name[:100]!r} twice") from None
    try:
        if not rootfs.copy_member(tar, m, fd):
            raise BadArchive(f"its layer ends inside {m.name[:100]!r}")
    finally:
        os.close(fd)


def _deleted(raw: bytes | None) -> list[str]:
    if raw is None:
        return []
    try:
        paths = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadArchive(f"its {_DELETED} is not JSON: {child.short(e)}") from None
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise BadArchive(f"its {_DELETED} is not a list of paths")
    if len(paths) > MAX_LAYER_ENTRIES:
        raise BadArchive(f"its {_DELETED} lists more than {MAX_LAYER_ENTRIES} paths")
    return paths


def _rebuild_diff(into_fd: int, into: Path, deleted: list[str]) -> None:
    """CRI-O's diff (deletions listed apart) as ours (whiteouts), checked entry by entry as a
    restore will check it: a diff that a restore would refuse is refused now."""
    fd = os.open(_RAW_DIFF, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=into_fd)
    out = os.open(
        _RW_DIFF,
        os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=into_fd,
    )
    with os.fdopen(fd, "rb") as src_f, os.fdopen(out, "w+b") as dst_f:
        try:
            with (
                tarfile.open(fileobj=src_f, mode="r:") as src,
                tarfile.open(fileobj=dst_f, mode="w", format=tarfile.PAX_FORMAT) as dst,
            ):
                for _ in range(MAX_LAYER_ENTRIES + 1):
                    m = src.next()
                    src.members.clear()  # type: ignore[attr-defined]
                    if m is None:
                        break
                    dst.addfile(m, src.extractfile(m) if m.isreg() else None)
                else:
                    raise BadArchive(f"its {_RW_DIFF} has more than {MAX_LAYER_ENTRIES} entries")
                for path in deleted:
                    w = tarfile.TarInfo(path.lstrip("/"))
                    w.type, w.devmajor, w.devminor = tarfile.CHRTYPE, 0, 0
                    dst.addfile(w)
        except (BadArchive, OSError):
            raise
        except Exception as e:
            raise BadArchive(f"its {_RW_DIFF} is not a readable tar: {child.short(e)}") from None
        try:
            rootfs.Layer(dst_f).scan()
        except rootfs.Refused as e:
            raise BadArchive(f"its {_RW_DIFF}: {e}") from None


def _meta(raw: bytes | None) -> dict[str, Any]:
    """stasis.json, only the keys an import reads, each of the type it reads."""
    if raw is None:
        return {}
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadArchive(f"its {STASIS_JSON} is not JSON: {child.short(e)}") from None
    obj = _object(obj, f"its {STASIS_JSON}")
    meta: dict[str, Any] = {k: obj[k][:4096] for k in _META_STRINGS if isinstance(obj.get(k), str)}
    command = obj.get("command")
    if isinstance(command, list) and all(isinstance(a, str) for a in command):
        meta["command"] = [a[:65536] for a in command[:4096]]
    return meta


def _blob_name(digest: str) -> str:
    algo, _, hexdigest = digest.partition(":")
    if (
        algo != "sha256"
        or len(hexdigest) != 64
        or not all(c in "0123456789abcdef" for c in hexdigest)
    ):
        raise BadArchive(f"unexpected digest {digest[:100]!r}")
    return f"blobs/sha256/{hexdigest}"


def _main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "import":
        print("usage: python -I -m stasis.k8s.oci import ARCHIVE INTO", file=sys.stderr)
        return 2
    child.confine_self()
    try:
        meta = unpack(Path(argv[1]), Path(argv[2]))
    except BadArchive as e:
        print(e, file=sys.stderr)
        return _BAD_EXIT
    except OSError as e:
        print(f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}", file=sys.stderr)
        return _FAILED_EXIT
    except Exception as e:  # a bug of ours, or bytes nobody foresaw: one line, one import
        print(f"{type(e).__name__}: {child.short(e)}", file=sys.stderr)
        return _BAD_EXIT
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
