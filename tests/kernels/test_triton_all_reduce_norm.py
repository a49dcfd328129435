"""GPU: the all-reduce fused into the residual-add RMSNorm (kernels/all_reduce_norm.py), as one rank of
two in one process: the other rank's buffer and signal pad are plain tensors holding what it would
have written (its partial rows, its raised flags), so the kernel runs through its barrier alone. Its
output must equal the residual-add RMSNorm of the summed rows, and it must leave the flags as the
protocol says. Two real ranks: tests/worker_proc/test_tensor_parallel_gpu.py."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels.fused_ref import fused_add_rms_norm_ref
from ledgerserve.kernels.lora_types import LoraDelta
from ledgerserve.kernels.peer_buffers import PeerBuffers
from tests.kernels.lora_delta_data import SLOTS, make_delta
from tests.kernels.triton_device import DEVICE, DTYPES, TOL, requires_triton_device

pytest.importorskip("triton")

from ledgerserve.kernels import all_reduce_norm  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_triton_device]
WORLD = 2
HALF_NUMEL = 1 << 16
MAX_ROWS = 64


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def two_ranks(rank: int, dtype: torch.dtype) -> tuple[PeerBuffers, list[torch.Tensor], list[torch.Tensor]]:
    """`rank`'s view of two ranks' buffers and signal pads (zero-filled), and those tensors."""
    buffers = [torch.zeros(2 * HALF_NUMEL, dtype=dtype, device=DEVICE) for _ in range(WORLD)]
    pads = [torch.zeros(MAX_ROWS * WORLD, dtype=torch.int32, device=DEVICE) for _ in range(WORLD)]
    peers = PeerBuffers(
        buffer=buffers[rank],
        buffer_ptrs=torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=DEVICE),
        signal_pad_ptrs=torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=DEVICE),
        rank=rank,
        world_size=WORLD,
        dtype=dtype,
        half_numel=HALF_NUMEL,
        max_rows=MAX_ROWS,
    )
    return peers, buffers, pads


def slot_h(delta: LoraDelta) -> torch.Tensor:
    """[num_tokens, max_rank]: slice 0 of each token's slot's h (zeros for base tokens and past the rank)."""
    slots = delta.token_slots.long()
    h = delta.h[torch.arange(len(slots), device=slots.device), slots.clamp(min=0), 0]  # [num_tokens, max_rank]
    rank = delta.weights.ranks[slots.clamp(min=0), 0]  # [num_tokens]
    keep = (torch.arange(h.shape[1], device=h.device) < rank[:, None]) & (slots >= 0)[:, None]
    return h * keep.to(h.dtype)


def with_h(delta: LoraDelta, h: torch.Tensor) -> LoraDelta:
    return LoraDelta(h, delta.weights, delta.token_slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.parametrize("lora", [False, True])
def test_sums_the_ranks_rows_then_norms(dtype: torch.dtype, rank: int, half: int, lora: bool) -> None:
    hidden, num_tokens, peer = 1000, len(SLOTS), 1 - rank
    peers, buffers, pads = two_ranks(rank, dtype)
    wide = randn(num_tokens, hidden + 24, dtype=dtype, seed=0)
    mine, theirs = wide[:, :hidden], randn(num_tokens, hidden, dtype=dtype, seed=1)  # mine: strided rows
    residual, weight = randn(num_tokens, hidden, dtype=dtype, seed=2), randn(hidden, dtype=dtype, seed=3)
    my_delta = make_delta([hidden], dtype, DEVICE, seed=4) if lora else None
    their_delta = make_delta([hidden], dtype, DEVICE, seed=5) if lora else None
    row, block = all_reduce_norm.row_len(hidden, my_delta), 1024  # block: hidden padded to a power of 2
    # what the peer's programs stored before raising their flags here
    rows = buffers[peer][half * HALF_NUMEL :][: num_tokens * row].view(num_tokens, row)
    rows[:, :hidden] = theirs
    if their_delta is not None:
        rows[:, block : block + their_delta.h.shape[-1]] = slot_h(their_delta)
    pads[rank].view(MAX_ROWS, WORLD)[:num_tokens, peer] = 1

    assert all_reduce_norm.fits(peers, mine, my_delta)
    normed, new_residual = all_reduce_norm.all_reduce_add_rms_norm(mine, residual, weight, 1e-5, my_delta, peers, half)

    summed = (mine.float() + theirs.float()).to(dtype)
    summed_delta = None
    if my_delta is not None and their_delta is not None:
        summed_delta = with_h(my_delta, (my_delta.h.float() + their_delta.h.float()).to(dtype))
    ref_normed, ref_residual = fused_add_rms_norm_ref(summed, residual, weight, 1e-5, summed_delta)
    torch.testing.assert_close(new_residual, ref_residual, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(normed, ref_normed, atol=TOL[dtype], rtol=TOL[dtype])
    # the flags: this rank's raise waits at the peer, the peer's here is taken
    assert pads[peer].view(MAX_ROWS, WORLD)[:num_tokens, rank].eq(1).all()
    assert pads[rank].eq(0).all() and pads[peer].view(MAX_ROWS, WORLD)[:, peer].eq(0).all()
    # this rank's partial rows are in its half for the peer to read
    mine_stored = buffers[rank][half * HALF_NUMEL :][: num_tokens * row].view(num_tokens, row)
    assert torch.equal(mine_stored[:, :hidden], mine)
    assert buffers[rank][(1 - half) * HALF_NUMEL :][:HALF_NUMEL].eq(0).all()  # the other half untouched


def test_fits_only_what_its_buffer_and_pads_hold() -> None:
    dtype = DTYPES[0]
    peers, _, _ = two_ranks(0, dtype)
    assert all_reduce_norm.fits(peers, randn(MAX_ROWS, 1000, dtype=dtype, seed=0), None)
    assert not all_reduce_norm.fits(peers, randn(MAX_ROWS + 1, 1000, dtype=dtype, seed=0), None)  # flags
    assert not all_reduce_norm.fits(peers, randn(8, 16384, dtype=dtype, seed=0), None)  # the half
    assert not all_reduce_norm.fits(peers, randn(8, 1000, dtype=torch.float32, seed=0), None)  # dtype
