"""A Kubernetes tenant's hostile image, through the real restore path: containerd's runc shim
with the stasis runtime asks the daemon for the label's checkpoint, and the daemon puts the
checkpoint's writable layer into the new container's root, which the tenant's image made.

The tenant controls both sides: the first container writes what it likes into its own
filesystem (a device node, files under a directory), and the second container, created with
the same label from another image, plants Python modules, codecs, `.pth` and `sitecustomize`
files at the node's Python paths, turns a directory the layer writes into into a file (so that
putting the layer back fails half way), and makes /tmp a symlink to a node directory. Nothing
of the tenant's may run on the node (a marker file on the host), nothing outside the new root
may change, and a refusal is one line in the container's log."""

from __future__ import annotations

import io
import os
import secrets
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.e2e.containerd_node import Node, add_busybox, numbers, write_image
from tests.k8s.hostile import add_planted

HOSTILE_IMAGE = "stasis.test/hostile:1"
COUNTER = "i=0; while :; do i=$((i+1)); echo n=$i; sleep 0.1; done"


def hostile_archive(out: Path, marker: Path, host_dir: Path) -> Path:
    """busybox, plus everything planted: the image a tenant restores its label into."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        add_busybox(tar, ("bin", "data"))
        # /tmp -> a directory of the node; /data/x a file where the layer has a directory.
        info = tarfile.TarInfo("tmp")
        info.type, info.linkname = tarfile.SYMTYPE, str(host_dir)
        tar.addfile(info)
        info = tarfile.TarInfo("data/x")
        info.size = 6
        tar.addfile(info, io.BytesIO(b"a file"))
        add_planted(tar, marker)
    return write_image(out, layer.getvalue(), HOSTILE_IMAGE)


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    root = Path(tempfile.mkdtemp(prefix="stasis-hostile-node-"))
    n = Node(root)
    try:
        n.up()
        yield n
    finally:
        n.down()


@pytest.fixture(scope="module")
def host(node: Node) -> Iterator[tuple[Path, Path]]:
    """The marker planted code would write, and a node directory the image's /tmp points at;
    the hostile image imported into the node's containerd."""
    marker = node.root / "host-marker"
    host_dir = node.root / "host-marker-dir"
    host_dir.mkdir()
    (host_dir / "kept").write_text("the node's\n")
    archive = hostile_archive(node.root / "hostile.tar", marker, host_dir)
    r = node.ctr("images", "import", str(archive))
    assert r.returncode == 0, r.stderr
    yield marker, host_dir


def checkpointed(node: Node, cid: str, label: str, writes: str) -> None:
    """A container of the plain image that writes into its own filesystem, then counts; stopped
    the way the kubelet stops it (a checkpoint with its writable layer), and removed."""
    log = node.run(cid, f"{writes} && {COUNTER}", env={"STASIS_CHECKPOINT": label})
    wait_for(lambda: len(numbers(log)) >= 3, 20, "the first container to count")
    node.stop(cid)
    node.remove(cid)


def created_again(node: Node, cid: str, label: str) -> str:
    """The same label in a container of the hostile image: its log once it runs."""
    log = node.root / f"{cid}-hostile.log"
    r = node.ctr(
        "run",
        "-d",
        f"--log-uri=file://{log}",
        f"--runtime={node.info['runtime']}",
        f"--env=STASIS_CHECKPOINT={label}",
        HOSTILE_IMAGE,
        cid,
        "/bin/sh",
        "-c",
        COUNTER,
    )
    assert r.returncode == 0, r.stderr
    wait_for(
        lambda: log.exists()
        and ("starting fresh" in log.read_text() or "restored from" in log.read_text()),
        30,
        "the second container to start",
    )
    text = log.read_text()
    if "restored from" in text:
        # What the layer wrote, as the restored container sees it.
        seen = node.ctr(
            "tasks", "exec", "--exec-id", "cat-layer", cid, "/bin/cat", "/data/x/y", "/tmp/planted"
        )
        text += f"files: {seen.stdout!r}"
    node.stop(cid, grace_s=5)
    node.remove(cid)
    return text


def assert_untouched(marker: Path, host_dir: Path) -> None:
    assert not marker.exists(), f"tenant code ran on the node: {marker.read_text()}"
    assert sorted(p.name for p in host_dir.iterdir()) == ["kept"]
    assert (host_dir / "kept").read_text() == "the node's\n"


def test_a_layer_with_a_device_node_is_refused_in_one_line_and_the_container_starts_fresh(
    node: Node, host: tuple[Path, Path]
) -> None:
    marker, host_dir = host
    label = f"hostile-dev-{secrets.token_hex(3)}"
    checkpointed(
        node,
        "c-hostile-dev",
        label,
        "busybox mknod /data/sda b 8 0 && mkdir -p /data/x && echo y > /data/x/y "
        "&& echo planted > /tmp/planted",
    )
    text = created_again(node, "c-hostile-dev", label)
    refusals = [line for line in text.splitlines() if "refused" in line]
    assert len(refusals) == 1, text[:2000]
    assert "entry 'data/sda' is a block device node (8:0)" in refusals[0]
    assert "nothing was written" in refusals[0]
    assert f"label {label}: starting fresh" in text
    assert_untouched(marker, host_dir)


def test_planted_python_never_runs_when_the_layer_meets_the_hostile_image(
    node: Node, host: tuple[Path, Path]
) -> None:
    """The layer's data/x/y meets the image's file data/x (the put-back of before failed half
    way there and showed a traceback inside the tenant's root), and its tmp/ meets the image's
    symlink to the node: the layer goes into the root, nothing planted runs."""
    marker, host_dir = host
    label = f"hostile-py-{secrets.token_hex(3)}"
    checkpointed(
        node,
        "c-hostile-py",
        label,
        "mkdir -p /data/x && echo y > /data/x/y && echo planted > /tmp/planted",
    )
    text = created_again(node, "c-hostile-py", label)
    assert "restored from checkpoint" in text, text[:2000]
    assert "files: 'y\\nplanted\\n'" in text  # inside its own root
    assert_untouched(marker, host_dir)
    assert not any("Traceback" in line for line in text.splitlines())


def test_a_hostile_checkpoint_archive_is_refused_in_one_line_through_stasis_import(
    node: Node, host: tuple[Path, Path], tmp_path: Path
) -> None:
    """`stasis import` of archives made to escape or hang the root daemon: a layer naming an
    image `checkpoint/../..` into a node directory, a diff with a device node, a fifo that
    never gives a byte. Each is one line (exit 2), nothing is stored, the daemon answers."""
    _, host_dir = host
    from tests.k8s.test_oci_import import archive, layer_of, reg, special, tar_bytes

    escape = "checkpoint/" + "../" * 12 + f"{host_dir}/planted".lstrip("/")
    cases = {
        "escape.tar": archive(tmp_path / "escape.tar", layer_of(reg(escape, b"pwned"))),
        "device.tar": archive(
            tmp_path / "device.tar",
            layer_of(diff=tar_bytes(special("dev/sda", tarfile.BLKTYPE, major=8, minor=0))),
        ),
    }
    fifo = tmp_path / "fifo.tar"
    os.mkfifo(fifo)
    cases["fifo.tar"] = fifo
    before = node.stasis("checkpoints", "--json").stdout
    for name, path in cases.items():
        r = node.stasis("import", str(path), "--namespace", "tenant", "--label", "stolen")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (name, r.stderr)
        assert "is not an OCI image archive stasis can import" in lines[0], lines[0]
    assert node.stasis("checkpoints", "--json").stdout == before
    assert_untouched(host[0], host_dir)
