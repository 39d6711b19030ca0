"""Importing a checkpoint image archive (`stasis import`): whatever the archive holds, the real
unpacker (the child `oci.import_archive` starts) either stores plain image files in the staging
directory or refuses in one line; it writes nothing anywhere else, follows no link in the
archive, and is bounded by the archive's real size. Fuzzed too: the unpacker in-process on
mutated archives."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stasis.errors import UsageError
from stasis.k8s import oci

FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
META = {
    "label": "web",
    "namespace": "shop",
    "name": "web",
    "checkpoint": "20260101T000000Z-abc",
    "command": ["/bin/sh", "-c", "serve"],
    "cwd": "/",
    "criu_version": "4.1",
}


def tar_bytes(*entries: tuple[tarfile.TarInfo, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out.getvalue()


def reg(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def special(
    name: str, kind: bytes, linkname: str = "", major: int = 0, minor: int = 0
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.devmajor, info.devminor = kind, linkname, major, minor
    return info, b""


def diff_tar() -> bytes:
    return tar_bytes(special("data", tarfile.DIRTYPE), reg("data/state", b"state"))


def layer_of(
    *entries: tuple[tarfile.TarInfo, bytes],
    diff: bytes | None = None,
    deleted: Any = ("/etc/gone",),
    meta: Any = None,
) -> bytes:
    base = [
        reg("checkpoint/inventory.img", b"inv"),
        reg("checkpoint/pages-1.img", b"p" * 5000),
        reg("spec.dump", b"{}"),
        reg("config.dump", b"{}"),
        reg("rootfs-diff.tar", diff if diff is not None else diff_tar()),
        reg("deleted.files", json.dumps(list(deleted)).encode()),
        reg("stasis.json", json.dumps(META if meta is None else meta).encode()),
    ]
    return tar_bytes(*base, *entries)


def archive(path: Path, layer: bytes) -> Path:
    oci.write_archive(path, [layer], {"architecture": "amd64", "os": "linux"}, {}, "x")
    return path


@pytest.fixture
def where(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The staging directory, and a directory beside it standing for the rest of the node."""
    into, node = tmp_path / "staging", tmp_path / "node"
    into.mkdir()
    node.mkdir()
    (node / "secret").write_text("the node's\n")
    yield into, node


def node_unchanged(node: Path) -> None:
    assert sorted(os.listdir(node)) == ["secret"]
    assert (node / "secret").read_text() == "the node's\n"


def test_an_archive_comes_back_as_a_checkpoint_s_images(
    tmp_path: Path, where: tuple[Path, Path]
) -> None:
    into, _ = where
    meta = oci.import_archive(archive(tmp_path / "a.tar", layer_of()), into)
    assert meta == META
    assert sorted(os.listdir(into)) == [
        "inventory.img",
        "pages-1.img",
        "rootfs-diff.tar",
        "spec.dump",
    ]
    assert (into / "pages-1.img").read_bytes() == b"p" * 5000
    with tarfile.open(into / "rootfs-diff.tar") as diff:
        members = {m.name: m for m in diff.getmembers()}
    assert members["data/state"].isreg()
    assert members["etc/gone"].ischr() and members["etc/gone"].devmajor == 0  # a whiteout


def test_an_exported_checkpoint_imports_again(tmp_path: Path, where: tuple[Path, Path]) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "inventory.img").write_bytes(b"inv")
    (images / "spec.dump").write_bytes(b"{}")
    (images / "rootfs-diff.tar").write_bytes(
        tar_bytes(reg("kept", b"k"), special("gone", tarfile.CHRTYPE))
    )
    out = tmp_path / "exported.tar"
    oci.export_checkpoint(
        images,
        ["inventory.img", "spec.dump", "rootfs-diff.tar"],
        {"label": "web", "namespace": "shop"},
        out,
    )
    into, _ = where
    assert oci.import_archive(out, into)["namespace"] == "shop"
    with tarfile.open(into / "rootfs-diff.tar") as diff:
        assert sorted(diff.getnames()) == ["gone", "kept"]


