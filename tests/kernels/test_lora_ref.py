"""The reference LoRA ops against a naive per-token loop, at odd sizes, with mixed slots
(including -1), rank-0 slices and garbage in the padding past each rank."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels.lora_ref import (
    lora_expand_grouped,
    lora_expand_segments,
    lora_expand_stacked,
    lora_expand_tokens,
    lora_shrink_grouped,
    lora_shrink_segments,
    lora_shrink_tokens,
)
from ledgerserve.kernels.lora_types import GROUP_TILE, Segments, SlotWeights, Tiles, Tokens, group_tiles, max_tiles

MAX_LORAS, MAX_RANK, IN = 5, 13, 37


def _buffers(output_sizes: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    num_slices, max_out = len(output_sizes), max(output_sizes)
    a = torch.randn(MAX_LORAS, num_slices, MAX_RANK, IN, generator=gen, dtype=torch.float64)
    b = torch.randn(MAX_LORAS, num_slices, max_out, MAX_RANK, generator=gen, dtype=torch.float64)
    ranks = torch.randint(1, MAX_RANK + 1, (MAX_LORAS, num_slices), generator=gen)
    ranks[1, 0] = 0  # slot 1 does not target slice 0
    ranks[3] = 0  # slot 3 targets nothing
    ranks[2, -1] = MAX_RANK
    scalings = torch.rand(MAX_LORAS, num_slices, generator=gen, dtype=torch.float64) * 3
    return a, b, ranks, scalings


def _naive(x, a, b, ranks, scalings, output_sizes, token_slots) -> torch.Tensor:
    y = torch.zeros(x.shape[0], sum(output_sizes), dtype=x.dtype)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        lo = 0
        for s, size in enumerate(output_sizes):
            r = int(ranks[slot, s])
            if r > 0:
                h = a[slot, s, :r] @ x[t]  # [r]
                y[t, lo : lo + size] = (b[slot, s, :size, :r] @ h) * scalings[slot, s]
            lo += size
    return y


def _segment_layout(seg_lens: list[int], seg_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    starts = [0]
    for n in seg_lens:
        starts.append(starts[-1] + n)
    token_slots = torch.tensor([s for n, s in zip(seg_lens, seg_slots) for _ in range(n)], dtype=torch.long)
    return torch.tensor(starts), torch.tensor(seg_slots), token_slots


OUTPUT_SIZES = [[29], [23, 11, 11], [19, 19]]


@pytest.mark.parametrize("output_sizes", OUTPUT_SIZES, ids=["single", "qkv", "gate_up"])
def test_segments_match_naive(output_sizes: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(output_sizes))
    a, b, ranks, scalings = _buffers(output_sizes, gen)
    seg_starts, seg_slots, token_slots = _segment_layout([7, 3, 0, 5, 1, 9, 4], [2, -1, 4, 1, 0, 3, 2])
    x = torch.randn(len(token_slots), IN, generator=gen, dtype=torch.float64)
    base = torch.randn(len(token_slots), sum(output_sizes), generator=gen, dtype=torch.float64)
    y = base.clone()
    w, segs = SlotWeights.of(a, b, ranks, scalings, output_sizes), Segments(seg_starts, seg_slots)
    buf = lora_shrink_segments(x, w, segs)
    lora_expand_segments(y, buf, w, segs)
    torch.testing.assert_close(y, base + _naive(x, a, b, ranks, scalings, output_sizes, token_slots))
    assert torch.equal(y[7:10], base[7:10])  # base-model segment untouched


@pytest.mark.parametrize("output_sizes", OUTPUT_SIZES, ids=["single", "qkv", "gate_up"])
def test_tokens_match_naive(output_sizes: list[int]) -> None:
    gen = torch.Generator().manual_seed(10 + len(output_sizes))
    a, b, ranks, scalings = _buffers(output_sizes, gen)
    token_slots = torch.tensor([0, -1, 4, 1, 1, 3, -1, 2, 0, 4, 2])
    x = torch.randn(len(token_slots), IN, generator=gen, dtype=torch.float64)
    base = torch.randn(len(token_slots), sum(output_sizes), generator=gen, dtype=torch.float64)
    y = base.clone()
    w, tokens = SlotWeights.of(a, b, ranks, scalings, output_sizes), Tokens(token_slots)
    buf = lora_shrink_tokens(x, w, tokens)
    lora_expand_tokens(y, buf, w, tokens)
    torch.testing.assert_close(y, base + _naive(x, a, b, ranks, scalings, output_sizes, token_slots))
    assert torch.equal(y[1], base[1]) and torch.equal(y[5], base[5])  # base token, rank-0 slot


def test_layouts_agree_and_all_base_is_a_no_op() -> None:
    gen = torch.Generator().manual_seed(7)
    output_sizes = [23, 11, 11]
    a, b, ranks, scalings = _buffers(output_sizes, gen)
    seg_starts, seg_slots, token_slots = _segment_layout([3, 4, 2], [4, 0, 2])
    x = torch.randn(len(token_slots), IN, generator=gen, dtype=torch.float64)
    w = SlotWeights.of(a, b, ranks, scalings, output_sizes)
    buf_seg = lora_shrink_segments(x, w, Segments(seg_starts, seg_slots))
    buf_tok = lora_shrink_tokens(x, w, Tokens(token_slots))
    torch.testing.assert_close(buf_seg, buf_tok)
    y = torch.zeros(len(token_slots), sum(output_sizes), dtype=torch.float64)
    base = Tokens(torch.full_like(token_slots, -1))
    lora_expand_tokens(y, lora_shrink_tokens(x, w, base), w, base)
    assert not y.any()


def test_group_tiles_sorts_by_slot_cuts_tiles_and_pads() -> None:
    slots = [3, -1, 0, 3, 0, -1, 3]
    order, starts, tile_slots = group_tiles(slots, max_tiles(len(slots), 4))
    assert [slots[i] for i in order] == [0, 0, 3, 3, 3, -1, -1]
    assert sorted(order) == list(range(len(slots)))
    assert len(starts) == len(tile_slots) + 1 == max_tiles(len(slots), 4) + 1
    assert starts[:3] == [0, 2, 5] and tile_slots[:2] == [0, 3]
    assert set(starts[2:]) == {5} and set(tile_slots[2:]) == {-1}  # padding: empty, base
    many = [1] * (2 * GROUP_TILE + 3) + [0]
    order, starts, tile_slots = group_tiles(many, max_tiles(len(many), 2))
    assert tile_slots[:4] == [0, 1, 1, 1] and starts[:5] == [0, 1, 1 + GROUP_TILE, 1 + 2 * GROUP_TILE, len(many)]
    with pytest.raises(ValueError):
        group_tiles(many, 2)


@pytest.mark.parametrize("output_sizes", OUTPUT_SIZES, ids=["single", "qkv", "gate_up"])
def test_grouped_matches_naive(output_sizes: list[int]) -> None:
    gen = torch.Generator().manual_seed(20 + len(output_sizes))
    a, b, ranks, scalings = _buffers(output_sizes, gen)
    slots = [0, -1, 4, 1, 1, 3, -1, 2, 0, 4, 2] + [2] * (GROUP_TILE + 1)
    token_slots = torch.tensor(slots)
    tiles = Tiles(*(torch.tensor(t) for t in group_tiles(slots, max_tiles(len(slots), MAX_LORAS))))
    x = torch.randn(len(slots), IN, generator=gen, dtype=torch.float64)
    base = torch.randn(len(slots), sum(output_sizes), generator=gen, dtype=torch.float64)
    y = base.clone()
    w = SlotWeights.of(a, b, ranks, scalings, output_sizes)
    buf = lora_shrink_grouped(x, w, tiles)
    torch.testing.assert_close(buf, lora_shrink_tokens(x, w, Tokens(token_slots)))
    lora_expand_grouped(y, buf, w, tiles)
    torch.testing.assert_close(y, base + _naive(x, a, b, ranks, scalings, output_sizes, token_slots))
    assert torch.equal(y[1], base[1]) and torch.equal(y[5], base[5])  # base token, rank-0 slot


@pytest.mark.parametrize("output_sizes", OUTPUT_SIZES, ids=["single", "qkv", "gate_up"])
def test_stacked_matches_naive(output_sizes: list[int]) -> None:
    """The expand over every slot's shrink (one stacked GEMM's output) reads only each tile's slot."""
    gen = torch.Generator().manual_seed(30 + len(output_sizes))
    a, b, ranks, scalings = _buffers(output_sizes, gen)
    slots = [3, 0, -1, 4, 1, 1, 2, 0, 4, 2] + [1] * (GROUP_TILE + 2)
    tiles = Tiles(*(torch.tensor(t) for t in group_tiles(slots, max_tiles(len(slots), MAX_LORAS))))
    x = torch.randn(len(slots), IN, generator=gen, dtype=torch.float64)
    base = torch.randn(len(slots), sum(output_sizes), generator=gen, dtype=torch.float64)
    a_real = a * (torch.arange(a.shape[2])[:, None] < ranks[..., None, None])  # zero past each rank, as stored
    h = torch.einsum("ti,lsri->tlsr", x, a_real)  # [num_tokens, max_loras, num_slices, max_rank]
    y = base.clone()
    lora_expand_stacked(y, h, SlotWeights.of(a, b, ranks, scalings, output_sizes), tiles)
    torch.testing.assert_close(y, base + _naive(x, a, b, ranks, scalings, output_sizes, torch.tensor(slots)))
