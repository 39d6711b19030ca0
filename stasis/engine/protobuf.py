"""The little protobuf stasis reads itself, without the protobuf runtime: CRIU's images (a
pagemap, a core image's credentials) and the requests its page server and image streamer send.
Every read is bounded by the bytes given: ValueError, never an index error or a loop."""

from __future__ import annotations


def varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at `at` and the offset after it; ValueError where it runs past the end of
    `data` or past 64 bits."""
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("a varint runs past the end")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """The (number, value) pairs of one protobuf message: ints for varints, bytes otherwise."""
    out: list[tuple[int, int | bytes]] = []
    at = 0
    while at < len(data):
        key, at = varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = varint(data, at)
            out.append((number, value))
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if at + size > len(data):
                raise ValueError("a fixed-size field runs past the end")
            out.append((number, data[at : at + size]))
            at += size
        elif wire == 2:
            size, at = varint(data, at)
            if at + size > len(data):
                raise ValueError("a field runs past the end")
            out.append((number, data[at : at + size]))
            at += size
        else:
            raise ValueError(f"wire type {wire}")
    return out


def repeated(fields: list[tuple[int, int | bytes]], number: int) -> list[int]:
    """The values of the repeated varint field `number` of a message's `fields`, packed or
    not."""
    values: list[int] = []
    for n, v in fields:
        if n != number:
            continue
        if isinstance(v, int):
            values.append(v)
        else:  # packed
            at = 0
            while at < len(v):
                item, at = varint(v, at)
                values.append(item)
    return values
