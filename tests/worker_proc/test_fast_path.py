"""CUDA bf16: the Triton fast path (pinned step inputs, kernels.ops) against the torch
reference path of the same model, over a prefill step and a decode step with LoRA."""

from __future__ import annotations

import pytest
import torch

from shared.events import AdapterSlotAssigned
from shared.sampling import SamplingParams
from tests.worker_proc.lora_setup import BLOCK_SIZE, LoraSetup, lora_config
from worker_proc.batch import ReqState, build_batch
from worker_proc.kv_cache import KVCache
from worker_proc.runner import ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _reqs(setup: LoraSetup) -> list[ReqState]:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prompts = [setup.prompts["all"], setup.prompts["base"], setup.prompts["mlp"]]
    reqs, next_block = [], 0
    for i, (prompt, slot) in enumerate(zip(prompts, [0, -1, 1])):
        blocks = list(range(next_block, next_block + 8))
        next_block += 8
        reqs.append(ReqState(f"r{i}", list(prompt), len(prompt), params, blocks, 0, len(prompt), slot))
    return reqs


def _logits(runner: ModelRunner, reqs: list[ReqState], kv: KVCache, fast: bool) -> torch.Tensor:
    batch = build_batch(reqs, BLOCK_SIZE, runner.device, runner.staging if fast else None)
    model = runner.model
    if fast:
        hidden = model(batch.input_ids, batch.positions, kv.layers, batch.meta, lora=batch.lora)
        return model.compute_logits(hidden[batch.sample_indices], lora=batch.sample_lora)
    hidden = model(batch.input_ids, batch.positions, kv.layers, batch.meta, batch.lora_slots)
    return model.compute_logits(hidden[batch.sample_indices], batch.lora_slots[batch.sample_indices])


def test_fast_path_matches_reference_path(lora_setup: LoraSetup) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir, device="cuda", dtype="bfloat16"))
    for slot, name in enumerate(["all", "mlp"]):
        runner.load_adapter(AdapterSlotAssigned(slot, 100 + slot, lora_setup.adapter_dirs[name]))
    caches = {fast: KVCache(runner.model_cfg, 64, BLOCK_SIZE, runner.dtype, runner.device) for fast in (True, False)}
    reqs = _reqs(lora_setup)
    for step in range(3):  # prefill, then two decode steps
        got = {fast: _logits(runner, reqs, caches[fast], fast) for fast in (True, False)}
        err = (got[True] - got[False]).norm() / got[False].norm()
        assert torch.isfinite(got[True]).all() and err < 2e-2, (step, float(err))
        for req in reqs:  # append the reference's greedy token and schedule it
            req.num_computed_tokens = len(req.token_ids)
            req.token_ids.append(int(got[False][reqs.index(req)].argmax()))
            req.num_scheduled_tokens = 1
