from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

import stasis.store
from stasis.errors import UsageError
from stasis.store import (
    FileEntry,
    Manifest,
    new_checkpoint_id,
    validate_checkpoint_id,
    validate_label,
)

from .helpers import make_info

SHA = "0" * 32


def test_public_api_is_sorted_and_complete() -> None:
    assert stasis.store.__all__ == sorted(stasis.store.__all__)
    for name in stasis.store.__all__:
        assert hasattr(stasis.store, name)


def test_new_id_has_the_documented_shape_and_is_valid() -> None:
    checkpoint_id = new_checkpoint_id()
    assert re.fullmatch(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{6}", checkpoint_id)
    assert validate_checkpoint_id(checkpoint_id) == checkpoint_id


def test_new_id_uses_utc_and_sorts_by_time() -> None:
    paris = timezone(timedelta(hours=1))
    first = new_checkpoint_id(datetime(2026, 11, 30, 1, 15, 12, tzinfo=paris))
    assert first.startswith("20261130T001512Z-")
    later = [
        new_checkpoint_id(datetime(2026, 11, 30, 0, 15, 12, tzinfo=UTC) + timedelta(seconds=s))
        for s in (1, 60, 86400)
    ]
    assert sorted([*later, first]) == [first, *later]


def test_new_ids_differ_within_one_second() -> None:
    now = datetime.now(UTC)
    assert len({new_checkpoint_id(now) for _ in range(50)}) > 45


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "../x",
        "a/b",
        "/20261130T001512Z-3f9a1c",
        "20261130T001512Z-3f9a1c/..",
        "20261130T001512Z-3F9A1C",
        "20261130T001512Z-3f9a1c\n",
        "20261130T001512-3f9a1c",
        ".",
        "..",
    ],
)
def test_invalid_ids_are_refused(bad: str) -> None:
    with pytest.raises(UsageError, match="invalid checkpoint id"):
        validate_checkpoint_id(bad)


@pytest.mark.parametrize("good", ["train", "a", "run-3.final_v2", "X" * 128, "0start"])
def test_valid_labels(good: str) -> None:
    assert validate_label(good) == good


@pytest.mark.parametrize("bad", ["", "-x", ".hidden", "a/b", "..", "a b", "X" * 129, "é", "a\n"])
def test_invalid_labels_are_refused_readably(bad: str) -> None:
    with pytest.raises(UsageError, match=r"invalid label .*letters, digits"):
        validate_label(bad)


@pytest.mark.parametrize(
    "name", ["../pages.img", "a/b.img", "/etc/passwd", "..", ".", "", "manifest.json", "x\x00y"]
)
def test_file_entries_refuse_unsafe_names(name: str) -> None:
    with pytest.raises(ValidationError):
        FileEntry(name=name, size_bytes=1, stored_name="ok.img", stored_size_bytes=1, xxh3_128=SHA)
    with pytest.raises(ValidationError):
        FileEntry(name="ok.img", size_bytes=1, stored_name=name, stored_size_bytes=1, xxh3_128=SHA)


def test_manifest_round_trips_through_json_with_utc_time() -> None:
    info = make_info(created=datetime(2026, 11, 30, 1, 0, tzinfo=timezone(timedelta(hours=1))))
    entry = FileEntry(
        name="pages-1.img",
        size_bytes=10,
        stored_name="pages-1.img.zst",
        stored_size_bytes=4,
        xxh3_128=SHA,
    )
    manifest = Manifest.build(info, "zstd", [entry], format=2)
    assert manifest.created == datetime(2026, 11, 30, 0, 0, tzinfo=UTC)
    assert manifest.created.utcoffset() == timedelta(0)
    assert (manifest.size_bytes, manifest.stored_size_bytes) == (10, 4)
    assert Manifest.model_validate_json(manifest.model_dump_json()) == manifest


def test_manifest_refuses_naive_times_duplicates_and_unknown_formats() -> None:
    entry = FileEntry(
        name="a.img", size_bytes=1, stored_name="a.img", stored_size_bytes=1, xxh3_128=SHA
    )
    good = Manifest.build(make_info(), "none", [entry], format=2).model_dump(mode="json")
    with pytest.raises(ValidationError):
        Manifest.model_validate({**good, "created": "2026-11-30T00:00:00"})
    with pytest.raises(ValidationError, match="duplicate"):
        Manifest.model_validate({**good, "files": [good["files"][0]] * 2})
    with pytest.raises(ValidationError):
        Manifest.model_validate({**good, "format": 4})
    with pytest.raises(ValidationError, match="BLAKE3"):  # format 3 hashes every file
        Manifest.model_validate({**good, "format": 3})
    with pytest.raises(ValidationError):
        Manifest.model_validate({**good, "id": "../x"})
