"""The writable layer of a container on real overlay mounts: captured, put back, and never
written outside the container's root."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.errors import ContainerError
from stasis.k8s import rootfs


class Overlay:
    def __init__(self, base: Path, lower: Path, name: str) -> None:
        self.upper, self.work, self.merged = (base / f"{name}-{d}" for d in ("up", "work", "mnt"))
        for d in (self.upper, self.work, self.merged):
            d.mkdir()
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={lower},upperdir={self.upper},workdir={self.work}",
                        str(self.merged)], check=True)

    def close(self) -> None:
        subprocess.run(["umount", str(self.merged)], check=False)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    lower = tmp_path / "image"
    (lower / "etc").mkdir(parents=True)
    (lower / "etc" / "keep").write_text("image\n")
    (lower / "etc" / "gone").write_text("deleted by the container\n")
    (lower / "cache").mkdir()
    (lower / "cache" / "old").write_text("replaced wholesale\n")
    # Absolute: in the container it means <root>/<that path>, which the image does not have;
    # on the node it names a directory that exists.
    (tmp_path / "node-dir").mkdir()
    (lower / "link").symlink_to(tmp_path / "node-dir")
    return lower


@pytest.fixture
def overlays(tmp_path: Path) -> Iterator[list[Overlay]]:
    made: list[Overlay] = []
    yield made
    for o in reversed(made):
        o.close()


def test_a_layer_comes_back_with_its_deletions_and_replaced_directories(
        tmp_path: Path, image: Path, overlays: list[Overlay]) -> None:
    first = Overlay(tmp_path, image, "first")
    overlays.append(first)
    m = first.merged
    (m / "data").mkdir()
    (m / "data" / "state").write_bytes(b"\x00written\xff")
    os.chmod(m / "data" / "state", 0o640)
    (m / "etc" / "gone").unlink()
    (m / "etc" / "keep").write_text("changed\n")
    subprocess.run(["rm", "-rf", str(m / "cache")], check=True)
    (m / "cache").mkdir()  # an opaque directory: nothing of the image's shows through
    (m / "cache" / "new").write_text("new\n")
    assert rootfs.upper_dir(m) == first.upper
    diff = tmp_path / "diff.tar"
    assert rootfs.capture(m, diff) > 0

    second = Overlay(tmp_path, image, "second")
    overlays.append(second)
    rootfs.apply(diff, second.merged)
    n = second.merged
    assert (n / "data" / "state").read_bytes() == b"\x00written\xff"
    assert (n / "data" / "state").stat().st_mode & 0o777 == 0o640
    assert (n / "etc" / "keep").read_text() == "changed\n"
    assert not (n / "etc" / "gone").exists()
    assert sorted(os.listdir(n / "cache")) == ["new"]
    assert (image / "etc" / "gone").exists()  # the image itself is untouched


def test_a_layer_is_put_back_inside_the_root_even_through_an_absolute_symlink(
        tmp_path: Path, image: Path, overlays: list[Overlay]) -> None:
    o = Overlay(tmp_path, image, "target")
    overlays.append(o)
    outside = tmp_path / "node-dir" / "planted"
    diff = tmp_path / "evil.tar"
    with tarfile.open(diff, "w") as tar:
        info = tarfile.TarInfo("link/planted")
        data = b"should land in the container\n"
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    try:
        rootfs.apply(diff, o.merged)
    except ContainerError:
        pass  # refusing is fine too; writing outside is not
    assert not outside.exists()
    inside = o.merged / str(tmp_path / "node-dir").lstrip("/") / "planted"
    assert not inside.exists() or inside.read_bytes() == b"should land in the container\n"


def test_a_root_that_is_not_an_overlay_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(ContainerError, match="not an overlay mount"):
        rootfs.capture(tmp_path / "plain", tmp_path / "diff.tar")
