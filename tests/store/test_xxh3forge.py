"""The forger the integrity tests use really keeps both XXH3 sums (checked with `xxhash`)."""

from __future__ import annotations

import os
import time

import xxhash

from tests.store.xxh3forge import BLOCK, forge

MIB = 1 << 20


def test_a_forged_block_keeps_the_files_and_the_chunks_xxh3() -> None:
    data = os.urandom(2 * MIB + 5000)
    payload = b"attacker-chosen bytes " * 30
    started = time.monotonic()
    forged = forge(data, MIB + 7 * BLOCK, payload)
    assert time.monotonic() - started < 5  # cheap: the point
    assert forged != data and len(forged) == len(data)
    assert forged[MIB + 7 * BLOCK :].startswith(payload)
    assert xxhash.xxh3_128_hexdigest(forged) == xxhash.xxh3_128_hexdigest(data)
    for start in range(0, len(data), MIB):
        assert xxhash.xxh3_64_hexdigest(forged[start : start + MIB]) == xxhash.xxh3_64_hexdigest(
            data[start : start + MIB]
        )


def test_a_block_of_zeros_is_forged_too() -> None:
    data = bytes(MIB)
    forged = forge(data, 0, b"\x90" * 512)
    assert forged[:512] == b"\x90" * 512
    assert xxhash.xxh3_64_hexdigest(forged) == xxhash.xxh3_64_hexdigest(data)
    assert xxhash.xxh3_128_hexdigest(forged) == xxhash.xxh3_128_hexdigest(data)
