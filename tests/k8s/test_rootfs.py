"""The writable layer of a container on real overlay mounts: captured, put back, and never
written outside the container's root; hostile images and layers played against the real
`rootfs.apply` (the child the daemon starts), as root."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stasis.errors import ContainerError
from stasis.k8s import confined, rootfs
from tests.k8s.hostile import plant


class Overlay:
    def __init__(self, base: Path, lower: Path, name: str) -> None:
        self.upper, self.work, self.merged = (base / f"{name}-{d}" for d in ("up", "work", "mnt"))
        for d in (self.upper, self.work, self.merged):
            d.mkdir()
        subprocess.run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={lower},upperdir={self.upper},workdir={self.work}",
                str(self.merged),
            ],
            check=True,
        )

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
    tmp_path: Path, image: Path, overlays: list[Overlay]
) -> None:
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
    # What else a container writes: links, a fifo, a setuid program, another owner.
    (m / "data" / "rel").symlink_to("state")
    (m / "data" / "abs").symlink_to("/etc/keep")
    os.link(m / "data" / "state", m / "data" / "twin")
    os.mkfifo(m / "data" / "pipe")
    os.chmod(m / "data" / "pipe", 0o620)
    (m / "data" / "suid").write_bytes(b"#!/bin/sh\n")
    os.chmod(m / "data" / "suid", 0o4755)
    os.chown(m / "data" / "state", 1234, 5678)
    assert rootfs.upper_dir(m) == first.upper
    diff = tmp_path / "diff.tar"
    assert rootfs.capture(m, diff) > 0

    second = Overlay(tmp_path, image, "second")
    overlays.append(second)
    rootfs.apply(diff, second.merged)
    n = second.merged
    assert (n / "data" / "state").read_bytes() == b"\x00written\xff"
    assert (n / "data" / "state").stat().st_mode & 0o777 == 0o640
    assert ((n / "data" / "state").stat().st_uid, (n / "data" / "state").stat().st_gid) == (
        1234,
        5678,
    )
    assert (n / "etc" / "keep").read_text() == "changed\n"
    assert not (n / "etc" / "gone").exists()
    assert sorted(os.listdir(n / "cache")) == ["new"]
    assert os.readlink(n / "data" / "rel") == "state"
    assert os.readlink(n / "data" / "abs") == "/etc/keep"
    assert (n / "data" / "twin").stat().st_ino == (n / "data" / "state").stat().st_ino
    assert stat.S_ISFIFO((n / "data" / "pipe").lstat().st_mode)
    assert (n / "data" / "pipe").lstat().st_mode & 0o777 == 0o620
    assert (n / "data" / "suid").stat().st_mode & 0o7777 == 0o4755
    assert (image / "etc" / "gone").exists()  # the image itself is untouched


def test_a_layer_is_put_back_inside_the_root_even_through_an_absolute_symlink(
    tmp_path: Path, image: Path, overlays: list[Overlay]
) -> None:
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


def test_capture_never_follows_the_container_s_symlinks_and_bounds_depth(
    tmp_path: Path, image: Path, overlays: list[Overlay], monkeypatch: pytest.MonkeyPatch
) -> None:
    o = Overlay(tmp_path, image, "capture")
    overlays.append(o)
    (tmp_path / "node-dir" / "node-file").write_text("the node's\n")
    (o.merged / "to-node").symlink_to(tmp_path / "node-dir")
    (o.merged / "to-node-file").symlink_to(tmp_path / "node-dir" / "node-file")
    diff = tmp_path / "diff.tar"
    rootfs.capture(o.merged, diff)
    with tarfile.open(diff) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {"to-node", "to-node-file"}
    assert all(m.issym() for m in members.values())
    monkeypatch.setattr(rootfs, "MAX_DEPTH", 3)
    (o.merged / "a" / "b" / "c" / "d").mkdir(parents=True)
    with pytest.raises(ContainerError, match="more than 3 directories deep"):
        rootfs.capture(o.merged, diff)


def test_a_root_that_is_not_an_overlay_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(ContainerError, match="not an overlay mount"):
        rootfs.capture(tmp_path / "plain", tmp_path / "diff.tar")


# -- hostile layers ------------------------------------------------------------------------


def file_(name: str, data: bytes = b"x", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def entry(
    name: str,
    kind: bytes,
    linkname: str = "",
    major: int = 0,
    minor: int = 0,
    pax: dict[str, str] | None = None,
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.devmajor, info.devminor = kind, linkname, major, minor
    info.mode = 0o755
    if pax:
        info.pax_headers = pax
    return info, b""


def layer(path: Path, *entries: tuple[tarfile.TarInfo, bytes]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def snapshot(top: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every path under `top` (not following links) with its mode, inode and contents."""
    seen: dict[str, tuple[int, int, bytes]] = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            data = (
                p.read_bytes()
                if stat.S_ISREG(st.st_mode)
                else (os.readlink(p).encode() if stat.S_ISLNK(st.st_mode) else b"")
            )
            seen[str(p.relative_to(top))] = (st.st_mode, st.st_nlink, data)
    return seen


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A directory standing for the node outside the container: what must never change."""
    h = tmp_path / "host"
    h.mkdir()
    (h / "secret").write_text("the node's\n")
    (h / "dir").mkdir()
    (h / "dir" / "kept").write_text("the node's too\n")
    return h


def test_python_planted_in_the_image_never_runs_when_a_layer_fails_half_way(
    tmp_path: Path, image: Path, host: Path, overlays: list[Overlay]
) -> None:
    """The chrooted child of before showed a traceback inside the tenant's root: it read the
    planted stdlib's coding cookie and imported the planted codec, as root."""
    marker = host / "marker"
    plant(image, marker)
    o = Overlay(tmp_path, image, "planted")
    overlays.append(o)
    before = snapshot(host)
    # etc/keep is a file in the image: the second entry cannot be written.
    diff = layer(tmp_path / "half.tar", file_("data/first", b"1"), file_("etc/keep/x", b"2"))
    with pytest.raises(rootfs.PartlyWritten) as e:
        rootfs.apply(diff, o.merged)
    assert "\n" not in str(e.value)
    assert "etc/keep/x" in str(e.value) and "Not a directory" in str(e.value)
    assert not marker.exists(), marker.read_text()
    assert snapshot(host) == before


