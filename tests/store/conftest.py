"""Shared fixtures: real stores on a temporary directory and on fsspec's memory:// filesystem."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from stasis.store import Store


@pytest.fixture
def local_store(tmp_path: Path) -> Store:
    return Store(str(tmp_path / "store"), staging_root=tmp_path / "staging", keep=0)


@pytest.fixture
def memory_store(tmp_path: Path) -> Iterator[Store]:
    url = f"memory://stasis-test-{uuid.uuid4().hex}"
    yield Store(url, staging_root=tmp_path / "staging", keep=0)
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    fixture = "local_store" if request.param == "local" else "memory_store"
    result: Store = request.getfixturevalue(fixture)
    return result


@pytest.fixture(scope="session")
def random_20m() -> bytes:
    return os.urandom(20 << 20)


@pytest.fixture(scope="session")
def mostly_zero() -> bytes:
    data = bytearray(8 << 20)
    for offset in range(0, len(data), 1 << 20):
        data[offset : offset + 64] = os.urandom(64)
    return bytes(data)
