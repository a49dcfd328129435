"""GPU: Triton LoRA shrink / expand (kernels/lora.py) against the float32 torch references,
both token layouts, at odd sizes, with base tokens, rank-0 slices and garbage past each rank."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels import lora_ref
from ledgerserve.kernels.lora_types import Segments, SlotWeights, Tiles, Tokens, group_tiles, max_tiles
from tests.kernels.triton_device import DEVICE, DTYPES, requires_triton_device

pytest.importorskip("triton")

from ledgerserve.kernels import lora  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_triton_device]
MAX_LORAS, MAX_RANK, IN = 5, 13, 1315  # IN > K_PER_SPLIT: two split-K partials, one ragged
OUTPUT_SIZES = [[301], [257, 67, 67], [190, 190]]


def _buffers(output_sizes: list[int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    num_slices, max_out = len(output_sizes), max(output_sizes)
    a = torch.randn(MAX_LORAS, num_slices, MAX_RANK, IN, generator=gen) * IN**-0.5
    b = torch.randn(MAX_LORAS, num_slices, max_out, MAX_RANK, generator=gen)
    ranks = torch.randint(1, MAX_RANK + 1, (MAX_LORAS, num_slices), generator=gen)
    ranks[1, 0] = 0  # slot 1 does not target slice 0
    ranks[3] = 0  # slot 3 targets nothing
    ranks[2, -1] = MAX_RANK
    scalings = torch.rand(MAX_LORAS, num_slices, generator=gen) * 3
    return a, b, ranks, scalings


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _check(layout: str, output_sizes: list[int], dtype: torch.dtype, seg_lens: list[int], seg_slots: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(output_sizes) + len(seg_lens))
    a, b, ranks, scalings = _buffers(output_sizes, gen)
    starts = [0]
    for n in seg_lens:
        starts.append(starts[-1] + n)
    token_slots = torch.tensor([s for n, s in zip(seg_lens, seg_slots) for _ in range(n)], dtype=torch.long)
    x = torch.randn(len(token_slots), IN, generator=gen)
    base = torch.randn(len(token_slots), sum(output_sizes), generator=gen)
    want = base.clone()  # float32 reference on the same (rounded) inputs
    x32, a32, b32 = (t.to(dtype).float() for t in (x, a, b))
    w32 = SlotWeights.of(a32, b32, ranks, scalings, output_sizes)
    xd, ad, bd = (t.to(dtype).to(DEVICE) for t in (x, a, b))
    if layout != "tokens":  # out-major, as LoraWeights stores B (the tokens layout keeps a rank-major B)
        bd = bd.transpose(-1, -2).contiguous().transpose(-1, -2)
    wd = SlotWeights.of(ad, bd, ranks.to(DEVICE), scalings.to(DEVICE), output_sizes)
    got = base.to(dtype).to(DEVICE)
    slots = token_slots.tolist()
    tiles = Tiles(*(torch.tensor(t) for t in group_tiles(slots, max_tiles(len(slots), MAX_LORAS))))
    tiles_d = Tiles(tiles.order.to(DEVICE), tiles.starts.to(DEVICE), tiles.slots.to(DEVICE))
    if layout == "segments":
        segs = Segments(torch.tensor(starts), torch.tensor(seg_slots))
        buf32 = lora_ref.lora_shrink_segments(x32, w32, segs)
        lora_ref.lora_expand_segments(want, buf32, w32, segs)
        segs_d = Segments(segs.starts.to(DEVICE), segs.slots.to(DEVICE), max(seg_lens))
        buf = lora.lora_shrink_segments(xd, wd, segs_d)
        lora.lora_expand_segments(got, buf, wd, segs_d)
    elif layout == "grouped":
        buf32 = lora_ref.lora_shrink_grouped(x32, w32, tiles)
        lora_ref.lora_expand_grouped(want, buf32, w32, tiles)
        buf = lora.lora_shrink_grouped(xd, wd, tiles_d)
        lora.lora_expand_grouped(got, buf, wd, tiles_d)
    elif layout == "stacked":  # h of every slot, a strided view out of a wider output as SlotLinear makes it
        buf32 = torch.einsum("ti,lsri->tlsr", x32, a32).to(dtype).float()  # rounded like a GEMM output
        lora_ref.lora_expand_stacked(want, buf32, w32, tiles)
        wide = torch.cat([torch.zeros(len(slots), 7), buf32.flatten(1)], dim=1).to(dtype).to(DEVICE)
        buf = wide[:, 7:].unflatten(1, buf32.shape[1:])  # [num_tokens, max_loras, num_slices, max_rank]
        lora.lora_expand_stacked(got, buf, wd, tiles_d)
    else:
        buf32 = lora_ref.lora_shrink_tokens(x32, w32, Tokens(token_slots))
        lora_ref.lora_expand_tokens(want, buf32, w32, Tokens(token_slots))
        tokens_d = Tokens(token_slots.to(DEVICE))
        buf = lora.lora_shrink_tokens(xd, wd, tokens_d)
        lora.lora_expand_tokens(got, buf, wd, tokens_d)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert _rel_err(buf.cpu(), buf32) < tol, "shrink"
    delta_got, delta_want = got.cpu().float() - base.to(dtype).float(), want - base
    assert _rel_err(delta_got, delta_want) < 2 * tol, "expand"
    untouched = (token_slots < 0).nonzero().flatten()
    assert torch.equal(got.cpu()[untouched], base.to(dtype)[untouched])  # base tokens keep their output


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("output_sizes", OUTPUT_SIZES, ids=["single", "qkv", "gate_up"])
def test_segments_match_reference(dtype: torch.dtype, output_sizes: list[int]) -> None:
    _check("segments", output_sizes, dtype, [7, 3, 0, 75, 1, 9, 40], [2, -1, 4, 1, 0, 3, 2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("output_sizes", OUTPUT_SIZES, ids=["single", "qkv", "gate_up"])
def test_tokens_match_reference(dtype: torch.dtype, output_sizes: list[int]) -> None:
    slots = [0, -1, 4, 1, 1, 3, -1, 2, 0, 4, 2, 2, 0]
    _check("tokens", output_sizes, dtype, [1] * len(slots), slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("output_sizes", OUTPUT_SIZES, ids=["single", "qkv", "gate_up"])
def test_grouped_matches_reference(dtype: torch.dtype, output_sizes: list[int]) -> None:
    slots = [0, -1, 4, 1, 1, 3, -1, 2, 0, 4, 2, 2, 0] + [1] * 37  # slot 1: three tiles, one ragged
    _check("grouped", output_sizes, dtype, [1] * len(slots), slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("output_sizes", OUTPUT_SIZES, ids=["single", "qkv", "gate_up"])
def test_stacked_matches_reference(dtype: torch.dtype, output_sizes: list[int]) -> None:
    slots = [0, -1, 4, 1, 1, 3, -1, 2, 0, 4, 2, 2, 0] + [1] * 37
    _check("stacked", output_sizes, dtype, [1] * len(slots), slots)