Entries = list[tuple[tarfile.TarInfo, bytes]]
HOSTILE: dict[str, Callable[[str], Entries]] = {
    "absolute path": lambda h: [file_(f"{h}/planted")],
    "dot-dot path": lambda h: [file_("../" * 12 + f"{h}/planted".lstrip("/"))],
    "dot-dot inside": lambda h: [file_("data/../../planted")],
    "hard link out by dot-dot": lambda h: [
        entry("stolen", tarfile.LNKTYPE, "../" * 12 + f"{h}/secret".lstrip("/"))
    ],
    "hard link to an absolute path": lambda h: [entry("stolen", tarfile.LNKTYPE, f"{h}/secret")],
    "character device": lambda h: [entry("data/mem", tarfile.CHRTYPE, major=1, minor=1)],
    "block device": lambda h: [entry("data/sda", tarfile.BLKTYPE, major=8, minor=0)],
    "over-long name": lambda h: [file_("data/" + "a" * 300)],
    "contiguous hole": lambda h: [entry("data/odd", b"V")],  # a GNU volume header
}
WHY = {
    "absolute path": "absolute",
    "dot-dot path": "'..'",
    "dot-dot inside": "'..'",
    "hard link out by dot-dot": "points out of the root",
    "hard link to an absolute path": "points out of the root",
    "character device": "character device node (1:1)",
    "block device": "block device node (8:0)",
    "over-long name": "longer than 255",
    "contiguous hole": "tar type",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_entry_is_refused_in_one_line_before_anything_is_written(
    tmp_path: Path, image: Path, host: Path, overlays: list[Overlay], kind: str
) -> None:
    o = Overlay(tmp_path, image, "hostile")
    overlays.append(o)
    before_host, before_root = snapshot(host), snapshot(o.merged)
    diff = layer(
        tmp_path / "hostile.tar", file_("data/first", b"written first"), *HOSTILE[kind](str(host))
    )
    with pytest.raises(ContainerError) as e:
        rootfs.apply(diff, o.merged)
    msg = str(e.value)
    assert "\n" not in msg and "refused" in msg and WHY[kind] in msg, msg
    assert "nothing was written" in msg and "older one" in msg
    assert snapshot(host) == before_host
    assert snapshot(o.merged) == before_root  # not even the first entry


def test_a_truncated_layer_is_refused_before_anything_is_written(
    tmp_path: Path, image: Path, overlays: list[Overlay]
) -> None:
    o = Overlay(tmp_path, image, "cut")
    overlays.append(o)
    whole = layer(
        tmp_path / "whole.tar", file_("data/first", b"1"), file_("data/big", os.urandom(1 << 20))
    )
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole.read_bytes()[: 600 * 1024])
    with pytest.raises(ContainerError, match="refused.*(past the end|not a readable tar)"):
        rootfs.apply(cut, o.merged)
    assert not (o.merged / "data").exists()