def tamper_layer(path: Path) -> None:
    """One byte of the layer blob changed, the manifest left as it was."""
    with tarfile.open(path) as tar:
        blob = max(
            (m for m in tar.getmembers() if m.name.startswith("blobs/")), key=lambda m: m.size
        )
    data = bytearray(path.read_bytes())
    data[blob.offset_data + blob.size // 2] ^= 0x01
    path.write_bytes(bytes(data))


HOSTILE: dict[str, tuple[bytes, str]] = {
    "dot-dot image": (layer_of(reg("checkpoint/../../../node/secret", b"pwned")), "'..'"),
    "absolute entry": (layer_of(reg("/etc/cron.d/pwned", b"pwned")), "absolute"),
    "image named like the store's": (
        layer_of(reg("checkpoint/manifest.json", b"{}")),
        "not a name CRIU gives",
    ),
    "image named like the diff": (
        layer_of(reg("checkpoint/rootfs-diff.tar", b"")),
        "not a name CRIU gives",
    ),
    "device node in the diff": (
        layer_of(diff=tar_bytes(special("dev/sda", tarfile.BLKTYPE, major=8, minor=0))),
        "block device node (8:0)",
    ),
    "hard link out in the diff": (
        layer_of(diff=tar_bytes(special("passwd", tarfile.LNKTYPE, "../../../etc/passwd"))),
        "points out of the root",
    ),
    "deletion out": (layer_of(deleted=["/../../etc/passwd"]), "'..'"),
    "deletions not a list": (layer_of(deleted={"a": 1}.items()), "not a list of paths"),
    "stasis.json a list": (layer_of(meta=[1, 2]), "not a JSON object"),
    "a file twice": (layer_of(reg("checkpoint/inventory.img", b"again")), "twice"),
    "a diff that is no tar": (layer_of(diff=b"\x00" * 100 + b"junk"), "rootfs-diff.tar"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_archive_is_refused_in_one_line(
    tmp_path: Path, where: tuple[Path, Path], kind: str
) -> None:
    into, node = where
    layer, why = HOSTILE[kind]
    with pytest.raises(UsageError) as e:
        oci.import_archive(archive(tmp_path / "hostile.tar", layer), into)
    msg = str(e.value)
    assert "\n" not in msg and "is not an OCI image archive stasis can import" in msg, msg
    assert why in msg, msg
    node_unchanged(node)
    assert not list(into.glob(".*"))  # no leftover of the raw diff


def test_links_in_the_layer_are_never_followed_or_written(
    tmp_path: Path, where: tuple[Path, Path]
) -> None:
    into, node = where
    layer = layer_of(
        special("checkpoint/pages-2.img", tarfile.SYMTYPE, str(node / "secret")),
        special("checkpoint/pages-3.img", tarfile.LNKTYPE, "spec.dump"),
        special("checkpoint", tarfile.SYMTYPE, str(node)),
    )
    oci.import_archive(archive(tmp_path / "links.tar", layer), into)
    assert "pages-2.img" not in os.listdir(into) and "pages-3.img" not in os.listdir(into)
    for name in os.listdir(into):
        assert (into / name).is_file() and not (into / name).is_symlink()
    node_unchanged(node)


def test_a_layer_that_does_not_match_its_digest_is_refused(
    tmp_path: Path, where: tuple[Path, Path]
) -> None:
    path = archive(tmp_path / "tampered.tar", layer_of())
    tamper_layer(path)
    with pytest.raises(UsageError, match="its layer does not match its digest"):
        oci.import_archive(path, where[0])


def test_sizes_the_archive_claims_are_checked_against_what_it_holds(
    tmp_path: Path, where: tuple[Path, Path]
) -> None:
    into, _ = where
    # An entry claiming a petabyte: refused from its header, nothing read or allocated.
    huge = tarfile.TarInfo("checkpoint/pages-9.img")
    huge.size = 1 << 50
    head = huge.tobuf(tarfile.PAX_FORMAT)
    with pytest.raises(UsageError, match="more than the .* bytes free"):
        oci.import_archive(archive(tmp_path / "huge.tar", head + b"\0" * 1024), into)
    # An index.json of more than a MiB.
    big = tmp_path / "big-index.tar"
    with tarfile.open(big, "w") as tar:
        data = json.dumps({"manifests": [], "pad": "x" * (2 << 20)}).encode()
        info = tarfile.TarInfo("index.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(UsageError, match="more than 1048576"):
        oci.import_archive(big, into)


def test_what_is_not_an_archive_is_refused_without_hanging(
    tmp_path: Path, where: tuple[Path, Path]
) -> None:
    into, _ = where
    fifo = tmp_path / "fifo.tar"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="not a regular file"):
        oci.import_archive(fifo, into, timeout_s=20)
    gz = tmp_path / "a.tar.gz"
    gz.write_bytes(gzip.compress(archive(tmp_path / "plain.tar", layer_of()).read_bytes()))
    with pytest.raises(UsageError, match="uncompressed"):
        oci.import_archive(gz, into)


def test_a_gzip_layer_as_registries_keep_them_imports(
    tmp_path: Path, where: tuple[Path, Path]
) -> None:
    layer = gzip.compress(layer_of(), mtime=0)
    digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    path = archive(tmp_path / "gz.tar", layer)
    # write_archive calls every layer a plain tar: rewrite the manifest's media type.
    with tarfile.open(path) as tar:
        blobs = {
            m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isreg()
        }
    index = json.loads(blobs["index.json"])
    mname = "blobs/sha256/" + index["manifests"][0]["digest"].split(":")[1]
    manifest = json.loads(blobs.pop(mname))
    manifest["layers"][0]["mediaType"] = "application/vnd.oci.image.layer.v1.tar+gzip"
    assert manifest["layers"][0]["digest"] == digest
    mdata = json.dumps(manifest).encode()
    mdigest = hashlib.sha256(mdata).hexdigest()
    index["manifests"][0]["digest"] = f"sha256:{mdigest}"
    blobs["index.json"] = json.dumps(index).encode()
    blobs[f"blobs/sha256/{mdigest}"] = mdata
    with tarfile.open(path, "w") as tar:
        for name, data in blobs.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert oci.import_archive(path, where[0])["label"] == "web"


# -- fuzzing -------------------------------------------------------------------------------


def _valid_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        return archive(Path(d) / "valid.tar", layer_of()).read_bytes()


_VALID_BYTES = _valid_bytes()


@FUZZ
@given(
    cuts=st.lists(
        st.tuples(st.integers(0, len(_VALID_BYTES) - 1), st.integers(0, 255)), max_size=8
    ),
    truncate=st.none() | st.integers(0, len(_VALID_BYTES)),
)
def test_a_mutated_archive_is_imported_or_refused_never_anything_else(
    tmp_path: Path, cuts: list[tuple[int, int]], truncate: int | None
) -> None:
    data = bytearray(_VALID_BYTES)
    for at, value in cuts:
        data[at] = value
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        base = Path(d)
        src, into, node = base / "a.tar", base / "into", base / "node"
        into.mkdir()
        node.mkdir()
        src.write_bytes(bytes(data[:truncate]))
        try:
            meta = oci.unpack(src, into)
        except oci.BadArchive as e:
            assert "\n" not in str(e)
        else:
            assert isinstance(meta, dict)
        assert os.listdir(node) == []
        for name in os.listdir(into):
            assert (into / name).is_file() and not (into / name).is_symlink()
