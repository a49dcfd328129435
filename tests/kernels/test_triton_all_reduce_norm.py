"""GPU: the all-reduce fused into the residual-add RMSNorm (kernels/all_reduce_norm.py), as one rank of
two in one process: the other rank's buffer is a plain tensor, and this rank's holds the packets the
other would have sent it (its partial rows, at the expected epoch), so the kernel runs alone. Its
output must equal the residual-add RMSNorm of the summed rows, and it must send its own rows to the
peer as the protocol says. Two real ranks: tests/worker_proc/test_tensor_parallel_gpu.py."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels.fused_ref import fused_add_rms_norm_ref, rms_norm_ref
from ledgerserve.kernels.lora_types import LoraDelta
from ledgerserve.kernels.peer_buffers import PeerBuffers
from tests.kernels.lora_delta_data import SLOTS, make_delta
from tests.kernels.triton_device import DEVICE, DTYPES, TOL, requires_triton_device

pytest.importorskip("triton")

from ledgerserve.kernels import all_reduce_norm  # noqa: E402
from ledgerserve.kernels.lora_delta import rank_pad  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_triton_device]
WORLD = 2
NUM_PARTS = 3
PART_NUMEL = 1 << 16
MAX_ROWS = 64


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def two_ranks(rank: int, dtype: torch.dtype) -> tuple[PeerBuffers, list[torch.Tensor]]:
    """`rank`'s view of two ranks' packet buffers (zero-filled), and those tensors."""
    buffers = [torch.zeros(NUM_PARTS * PART_NUMEL, dtype=torch.int64, device=DEVICE) for _ in range(WORLD)]
    peers = PeerBuffers(
        buffer=buffers[rank],
        buffer_ptrs=torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=DEVICE),
        epochs=torch.zeros(NUM_PARTS, MAX_ROWS, dtype=torch.int32, device=DEVICE),
        rank=rank,
        world_size=WORLD,
        dtype=dtype,
        part_numel=PART_NUMEL,
    )
    return peers, buffers


def packets(values: torch.Tensor, epoch: int) -> torch.Tensor:
    """[rows, n] 16-bit values (n even) -> [rows, n // 2] int64: each pair's bits low (the even value
    lowest), the epoch high; the layout the kernel sends."""
    words = values.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return words | (epoch << 32)


def slot_h(delta: LoraDelta) -> torch.Tensor:
    """[num_tokens, max_rank]: slice 0 of each token's slot's h (zeros for base tokens and past the rank)."""
    slots = delta.token_slots.long()
    h = delta.h[torch.arange(len(slots), device=slots.device), slots.clamp(min=0), 0]  # [num_tokens, max_rank]
    rank = delta.weights.ranks[slots.clamp(min=0), 0]  # [num_tokens]
    keep = (torch.arange(h.shape[1], device=h.device) < rank[:, None]) & (slots >= 0)[:, None]
    return h * keep.to(h.dtype)


def row_h(delta: LoraDelta) -> torch.Tensor:
    """[num_tokens, max_rank]: slice 0 of each token's slot's h, as the kernel reads it (zeros for base tokens)."""
    slots = delta.token_slots.long()
    h = delta.h[torch.arange(len(slots), device=slots.device), slots.clamp(min=0), 0]  # [num_tokens, max_rank]
    return torch.where((slots >= 0)[:, None], h, torch.zeros_like(h))  # +0.0, as the kernel's masked load


def with_h(delta: LoraDelta, h: torch.Tensor) -> LoraDelta:
    return LoraDelta(h, delta.weights, delta.token_slots)


def padded(values: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("part", range(NUM_PARTS))
@pytest.mark.parametrize(("lora", "with_residual"), [(False, True), (True, True), (False, False)])
def test_sums_the_ranks_rows_then_norms(
    dtype: torch.dtype, rank: int, part: int, lora: bool, with_residual: bool
) -> None:
    """Without a residual (the embedding's rows), the sum is the new residual."""
    hidden, num_tokens, peer, epoch = 1000, len(SLOTS), 1 - rank, 7
    peers, buffers = two_ranks(rank, dtype)
    peers.epochs[part, :num_tokens] = epoch - 1  # the (part, row)s' last calls
    wide = randn(num_tokens, hidden + 24, dtype=dtype, seed=0)
    mine, theirs = wide[:, :hidden], randn(num_tokens, hidden, dtype=dtype, seed=1)  # mine: strided rows
    residual, weight = randn(num_tokens, hidden, dtype=dtype, seed=2), randn(hidden, dtype=dtype, seed=3)
    my_delta = make_delta([hidden], dtype, DEVICE, seed=4) if lora else None
    their_delta = make_delta([hidden], dtype, DEVICE, seed=5) if lora else None
    block, r_pad = 1024, rank_pad(my_delta)  # hidden and the slot's rank, padded to powers of 2

    def rows(buffer: torch.Tensor, src: int) -> torch.Tensor:  # [num_tokens, block // 2]: src's row packets
        return buffer[part * PART_NUMEL :][: num_tokens * WORLD * block // 2].view(num_tokens, WORLD, -1)[:, src]

    def hs(buffer: torch.Tensor, src: int) -> torch.Tensor:  # [num_tokens, r_pad // 2]: src's h, past 15/16 of the part
        area = buffer[part * PART_NUMEL + PART_NUMEL * 15 // 16 :][: num_tokens * WORLD * r_pad // 2]
        return area.view(num_tokens, WORLD, -1)[:, src]

    # what the peer's programs sent here: the same places for a row with and without LoRA
    rows(buffers[rank], peer)[:] = packets(padded(theirs, block), epoch)
    if their_delta is not None:
        hs(buffers[rank], peer)[:] = packets(padded(slot_h(their_delta), r_pad), epoch)

    assert all_reduce_norm.fits(peers, mine, my_delta)
    normed, new_residual = all_reduce_norm.all_reduce_add_rms_norm(
        mine, residual if with_residual else None, weight, 1e-5, my_delta, peers, part
    )

    summed = (mine.float() + theirs.float()).to(dtype)
    summed_delta = None
    if my_delta is not None and their_delta is not None:
        summed_delta = with_h(my_delta, (my_delta.h.float() + their_delta.h.float()).to(dtype))
    if with_residual:
        ref_normed, ref_residual = fused_add_rms_norm_ref(summed, residual, weight, 1e-5, summed_delta)
    else:
        ref_normed, ref_residual = rms_norm_ref(summed, weight, 1e-5), summed
    torch.testing.assert_close(new_residual, ref_residual, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(normed, ref_normed, atol=TOL[dtype], rtol=TOL[dtype])
    # this rank's partial rows (and h) went to the peer at the row's next epoch, which it keeps
    assert torch.equal(rows(buffers[peer], rank), packets(padded(mine, block), epoch))
    if my_delta is not None:
        assert torch.equal(hs(buffers[peer], rank), packets(padded(row_h(my_delta), r_pad), epoch))
    assert peers.epochs[part, :num_tokens].eq(epoch).all() and peers.epochs[part, num_tokens:].eq(0).all()
    others = [p for p in range(NUM_PARTS) if p != part]
    assert peers.epochs[others].eq(0).all()
    for p in others:  # the other parts untouched
        assert buffers[peer][p * PART_NUMEL :][:PART_NUMEL].eq(0).all()
    sent = (buffers[peer] != 0).sum().item()  # nothing else written, the peer's own places included
    assert sent == num_tokens * (block + (r_pad if my_delta is not None else 0)) // 2


def test_fits_only_what_its_buffer_and_epochs_hold() -> None:
    dtype = DTYPES[0]
    peers, _ = two_ranks(0, dtype)
    # a part's rows take its first 15/16: 61440 packets, 60 rows of 512 from each of two ranks
    assert all_reduce_norm.fits(peers, randn(60, 1000, dtype=dtype, seed=0), None)
    assert not all_reduce_norm.fits(peers, randn(61, 1000, dtype=dtype, seed=0), None)
    assert all_reduce_norm.fits(peers, randn(MAX_ROWS, 500, dtype=dtype, seed=0), None)
    assert not all_reduce_norm.fits(peers, randn(MAX_ROWS + 1, 500, dtype=dtype, seed=0), None)  # epochs
    assert not all_reduce_norm.fits(peers, randn(8, 16384, dtype=dtype, seed=0), None)  # the part
    assert not all_reduce_norm.fits(peers, randn(8, 1000, dtype=torch.float32, seed=0), None)  # dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("stacked", [False, True])
def test_a_gemv_sends_its_row_and_the_norm_then_only_awaits_the_peers(
    dtype: torch.dtype, rank: int, stacked: bool
) -> None:
    """Batch 1: the projection's GEMV sends its row's columns (not a stacked A's shrink past them)
    into the peer's buffer at the epoch the norm will await, leaving the epochs to the norm; the
    norm, told the row went, sums it with the peer's and sends nothing itself."""
    from ledgerserve.kernels import gemv
    from ledgerserve.kernels.peer_buffers import RowSend

    hidden, k, part, peer, epoch = 512, 256, 1, 1 - rank, 5
    peers, buffers = two_ranks(rank, dtype)
    peers.epochs[part, 0] = epoch - 1

    def row(buffer: torch.Tensor, src: int) -> torch.Tensor:  # [hidden // 2]: src's packets of row 0
        return buffer[part * PART_NUMEL + src * hidden // 2 :][: hidden // 2]

    x, w = randn(1, k, dtype=dtype, seed=0), randn(hidden + (64 if stacked else 0), k, dtype=dtype, seed=1)
    assert gemv.sends_row(*w.shape, hidden)
    assert not gemv.sends_row(*w.shape, 500) and not gemv.sends_row(hidden, k, hidden + 2)  # a padded row
    y = gemv.gemv(x, w, row_send=RowSend(peers, part, hidden))
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(row(buffers[peer], rank), packets(y[:, :hidden], epoch)[0])
    assert (buffers[peer] != 0).sum().item() == hidden // 2 and buffers[rank].eq(0).all()
    assert peers.epochs[part, 0].item() == epoch - 1 and peers.epochs.count_nonzero().item() == 1  # the norm's

    theirs = randn(1, hidden, dtype=dtype, seed=2)
    row(buffers[rank], peer)[:] = packets(theirs, epoch)[0]
    residual, weight = randn(1, hidden, dtype=dtype, seed=3), randn(hidden, dtype=dtype, seed=4)
    sent = buffers[peer].clone()
    normed, new_residual = all_reduce_norm.all_reduce_add_rms_norm(
        y[:, :hidden], residual, weight, 1e-5, None, peers, part, x_sent=True
    )
    summed = (y[:, :hidden].float() + theirs.float()).to(dtype)
    ref_normed, ref_residual = fused_add_rms_norm_ref(summed, residual, weight, 1e-5, None)
    torch.testing.assert_close(new_residual, ref_residual, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(normed, ref_normed, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(buffers[peer], sent) and peers.epochs[part, 0].item() == epoch
