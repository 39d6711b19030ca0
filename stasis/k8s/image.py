"""The node agent's container image as an OCI image archive (`make image`): a root filesystem
(scripts/build-image.sh assembles it from Debian packages and this repository) packed as one
gzip layer, streamed, so that a few hundred MB never sit in memory.

    python -m stasis.k8s.image ROOT OUT.tar REF [--version V]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from stasis.k8s.oci import CONFIG_TYPE, MANIFEST_TYPE

GZIP_LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Blob:
    path: Path
    digest: str
    size: int


def pack_layer(root: Path, out: Path) -> tuple[Blob, str]:
    """`root` as a gzip'd tar (GNU tar: owners, modes, hard links, capabilities and xattrs as
    they are); the blob and the uncompressed tar's digest (the config's diff_id)."""
    raw = hashlib.sha256()
    tar = subprocess.Popen(
        [
            "tar",
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=*",
            "--sort=name",
            "-C",
            str(root),
            "-cf",
            "-",
            ".",
        ],
        stdout=subprocess.PIPE,
    )
    assert tar.stdout is not None
    with out.open("wb") as f:
        # mtime=0 and no name: the same tree gives the same bytes.
        with gzip.GzipFile(fileobj=f, mode="wb", compresslevel=6, mtime=0) as gz:
            while chunk := tar.stdout.read(_CHUNK):
                raw.update(chunk)
                gz.write(chunk)
    if tar.wait() != 0:
        raise RuntimeError(f"tar of {root} failed ({tar.returncode})")
    return _blob(out), "sha256:" + raw.hexdigest()


def _blob(path: Path) -> Blob:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return Blob(path, "sha256:" + h.hexdigest(), path.stat().st_size)


def write_image(
    root: Path, out: Path, ref: str, config: dict[str, Any], annotations: dict[str, str]
) -> str:
    """An OCI image archive of `root` (one layer) named `ref`; its manifest's digest.

    The parts are written in a directory made new (mkdtemp: 0700, never one that was there,
    which another user could have filled with symlinks where `out` is in a shared directory)
    and the archive is renamed over `out` from there."""
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        layer, diff_id = pack_layer(root, work / "layer")
        cfg = {**config, "rootfs": {"type": "layers", "diff_ids": [diff_id]}}
        cfg_blob = _write(work / "config", json.dumps(cfg, sort_keys=True).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": {"mediaType": CONFIG_TYPE, "digest": cfg_blob.digest, "size": cfg_blob.size},
            "layers": [{"mediaType": GZIP_LAYER_TYPE, "digest": layer.digest, "size": layer.size}],
            "annotations": annotations,
        }
        man_blob = _write(work / "manifest", json.dumps(manifest, sort_keys=True).encode())
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": MANIFEST_TYPE,
                    "digest": man_blob.digest,
                    "size": man_blob.size,
                    "annotations": {"org.opencontainers.image.ref.name": ref},
                }
            ],
        }
        index_blob = _write(work / "index.json", json.dumps(index).encode())
        layout = _write(work / "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        tmp = work / "archive.tar"
        with tarfile.open(tmp, "w") as tar:
            tar.add(layout.path, "oci-layout")
            tar.add(index_blob.path, "index.json")
            for b in (cfg_blob, man_blob, layer):
                tar.add(b.path, "blobs/sha256/" + b.digest.removeprefix("sha256:"))
        tmp.replace(out)
        return man_blob.digest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write(path: Path, data: bytes) -> Blob:
    path.write_bytes(data)
    return Blob(path, "sha256:" + hashlib.sha256(data).hexdigest(), len(data))


def agent_config(version: str) -> dict[str, Any]:
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": {
            "Env": [
                "PATH=/opt/stasis/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:"
                "/usr/bin:/sbin:/bin",
                "LANG=C.UTF-8",
            ],
            "Entrypoint": ["/opt/stasis/venv/bin/stasis"],
            "Cmd": ["k8s", "agent"],
            "Labels": {
                "org.opencontainers.image.title": "stasis node agent",
                "org.opencontainers.image.version": version,
            },
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m stasis.k8s.image")
    p.add_argument("root", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("ref")
    p.add_argument("--version", required=True)
    a = p.parse_args()
    digest = write_image(
        a.root,
        a.out.absolute(),
        a.ref,
        agent_config(a.version),
        {"org.opencontainers.image.version": a.version, "org.opencontainers.image.ref.name": a.ref},
    )
    os.chmod(a.out, 0o644)
    print(f"{a.out}: {a.ref} ({digest}, {a.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
