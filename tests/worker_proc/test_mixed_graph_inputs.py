"""CPU: a mixed-step graph's row (worker_proc/mixed_graphs.py) keeps the layout its bucket was
captured with, and the model run on the padded row (padding tokens and requests, attention tiles,
the grouped LoRA layout) gives the hidden states of the eager step on its real rows."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.shared.events import AdapterSlotAssigned
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.mixed_graphs import Bucket, bucket_inputs, pad_for_mixed
from ledgerserve.worker_proc.requests import ReqState
from ledgerserve.worker_proc.runner import ModelRunner
from ledgerserve.worker_proc.step_inputs import STAGED, HostInputs, build_step_inputs, host_inputs
from tests.worker_proc.lora_setup import BLOCK_SIZE, NUM_BLOCKS, LoraSetup, lora_config

PARAMS = SamplingParams(max_tokens=8)
WIDTH = 32  # max_model_len 128 / block size 4
SCRATCH_KV_SLOT = (NUM_BLOCKS - 1) * BLOCK_SIZE  # a block no request below uses
ATTN_GROUP = 2  # the tiny model's query heads per kv head (tests/model_factory.py)


def _reqs(setup: LoraSetup, slots: tuple[int, int, int]) -> list[ReqState]:
    """A whole prompt, a chunk after a cached prefix that does not sample yet, and a decode row."""
    a, b, c = setup.prompts["all"], setup.prompts["attn"], setup.prompts["base"]
    return [
        ReqState("a", list(a), len(a), PARAMS, list(range(0, 5)), 0, len(a), slots[0]),
        ReqState("b", list(b), len(b), PARAMS, list(range(5, 11)), 4, 9, slots[1]),
        ReqState("c", list(c), len(c), PARAMS, list(range(11, 15)), len(c) - 1, 1, slots[2]),
    ]


@pytest.mark.parametrize("num_slots", [0, 4])
def test_rows_keep_the_captured_layout(lora_setup: LoraSetup, num_slots: int) -> None:
    bucket = Bucket(64, 16, num_slots, ATTN_GROUP)
    captured = pad_for_mixed(HostInputs(width=WIDTH), bucket, SCRATCH_KV_SLOT)
    host = host_inputs(_reqs(lora_setup, (0, -1, 1)), BLOCK_SIZE, WIDTH)
    row = pad_for_mixed(host, bucket, SCRATCH_KV_SLOT)
    assert [len(p) for p in row.parts()] == [len(p) for p in captured.parts()]
    n = len(host.input_ids)
    assert row.kv_slots[n:] == [SCRATCH_KV_SLOT] * (64 - n) and row.lora_slots[n:] == [-1] * (64 - n)
    assert row.seq_lens[3:] == [0] * 13 and row.query_start_loc[3:] == [n] * 14
    assert row.sample_indices[: len(host.sample_indices)] == host.sample_indices
    assert row.attn_tile_reqs[:3] == [0, 1, 2] and set(row.attn_tile_reqs[3:]) == {-1}
    assert not row.seg_starts and bool(row.order) == bool(num_slots)


@pytest.mark.parametrize("slots", [(-1, -1, -1), (0, -1, 1), (3, 3, 0)], ids=["base", "mixed", "shared"])
def test_padded_row_gives_the_eager_hidden_states(lora_setup: LoraSetup, slots: tuple[int, int, int]) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir, dtype="float32"))
    for slot, name in [(0, "all"), (1, "head"), (3, "mlp")]:
        runner.adapters.load(AdapterSlotAssigned(slot, 100 + slot, lora_setup.adapter_dirs[name]))
    reqs = _reqs(lora_setup, slots)
    layers = runner.kv_cache.layers
    eager = runner.model(build_step_inputs(reqs, BLOCK_SIZE, runner.device), layers)  # [num_tokens, hidden]
    host = host_inputs(reqs, BLOCK_SIZE, WIDTH)
    num_slots = 4 if max(slots) >= 0 else 0
    row = pad_for_mixed(host, Bucket(64, 16, num_slots, ATTN_GROUP), SCRATCH_KV_SLOT)
    views = {name: torch.tensor(part, dtype=torch.long) for name, part in zip(STAGED, row.parts())}
    padded = runner.model(bucket_inputs(views, row, num_slots), layers)  # [64, hidden]
    torch.testing.assert_close(padded[: eager.shape[0]], eager, atol=1e-4, rtol=1e-4)
    if num_slots:  # the adapters count: the row without its LoRA mapping differs
        base = runner.model(bucket_inputs(views, row, 0), layers)[: eager.shape[0]]
        assert not torch.allclose(base, eager, atol=1e-3)
