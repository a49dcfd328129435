"""CUDA bf16, mixture-of-experts models (Qwen3-MoE, Mixtral): logits through the paged cache in
chunks with the Triton experts against the torch reference experts, decode by CUDA-graph replay
against eager, and the runner decoding through its graphs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ledgerserve.kernels import ops
from ledgerserve.kernels.moe_ref import fused_moe_ref, route
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.models.config import load_model_config
from ledgerserve.worker_proc.models.loader import build_model
from ledgerserve.worker_proc.requests import ReqState
from ledgerserve.worker_proc.runner import ModelRunner
from ledgerserve.worker_proc.step_inputs import build_step_inputs
from tests.worker_proc.fake_scheduler import FakeScheduler, run_to_completion
from tests.worker_proc.lora_setup import BLOCK_SIZE, GREEDY, NUM_BLOCKS, lora_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _logits(checkpoint: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    cfg = load_model_config(checkpoint)
    model = build_model(cfg, checkpoint, "auto", dtype, device, seed=0)
    shape = (16, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    zeros = lambda: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
    caches = [(zeros(), zeros()) for _ in range(cfg.num_layers)]
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    table, out = [9, 2, 14, 0, 7, 3, 11, 5, 1, 12, 4, 6], []
    for start, end in [(0, 7), (7, 30), (30, 31), (31, 45)]:
        req = ReqState("r", ids, len(ids), SamplingParams(max_tokens=1), table, start, end - start, -1)
        with torch.no_grad():
            out.append(model.compute_logits(model(build_step_inputs([req], BLOCK_SIZE, device), caches)).float())
    return torch.cat(out).cpu()  # [45, vocab]


def test_triton_experts_match_the_reference_experts(tiny_moe_checkpoint: str, monkeypatch) -> None:
    """Everything else the same kernels: the experts and their routing by Triton, or by torch."""
    got = _logits(tiny_moe_checkpoint, torch.bfloat16, torch.device("cuda"))
    monkeypatch.setattr(ops, "_moe_route", SimpleNamespace(route=route))
    monkeypatch.setattr(ops, "_fused_moe", SimpleNamespace(fused_moe=fused_moe_ref))
    want = _logits(tiny_moe_checkpoint, torch.bfloat16, torch.device("cuda"))
    err = float((got - want).norm() / want.norm())
    assert err < 2e-2, err


def test_graph_replay_matches_eager(tiny_moe_checkpoint: str) -> None:
    runner = ModelRunner(lora_config(tiny_moe_checkpoint, device="cuda", dtype="bfloat16", enable_lora=False))
    assert runner.graphs is not None
    gen = torch.Generator().manual_seed(7)
    reqs = []
    for i in range(5):  # prompts 'cached' but their last token: garbage KV serves both paths alike
        prompt = torch.randint(0, runner.model_cfg.vocab_size, (9 + 6 * i,), generator=gen).tolist()
        blocks = list(range(10 * i, 10 * i + 10))  # 40 token positions
        reqs.append(ReqState(f"r{i}", prompt, len(prompt), GREEDY, blocks, len(prompt) - 1, 1, -1))
    inputs = build_step_inputs(reqs, BLOCK_SIZE, runner.device, runner.staging)
    with torch.no_grad():
        eager = runner.model.compute_logits(runner.model(inputs, runner.kv_cache.layers)[inputs.sample_indices])
    graph = runner.graphs.replay(runner.inputs.stage_graph(reqs)).clone()
    err = float((graph.float() - eager.float()).norm() / eager.float().norm())
    assert err < 1e-2, err


def test_runner_decodes_through_graphs(tiny_moe_checkpoint: str) -> None:
    runner = ModelRunner(lora_config(tiny_moe_checkpoint, device="cuda", dtype="bfloat16", enable_lora=False))
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    gen = torch.Generator().manual_seed(8)
    for i in range(5):
        prompt = torch.randint(0, runner.model_cfg.vocab_size, (9 + 6 * i,), generator=gen).tolist()
        sched.add(f"r{i}", prompt, GREEDY, chunk=16)
    done = run_to_completion(runner, sched)
    assert runner.graphs is not None and runner.graphs.replays > 0
    assert all(len(req.outputs) == GREEDY.max_tokens for req in done.values())