def test_links_in_the_image_and_the_layer_resolve_inside_the_root(
    tmp_path: Path, image: Path, host: Path, overlays: list[Overlay]
) -> None:
    """The image's /tmp is a symlink to a node directory and the layer writes under /tmp; it
    deletes through the image's symlink, empties a directory holding a symlink out, and hard
    links through its own symlink up: everything lands, or fails, inside the root."""
    (image / "tmp").symlink_to(host / "dir")
    (image / "hostlink").symlink_to(host)
    (image / "holder").mkdir()
    (image / "holder" / "out").symlink_to(host / "dir")
    o = Overlay(tmp_path, image, "links")
    overlays.append(o)
    before = snapshot(host)
    diff = layer(
        tmp_path / "links.tar",
        entry("tmp", tarfile.DIRTYPE),  # a directory where the image has a symlink
        file_("tmp/planted", b"tmp"),
        entry("esc", tarfile.SYMTYPE, str(host)),
        entry("up", tarfile.SYMTYPE, "../../../../../../../../.."),
        entry("hostlink/secret", tarfile.CHRTYPE),  # a whiteout through a symlink
        entry("holder", tarfile.DIRTYPE, pax={"STASIS.overlay.opaque": "y"}),
        entry("cache", tarfile.CHRTYPE),  # a whiteout of a whole directory
        entry("etc/passwd-link", tarfile.LNKTYPE, "up/" + f"{host}/secret".lstrip("/")),
    )
    with pytest.raises(ContainerError) as e:
        rootfs.apply(diff, o.merged)
    # The last entry's target resolves inside the root, where there is no such file.
    assert "etc/passwd-link" in str(e.value) and "\n" not in str(e.value)
    assert snapshot(host) == before
    assert (o.merged / "tmp" / "planted").read_bytes() == b"tmp"
    assert os.readlink(o.merged / "esc") == str(host)  # made as a symlink, never followed
    assert os.readlink(o.merged / "hostlink") == str(host)
    assert os.listdir(o.merged / "holder") == []
    assert not (o.merged / "cache").exists()


def test_writing_through_the_layer_s_own_symlink_stays_inside(
    tmp_path: Path, image: Path, host: Path, overlays: list[Overlay]
) -> None:
    o = Overlay(tmp_path, image, "own")
    overlays.append(o)
    (o.merged / str(host).lstrip("/")).mkdir(parents=True)
    before = snapshot(host)
    diff = layer(
        tmp_path / "own.tar",
        entry("esc", tarfile.SYMTYPE, str(host)),
        file_("esc/secret", b"overwritten?"),
        entry("esc/dir", tarfile.CHRTYPE),
    )  # a whiteout: delete host/dir?
    rootfs.apply(diff, o.merged)
    assert snapshot(host) == before
    assert (o.merged / str(host).lstrip("/") / "secret").read_bytes() == b"overwritten?"


