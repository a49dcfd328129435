"""LoraMapping's segments and the kernel choice (worker_proc/lora/layout.py); LoraWeights slot
loading, checks and apply."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ledgerserve.kernels.lora_types import Segments, Tiles, Tokens, group_tiles, max_tiles
from ledgerserve.worker_proc.lora import layout
from ledgerserve.worker_proc.lora.layout import Stacked, choose, slot_buckets, stacks_a
from ledgerserve.worker_proc.lora.mapping import LoraMapping
from ledgerserve.worker_proc.lora.weights import LoraWeights
from ledgerserve.worker_proc.models.layers import SlotLinear


def test_mapping_runs_and_kernel_choice() -> None:
    assert LoraMapping.from_slots(torch.tensor([-1, -1, -1])) is None
    w = _weights()
    w.load_slot(0, [(torch.ones(2, 6), torch.ones(5, 2), 1.0), None])
    prefill = LoraMapping.from_slots(torch.tensor([2, 2, 2, -1, -1, 0, 0, 0, 2]))
    assert prefill.segments.starts.tolist() == [0, 3, 5, 8, 9] and prefill.segments.slots.tolist() == [2, -1, 0, 2]
    assert choose(w, False, prefill, torch.zeros(9, 6)) is prefill.segments
    decode = LoraMapping.from_slots(torch.tensor([1, 0, -1, 1]))
    assert decode.segments.slots.tolist() == [1, 0, -1, 1]
    assert choose(w, False, decode, torch.zeros(4, 6)) is decode.tokens
    assert choose(w, False, LoraMapping.from_slots(torch.tensor([1, 2, 1])), torch.zeros(3, 6)) is None  # empty slots
    tiles = Tiles(*(torch.tensor(t) for t in group_tiles([1, -1], max_tiles(2, 3))))
    graph = LoraMapping.for_graph(torch.tensor([1, -1]), tiles, 2)  # launched whatever the slots hold
    assert choose(w, False, graph, torch.zeros(2, 6)) is tiles
    stacked = choose(w, True, graph, torch.zeros(2, 6))
    assert isinstance(stacked, Stacked) and stacked.tiles is tiles and stacked.num_slots == 2
    assert stacks_a("model.layers.0.self_attn.qkv_proj") and not stacks_a("lm_head")


def test_lora_package_does_not_import_the_models() -> None:
    """models -> lora only: a layer uses LoRA types, the manager finds layers through a protocol."""
    lora_dir = Path(layout.__file__).parent
    for path in sorted(lora_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "worker_proc.models" not in (node.module or ""), f"{path.name} imports {node.module}"
            elif isinstance(node, ast.Import):
                assert not any("worker_proc.models" in alias.name for alias in node.names), path.name


def _weights() -> LoraWeights:
    return LoraWeights(
        max_loras=3, max_rank=8, in_features=6, output_sizes=[5, 3], dtype=torch.float64, device=torch.device("cpu")
    )


def test_load_slot_zeroes_the_rest_and_apply_matches_dense() -> None:
    w = _weights()
    gen = torch.Generator().manual_seed(0)
    w.a.normal_(generator=gen)  # stale weights everywhere
    w.b.normal_(generator=gen)
    a, b = torch.randn(4, 6, generator=gen, dtype=torch.float64), torch.randn(3, 4, generator=gen, dtype=torch.float64)
    w.load_slot(1, [None, (a, b, 0.5)])
    assert w.ranks[1].tolist() == [0, 4] and not w.a[1, 0].any() and not w.a[1, 1, 4:].any()
    assert not w.b[1, 1, 3:].any() and not w.b[1, 1, :, 4:].any()
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    for slots, kind in (([1, 1, 1, -1, -1], Segments), ([1, -1, 1, -1, 1], Tokens)):
        y = torch.zeros(5, 8, dtype=torch.float64)
        layout = choose(w, False, LoraMapping.from_slots(torch.tensor(slots)), x)
        assert isinstance(layout, kind)
        w.apply(x, y, layout)
        on = torch.tensor(slots) == 1
        torch.testing.assert_close(y[on, 5:], x[on] @ a.T @ b.T * 0.5)
        assert not y[:, :5].any() and not y[~on].any()


def test_grouped_mapping_matches_per_token() -> None:
    w = _weights()
    gen = torch.Generator().manual_seed(1)
    for slot in range(3):
        a = torch.randn(slot + 2, 6, generator=gen, dtype=torch.float64)
        b = torch.randn(5, slot + 2, generator=gen, dtype=torch.float64)
        w.load_slot(slot, [(a, b, 0.5 + slot), None])
    slots = [2, -1, 0, 2, 1, 0, -1, 2]
    x = torch.randn(len(slots), 6, generator=gen, dtype=torch.float64)
    want, got = (torch.randn(len(slots), 8, generator=gen, dtype=torch.float64),) * 2
    want, got = want.clone(), got.clone()
    w.apply(x, want, choose(w, False, LoraMapping.from_slots(torch.tensor(slots)), x))
    tiles = Tiles(*(torch.tensor(t) for t in group_tiles(slots, max_tiles(len(slots), 3))))
    w.apply(x, got, choose(w, False, LoraMapping.for_graph(torch.tensor(slots), tiles, 0), x))
    torch.testing.assert_close(got, want)


def test_load_slot_refuses_misfits_and_leaves_slot_untouched() -> None:
    w = _weights()
    good = (torch.ones(2, 6, dtype=torch.float64), torch.ones(5, 2, dtype=torch.float64), 1.0)
    w.load_slot(0, [good, None])
    with pytest.raises(ValueError, match="do not fit"):
        w.load_slot(0, [(torch.ones(2, 7), torch.ones(5, 2), 1.0), None])
    with pytest.raises(ValueError, match="outside"):
        w.load_slot(0, [(torch.ones(9, 6), torch.ones(5, 9), 1.0), None])
    with pytest.raises(ValueError, match="slices"):
        w.load_slot(0, [good])
    assert w.ranks[0].tolist() == [2, 0]


def test_stacked_linear_matches_unstacked() -> None:
    """A stacked under the base weight: one GEMM + the stacked expand = base GEMM + shrink + expand."""
    gen = torch.Generator().manual_seed(2)
    lin = SlotLinear(6, [5, 3], bias=True).double()
    weight, bias = (
        torch.randn(8, 6, generator=gen, dtype=torch.float64),
        torch.randn(8, generator=gen, dtype=torch.float64),
    )
    lin.weight.data.copy_(weight)
    lin.bias.data.copy_(bias)
    w = lin.attach_lora(max_loras=3, max_rank=8, stack=True)
    assert lin.stacked is not None and torch.equal(lin.weight, weight) and torch.equal(lin.bias, bias)
    assert lin.weight.data_ptr() == lin.stacked[0].data_ptr() and lin.stacked[0].shape == (8 + 3 * 2 * 8, 6)
    for slot in range(3):
        a = torch.randn(slot + 2, 6, generator=gen, dtype=torch.float64)
        b = torch.randn(3, slot + 2, generator=gen, dtype=torch.float64)
        w.load_slot(
            slot,
            [None, (a, b, 0.5 + slot)]
            if slot
            else [(torch.ones(1, 6, dtype=torch.float64), torch.ones(5, 1, dtype=torch.float64), 2.0), (a, b, 0.5)],
        )
    assert lin.stacked[0][8:].count_nonzero() == w.a.count_nonzero() > 0  # A lives in the stacked tensor
    slots = [2, -1, 0, 2, 1, 0, -1, 2]
    x = torch.randn(len(slots), 6, generator=gen, dtype=torch.float64)
    want = lin(x, LoraMapping.from_slots(torch.tensor(slots)))
    tiles = Tiles(*(torch.tensor(t) for t in group_tiles(slots, max_tiles(len(slots), 3))))
    got = lin(x, LoraMapping.for_graph(torch.tensor(slots), tiles, 0))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lin(x), x @ weight.T + bias)  # no mapping: the base weight alone


def test_slot_buckets_cap_at_max_loras() -> None:
    assert slot_buckets(32) == [4, 16, 32]
    assert slot_buckets(6) == [4, 6]
    assert slot_buckets(2) == [2]
