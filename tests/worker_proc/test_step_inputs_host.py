"""CPU: a step's inputs from the scheduled requests: every field laid out per token and per
request, a CUDA-graph row padded to the exact layout its graph was captured with, and the
StepInputs tensors (placeholders filled on the device side, LoRA mappings of the sampled rows)."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels.lora_types import max_tiles
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.requests import ReqState
from ledgerserve.worker_proc.step_inputs import HostInputs, build_step_inputs, host_inputs, pad_for_graph

BLOCK_SIZE = 4
PARAMS = SamplingParams(max_tokens=8)


def _reqs() -> list[ReqState]:
    """A prefill chunk after a cached prefix that does not sample yet, and a decode row on slot 2."""
    chunk = ReqState("a", list(range(10, 20)), 10, PARAMS, [7, 3, 5], 3, 4, -1)
    decode = ReqState("b", [1, 2, 3, 4, 5, 6], 5, PARAMS, [9, 0], 5, 1, 2)
    return [chunk, decode]


def test_host_inputs_lay_out_every_scheduled_token() -> None:
    host = host_inputs(_reqs(), BLOCK_SIZE)
    assert host.input_ids == [13, 14, 15, 16, 6]
    assert host.positions == [3, 4, 5, 6, 5]
    # position p of a request lives in block block_ids[p // 4] at offset p % 4
    assert host.kv_slots == [7 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2, 0 * 4 + 1]
    assert host.lora_slots == [-1, -1, -1, -1, 2]
    assert host.seq_lens == [7, 6] and host.query_start_loc == [0, 4, 5]
    assert host.sample_indices == [4]  # "a" stops short of its prompt's end
    assert host.block_tables == [7, 3, 5, 9, 0, 0] and host.width == 3
    assert (host.seg_starts, host.seg_slots) == ([0, 4, 5], [-1, 2])
    assert host.max_query_len == 4


@pytest.mark.parametrize("num_reqs", [1, 3, 4])
@pytest.mark.parametrize("with_lora", [False, True])
def test_graph_rows_keep_the_captured_layout(num_reqs: int, with_lora: bool) -> None:
    bucket, width, scratch = 4, 5, 999
    num_tiles = max_tiles(bucket, 4) if with_lora else None
    captured = pad_for_graph(HostInputs(width=width), bucket, scratch, num_tiles)
    reqs = [
        ReqState(f"r{i}", [1, 2, 3], 3, PARAMS, [i + 1], 2, 1, i % 2 - 1 if with_lora else -1) for i in range(num_reqs)
    ]
    row = pad_for_graph(host_inputs(reqs, BLOCK_SIZE, width), bucket, scratch, num_tiles)
    assert [len(p) for p in row.parts()] == [len(p) for p in captured.parts()]
    pad = bucket - num_reqs
    assert row.kv_slots[num_reqs:] == [scratch] * pad and row.lora_slots[num_reqs:] == [-1] * pad
    assert row.seq_lens == [3] * num_reqs + [0] * pad and row.max_query_len == 1
    assert row.block_tables[:width] == [1, 0, 0, 0, 0] and row.sample_indices == list(range(bucket))


def test_step_inputs_on_cpu_fill_placeholders_and_map_sampled_adapters() -> None:
    reqs = _reqs()
    reqs[1] = ReqState("b", [1, 2, 3, 4, 5], 5, PARAMS, [9, 0], 5, 1, 2)
    reqs[1].placeholder_row = 1  # token 5's id: row 1 of the previous step's sampled tokens, not on the host
    inputs = build_step_inputs(reqs, BLOCK_SIZE, torch.device("cpu"), prev_token_ids=torch.tensor([50, 60]))
    assert inputs.input_ids.tolist() == [13, 14, 15, 16, 60]
    assert inputs.kv_slots.tolist() == [31, 12, 13, 14, 1] and inputs.positions.tolist() == [3, 4, 5, 6, 5]
    assert inputs.block_tables.tolist() == [[7, 3, 5], [9, 0, 0]] and inputs.block_tables.dtype == torch.int32
    assert inputs.seq_lens.tolist() == [7, 6] and inputs.query_start_loc.tolist() == [0, 4, 5]
    assert not inputs.is_decode and inputs.sample_indices.tolist() == [4]
    assert inputs.lora is not None and inputs.lora.tokens.slots.tolist() == [-1, -1, -1, -1, 2]
    assert inputs.sample_lora is not None and inputs.sample_lora.tokens.slots.tolist() == [2]
    base_only = build_step_inputs(reqs[:1], BLOCK_SIZE, torch.device("cpu"))
    assert base_only.lora is None and base_only.sample_lora is None
