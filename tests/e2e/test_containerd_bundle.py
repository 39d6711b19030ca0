"""The runtime as the node agent puts it on a host: stasis-runc and CRIU from the host bundle
(stasis.k8s.hostbundle: their own Python and libraries, through the bundled loader), started
by containerd's real shim; a stopped container created again continues its count."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.containerd_node import Node
from tests.e2e.test_containerd import (
    test_a_stopped_container_created_again_continues_its_count_and_keeps_its_files as _resumes,
)


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node(Path(tempfile.mkdtemp(prefix="stasis-bundle-node-")), bundle=True)
    try:
        n.up()
        yield n
    finally:
        n.down()


def test_through_the_host_bundle_a_stopped_container_continues(node: Node) -> None:
    runtime = node.root / "runtime"
    dispatcher = (node.lay.bin / "runc-wrapper" / "runc").read_text()
    assert f"exec {runtime}/bin/stasis-runc " in dispatcher
    assert f'criu = "{runtime}/bin/criu"' in node.lay.stasis_config.read_text()
    _resumes(node)
