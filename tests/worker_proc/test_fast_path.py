"""CUDA bf16: the model's forward with kernels.ops on Triton and with ops switched to the torch
references, each against float32, over a prefill step and two decode steps with LoRA: the
Triton path's error must be that of bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels import ops
from ledgerserve.shared.events import AdapterSlotAssigned
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.kv_cache import KVCache
from ledgerserve.worker_proc.requests import ReqState
from ledgerserve.worker_proc.runner import ModelRunner
from ledgerserve.worker_proc.step_inputs import build_step_inputs
from tests.worker_proc.lora_setup import BLOCK_SIZE, LoraSetup, lora_config

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


def _logits(runner: ModelRunner, reqs: list[ReqState], kv: KVCache, fast: bool, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(ops, "HAS_TRITON", ops.HAS_TRITON and fast)  # off: every op takes its torch reference
        inputs = build_step_inputs(reqs, BLOCK_SIZE, runner.device, runner.staging)
        hidden = runner.model(inputs, kv.layers)
        return runner.model.compute_logits(hidden[inputs.sample_indices], inputs.sample_lora)


def _runner(setup: LoraSetup, dtype: str) -> ModelRunner:
    runner = ModelRunner(lora_config(setup.base_dir, device="cuda", dtype=dtype))
    for slot, name in enumerate(["all", "mlp"]):
        runner.adapters.load(AdapterSlotAssigned(slot, 100 + slot, setup.adapter_dirs[name]))
    return runner


def test_fast_path_matches_reference_path(lora_setup: LoraSetup, monkeypatch: pytest.MonkeyPatch) -> None:
    bf16, fp32 = _runner(lora_setup, "bfloat16"), _runner(lora_setup, "float32")
    paths = {"fast": (bf16, True), "ref": (bf16, False), "fp32": (fp32, False)}
    caches = {k: KVCache(r.model_cfg, 64, BLOCK_SIZE, r.dtype, r.device) for k, (r, _) in paths.items()}
    reqs = {k: _reqs(lora_setup) for k in paths}
    for step in range(3):  # prefill, then two decode steps
        got = {k: _logits(r, reqs[k], caches[k], fast, monkeypatch).float() for k, (r, fast) in paths.items()}
        errs = {k: float((got[k] - got["fp32"]).norm() / got["fp32"].norm()) for k in ("fast", "ref")}
        assert torch.isfinite(got["fast"]).all() and errs["fast"] < max(2 * errs["ref"], 1e-2), (step, errs)
        greedy = got["fp32"].argmax(-1).tolist()
        for k in paths:  # every path appends the float32 greedy token and schedules it
            for req, token in zip(reqs[k], greedy):
                req.num_computed_tokens = len(req.token_ids)
                req.token_ids.append(token)
                req.num_scheduled_tokens = 1
