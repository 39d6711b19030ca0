"""bench.stats decodes CRIU stats images; checked against protobuf's own encoder."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from bench.stats import (
    IMG_SERVICE_MAGIC,
    STATS_MAGIC,
    StatsFormatError,
    parse_message,
    read_dump_stats,
    read_restore_stats,
)


def _stats_classes() -> tuple[Any, Any, Any]:
    """stats.proto's messages built at runtime (field numbers as in CRIU's images/stats.proto)."""
    f = descriptor_pb2.FileDescriptorProto(
        name="bench_test_stats.proto", package="benchtest", syntax="proto2"
    )
    u32, u64 = (
        descriptor_pb2.FieldDescriptorProto.TYPE_UINT32,
        descriptor_pb2.FieldDescriptorProto.TYPE_UINT64,
    )
    opt = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
    dump = f.message_type.add(name="dump_stats_entry")
    for n, name in enumerate(("freezing_time", "frozen_time", "memdump_time", "memwrite_time"), 1):
        dump.field.add(name=name, number=n, type=u32, label=opt)
    for n, name in (
        (5, "pages_scanned"),
        (6, "pages_skipped_parent"),
        (7, "pages_written"),
        (9, "pages_lazy"),
    ):
        dump.field.add(name=name, number=n, type=u64, label=opt)
    rst = f.message_type.add(name="restore_stats_entry")
    for n, name, t in (
        (1, "pages_compared", u64),
        (2, "pages_skipped_cow", u64),
        (3, "forking_time", u32),
        (4, "restore_time", u32),
        (5, "pages_restored", u64),
    ):
        rst.field.add(name=name, number=n, type=t, label=opt)
    entry = f.message_type.add(name="stats_entry")
    msg = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
    entry.field.add(
        name="dump", number=1, type=msg, label=opt, type_name=".benchtest.dump_stats_entry"
    )
    entry.field.add(
        name="restore", number=2, type=msg, label=opt, type_name=".benchtest.restore_stats_entry"
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)  # type: ignore[no-untyped-call]
    find = pool.FindMessageTypeByName
    get = message_factory.GetMessageClass
    return (
        get(find("benchtest.stats_entry")),  # type: ignore[no-untyped-call]
        get(find("benchtest.dump_stats_entry")),  # type: ignore[no-untyped-call]
        get(find("benchtest.restore_stats_entry")),  # type: ignore[no-untyped-call]
    )


def _image(body: bytes) -> bytes:
    return struct.pack("<III", IMG_SERVICE_MAGIC, STATS_MAGIC, len(body)) + body


def test_dump_stats_round_trip(tmp_path: Path) -> None:
    entry_cls, dump_cls, _ = _stats_classes()
    entry = entry_cls(
        dump=dump_cls(
            freezing_time=237,
            frozen_time=212_037,
            memdump_time=178_187,
            memwrite_time=161_261,
            pages_scanned=69_348,
            pages_skipped_parent=0,
            pages_written=2**40 + 3,
            pages_lazy=7,
        )
    )
    path = tmp_path / "stats-dump"
    path.write_bytes(_image(entry.SerializeToString()))
    stats = read_dump_stats(path)
    assert stats.frozen_s == pytest.approx(0.212037)
    assert stats.freezing_s == pytest.approx(0.000237)
    assert stats.memwrite_s == pytest.approx(0.161261)
    assert stats.pages_written == 2**40 + 3
    assert stats.pages_lazy == 7


def test_restore_stats_round_trip(tmp_path: Path) -> None:
    entry_cls, _, restore_cls = _stats_classes()
    entry = entry_cls(
        restore=restore_cls(
            pages_compared=0,
            pages_skipped_cow=0,
            forking_time=265,
            restore_time=156_786,
            pages_restored=69_184,
        )
    )
    path = tmp_path / "stats-restore"
    path.write_bytes(_image(entry.SerializeToString()))
    stats = read_restore_stats(path)
    assert stats.restore_s == pytest.approx(0.156786)
    assert stats.pages_restored == 69_184


def test_rejects_other_images(tmp_path: Path) -> None:
    path = tmp_path / "inventory.img"
    path.write_bytes(struct.pack("<III", 0x54564319, 0x58313116, 0) + b"")
    with pytest.raises(StatsFormatError, match="not a CRIU stats image"):
        read_dump_stats(path)
    path.write_bytes(_image(b"\x0a\x05\x08"))  # dump entry claims 5 bytes, has 1
    with pytest.raises(StatsFormatError):
        read_dump_stats(path)


def test_unknown_fields_are_skipped() -> None:
    # field 15 varint 1, field 12 fixed32, field 1 varint 300 (two bytes)
    data = bytes([15 << 3, 0x01, (12 << 3) | 5, 1, 2, 3, 4, 1 << 3, 0xAC, 0x02])
    assert parse_message(data)[1] == 300
