"""Decode CRIU's `stats-dump` and `stats-restore` images (images/stats.proto, MIT licensed).

Layout of a CRIU service image: two little-endian u32 magics (IMG_SERVICE_MAGIC, then STATS_MAGIC),
then entries, each a u32 length followed by one protobuf message. A stats image holds one
`stats_entry { dump = 1; restore = 2; }`. The messages are all varint scalars, so a hand decoder of
the protobuf wire format (~30 lines) avoids generating code from a .proto we do not ship.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

IMG_SERVICE_MAGIC = 0x55105940
STATS_MAGIC = 0x57093306

# Field numbers of dump_stats_entry / restore_stats_entry in CRIU's images/stats.proto.
DUMP_FIELDS = {
    1: "freezing_time",
    2: "frozen_time",
    3: "memdump_time",
    4: "memwrite_time",
    5: "pages_scanned",
    6: "pages_skipped_parent",
    7: "pages_written",
    8: "irmap_resolve",
    9: "pages_lazy",
    10: "page_pipes",
    11: "page_pipe_bufs",
    12: "shpages_scanned",
    13: "shpages_skipped_parent",
    14: "shpages_written",
}
RESTORE_FIELDS = {
    1: "pages_compared",
    2: "pages_skipped_cow",
    3: "forking_time",
    4: "restore_time",
    5: "pages_restored",
}


class StatsFormatError(ValueError):
    pass


@dataclass(frozen=True)
class DumpStats:
    """Times in seconds (CRIU records microseconds), counts in pages."""

    freezing_s: float
    frozen_s: float
    memdump_s: float
    memwrite_s: float
    pages_scanned: int
    pages_written: int
    pages_lazy: int


@dataclass(frozen=True)
class RestoreStats:
    forking_s: float
    restore_s: float
    pages_restored: int


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise StatsFormatError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise StatsFormatError("varint longer than 64 bits")


def parse_message(data: bytes) -> dict[int, int | bytes]:
    """One protobuf message: field number -> last value (varints as int, length-delimited as bytes)."""
    fields: dict[int, int | bytes] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields[number], pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise StatsFormatError("truncated field")
            fields[number] = data[pos : pos + length]
            pos += length
        elif wire in (1, 5):  # fixed64 / fixed32: not in stats.proto, skipped to stay lenient
            pos += 8 if wire == 1 else 4
        else:
            raise StatsFormatError(f"unsupported wire type {wire}")
    return fields


def stats_entry(image: bytes) -> dict[int, int | bytes]:
    """The stats_entry of a stats image's bytes, after checking its magics."""
    if len(image) < 12:
        raise StatsFormatError("too short for a CRIU stats image")
    magic, kind, length = struct.unpack_from("<III", image)
    if magic != IMG_SERVICE_MAGIC or kind != STATS_MAGIC:
        raise StatsFormatError(f"not a CRIU stats image (magics {magic:#x} {kind:#x})")
    body = image[12 : 12 + length]
    if len(body) != length:
        raise StatsFormatError("truncated entry")
    return parse_message(body)


def _named(raw: int | bytes | None, names: dict[int, str]) -> dict[str, int]:
    if not isinstance(raw, bytes):
        raise StatsFormatError("stats image has no entry of the expected kind")
    return {names[n]: v for n, v in parse_message(raw).items() if n in names and isinstance(v, int)}


def read_dump_stats(path: Path) -> DumpStats:
    f = _named(stats_entry(path.read_bytes()).get(1), DUMP_FIELDS)
    return DumpStats(
        freezing_s=f.get("freezing_time", 0) / 1e6,
        frozen_s=f.get("frozen_time", 0) / 1e6,
        memdump_s=f.get("memdump_time", 0) / 1e6,
        memwrite_s=f.get("memwrite_time", 0) / 1e6,
        pages_scanned=f.get("pages_scanned", 0),
        pages_written=f.get("pages_written", 0),
        pages_lazy=f.get("pages_lazy", 0),
    )


def read_restore_stats(path: Path) -> RestoreStats:
    f = _named(stats_entry(path.read_bytes()).get(2), RESTORE_FIELDS)
    return RestoreStats(
        forking_s=f.get("forking_time", 0) / 1e6,
        restore_s=f.get("restore_time", 0) / 1e6,
        pages_restored=f.get("pages_restored", 0),
    )
