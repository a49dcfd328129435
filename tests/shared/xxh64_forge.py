"""Other bytes with the same xxh64 as given ones, in microseconds: why a content digest must be
cryptographic. xxh64 runs four 64-bit lanes over 32-byte stripes, each step
lane = rotl(lane + input * P2, 31) * P1, which is invertible in its input: after replacing one
stripe with any bytes, the next stripe can be chosen to bring the four lanes back to the state the
original bytes left, so everything after, and the hash, is unchanged."""

from __future__ import annotations

import struct

import xxhash

P1 = 0x9E3779B185EBCA87
P2 = 0xC2B2AE3D27D4EB4F
MASK = (1 << 64) - 1
STRIPE = 32


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK


def _round(lane: int, value: int) -> int:
    return (_rotl((lane + value * P2) & MASK, 31) * P1) & MASK


def _unround(lane: int, target: int) -> int:
    """The input that takes `lane` to `target`."""
    rotated = (target * pow(P1, -1, 1 << 64)) & MASK
    return ((_rotl(rotated, 33) - lane) * pow(P2, -1, 1 << 64)) & MASK


def _lanes_before(data: bytes, stripe: int, seed: int = 0) -> list[int]:
    lanes = [(seed + P1 + P2) & MASK, (seed + P2) & MASK, seed, (seed - P1) & MASK]
    for k in range(stripe):
        values = struct.unpack_from("<4Q", data, k * STRIPE)
        lanes = [_round(lane, v) for lane, v in zip(lanes, values)]
    return lanes


def forge(data: bytes, at: int, replacement: bytes) -> bytes:
    """`data` with the 32-byte stripe at byte `at` (a multiple of 32) replaced by `replacement`, and
    the stripe after it rewritten so that the xxh64 (seed 0) stays the same. Both stripes must be
    whole stripes before the input's last 32 bytes."""
    if at % STRIPE or len(replacement) != STRIPE or at + 2 * STRIPE > len(data) - STRIPE:
        raise ValueError("both stripes must be whole, aligned, and before the last 32 bytes")
    lanes = _lanes_before(data, at // STRIPE)
    original = _lanes_before(data, at // STRIPE + 2)
    changed = [_round(lane, v) for lane, v in zip(lanes, struct.unpack("<4Q", replacement))]
    fix = struct.pack("<4Q", *(_unround(lane, target) for lane, target in zip(changed, original)))
    forged = data[:at] + replacement + fix + data[at + 2 * STRIPE :]
    assert xxhash.xxh64(forged).intdigest() == xxhash.xxh64(data).intdigest()
    return forged