def test_without_openat2_symlinks_on_the_way_are_refused(
    tmp_path: Path,
    image: Path,
    host: Path,
    overlays: list[Overlay],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kernels before 5.6: the component walk refuses what openat2 would resolve inside."""
    o = Overlay(tmp_path, image, "walk")
    overlays.append(o)
    monkeypatch.setattr(confined, "have_openat2", False)
    before = snapshot(host)
    diff = layer(tmp_path / "walk.tar", file_("data/ok", b"ok"), file_("link/planted", b"x"))
    with open(diff, "rb") as f, pytest.raises(OSError, match="symlink"):
        rootfs.apply_here(f, o.merged)
    assert snapshot(host) == before
    assert (o.merged / "data" / "ok").read_bytes() == b"ok"


def test_the_put_back_child_cannot_chroot_or_make_devices_even_if_led_to(tmp_path: Path) -> None:
    """Defence in depth: the child keeps only the capabilities writing files as their owners
    needs (and no_new_privs), so code it were tricked into running could not chroot out,
    mknod, mount or trace."""
    probe = (
        "from stasis.k8s import confined; import os\n"
        "confined.keep_only_file_capabilities()\n"
        "for call in (lambda: os.chroot('/'), lambda: os.mknod("
        f"{str(tmp_path / 'mem')!r}, 0o20600, os.makedev(1, 1))):\n"
        "    try:\n        call(); print('allowed')\n"
        "    except PermissionError:\n        print('denied')\n"
    )
    r = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, cwd="/")
    assert r.stdout.split() == ["denied", "denied"], r.stderr
    assert not (tmp_path / "mem").exists()


def test_a_layer_with_too_many_entries_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rootfs, "MAX_ENTRIES", 10)
    root = tmp_path / "root"
    root.mkdir()
    diff = layer(tmp_path / "many.tar", *(file_(f"f{i}") for i in range(11)))
    with open(diff, "rb") as f, pytest.raises(rootfs.Refused, match="more than 10 entries"):
        rootfs.apply_here(f, root)
    assert os.listdir(root) == []


# -- fuzzing -------------------------------------------------------------------------------
# The parser and the writer in-process (the child runs the same code), on a plain directory
# standing for the root with a node directory beside it and symlinks pointing at it.

FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_NODE = "/tmp/stasis-fuzz-node-never-written"
# Mostly entries a layer may hold (so that most examples get written), some hostile ones.
_benign_paths = st.lists(
    st.sampled_from(["a", "b", "out", "up", "d", "f", "."]), min_size=1, max_size=4
).map("/".join)
_paths = st.builds(
    lambda lead, parts: lead + "/".join(parts),
    st.sampled_from(["", "./", "/", _NODE + "/"]),
    st.lists(
        st.sampled_from(["a", "out", "up", "", "..", "x" * 300, "\N{SNOWMAN}"]),
        min_size=1,
        max_size=4,
    ),
)
_benign = st.tuples(
    _benign_paths,
    st.sampled_from(
        [
            tarfile.REGTYPE,
            tarfile.DIRTYPE,
            tarfile.SYMTYPE,
            tarfile.LNKTYPE,
            tarfile.CHRTYPE,
            tarfile.FIFOTYPE,
        ]
    ),
    _benign_paths | st.just(_NODE) | st.just("../../.."),
    st.integers(0, 0o7777),
    st.booleans(),
    st.just(0),
)
_hostile = st.tuples(
    _paths,
    st.sampled_from(
        [
            tarfile.REGTYPE,
            tarfile.DIRTYPE,
            tarfile.SYMTYPE,
            tarfile.LNKTYPE,
            tarfile.CHRTYPE,
            tarfile.BLKTYPE,
            b"V",
            b"7",
        ]
    ),
    _paths | st.just(_NODE),
    st.integers(0, 0o7777),
    st.booleans(),
    st.integers(0, 3),
)
_entries = st.lists(
    st.integers(0, 9).flatmap(lambda i: _hostile if i == 0 else _benign), max_size=8
)


def _fuzz_tar(entries: list[tuple[str, bytes, str, int, bool, int]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, linkname, mode, opaque, dev in entries:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode = kind, linkname, mode
            info.devmajor, info.devminor = dev, dev
            if opaque:
                info.pax_headers = {"STASIS.overlay.opaque": "y"}
            data = name.encode("utf-8", "surrogateescape")[:64]
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return out.getvalue()


@FUZZ
@given(entries=_entries)
def test_any_layer_lands_inside_the_root_or_is_refused(
    tmp_path: Path, entries: list[tuple[str, bytes, str, int, bool, int]]
) -> None:
    node = Path(_NODE)
    node.mkdir(exist_ok=True)
    (node / "secret").write_text("the node's\n")
    before = snapshot(node)
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        root = Path(d) / "root"
        (root / "d").mkdir(parents=True)
        (root / "d" / "f").write_text("image\n")
        (root / "out").symlink_to(node)
        (root / "up").symlink_to("../../../../../../../..")
        try:
            rootfs.apply_here(io.BytesIO(_fuzz_tar(entries)), root)
        except rootfs.Refused as e:
            assert "\n" not in str(e)
        except OSError:
            pass  # a write the root's state does not allow: a failed restore, inside the root
        assert sorted(os.listdir(d)) == ["root"]
    assert snapshot(node) == before


@FUZZ
@given(data=st.binary(max_size=4096), cut=st.integers(0, 4096))
def test_any_bytes_as_a_layer_are_one_refusal(data: bytes, cut: int) -> None:
    valid = _fuzz_tar([("a/b", tarfile.REGTYPE, "", 0o644, False, 0)])
    for candidate in (data, valid[:cut] + data):
        try:
            rootfs.Layer(io.BytesIO(candidate)).scan()
        except rootfs.Refused as e:
            assert "\n" not in str(e)
