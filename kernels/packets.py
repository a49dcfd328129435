"""Triton helpers of the packet protocol over symmetric memory (NCCL's low-latency protocol): each
8-byte store carries two 16-bit values and an epoch, so a packet is valid exactly when its epoch is
the one expected. kernels/all_reduce_norm.py describes the protocol; kernels/gemv.py sends its
output row with it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rank_buffer(table_ptr, rank, offset):
    """Pointer to packet `offset` of rank `rank`'s buffer, whose address is table_ptr[rank]."""
    return tl.load(table_ptr + rank).to(tl.pointer_type(tl.int64)) + offset


@triton.jit
def pack(v, epoch, N: tl.constexpr):
    """[N] 16-bit values -> [N // 2] int64 packets: a pair's bits in the low word, `epoch` in the high."""
    bits = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF  # [N]
    lo, hi = tl.split(tl.reshape(bits, [N // 2, 2]))  # [N // 2] each: the even and the odd values
    word = lo | (hi << 16)
    return (epoch.to(tl.int64) << 32) | (word.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def unpack(packets, DTYPE: tl.constexpr, N: tl.constexpr):
    """pack's inverse: [N // 2] int64 packets -> [N] values of DTYPE."""
    word = (packets & 0xFFFFFFFF).to(tl.int32)
    lo = (word & 0xFFFF).to(tl.int16)
    hi = ((word >> 16) & 0xFFFF).to(tl.int16)
    return tl.reshape(tl.join(lo, hi), [N]).to(DTYPE, bitcast=True)


@triton.jit
def await_packets(ptr, epoch, N: tl.constexpr):
    """The N packets at ptr, once every one carries `epoch` (volatile reads: the peer writes them)."""
    p = tl.arange(0, N)
    packets = tl.load(ptr + p, volatile=True)
    while tl.min(((packets >> 32).to(tl.int32) == epoch).to(tl.int32), axis=0) == 0:
        packets = tl.load(ptr + p, volatile=True)
    return packets


@triton.jit
def send(table_ptr, at, values, epoch, N: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr):
    """values [N] as packets at `at` in every other rank's buffer."""
    packets = pack(values, epoch, N)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            tl.store(rank_buffer(table_ptr, peer, at) + tl.arange(0, N // 2), packets)


@triton.jit
def sum_ranks(table_ptr, row_at, stride, values, epoch, N: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr):
    """[N] float32: this rank's `values` and what each other rank sent here (at row_at + its rank *
    stride, once all of it arrived), summed in rank order, so every rank sums alike."""
    acc = tl.zeros([N], tl.float32)
    for src in tl.static_range(WORLD):
        if src == RANK:
            acc += values.to(tl.float32)
        else:
            got = rank_buffer(table_ptr, RANK, row_at + src * stride)
            acc += unpack(await_packets(got, epoch, N // 2), values.dtype, N).to(tl.float32)
    return acc
