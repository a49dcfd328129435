"""CUDA bf16: decode by CUDA-graph replay against the eager fast path on the same inputs,
with and without adapters (one graph serving a mix of slots), and the runner using its graphs."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.shared.events import AdapterSlotAssigned
from ledgerserve.worker_proc.requests import ReqState
from ledgerserve.worker_proc.runner import ModelRunner
from ledgerserve.worker_proc.step_inputs import build_step_inputs
from tests.worker_proc.fake_scheduler import FakeScheduler, run_to_completion
from tests.worker_proc.lora_setup import BLOCK_SIZE, GREEDY, NUM_BLOCKS, LoraSetup, lora_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _runner(setup: LoraSetup, **kw) -> ModelRunner:
    runner = ModelRunner(lora_config(setup.base_dir, device="cuda", dtype="bfloat16", **kw))
    for slot, name in enumerate(["all", "mlp", "head"]):
        runner.adapters.load(AdapterSlotAssigned(slot, 100 + slot, setup.adapter_dirs[name]))
    runner.adapters.load(AdapterSlotAssigned(5, 105, setup.adapter_dirs["all"]))  # past the first slot bucket (4)
    return runner


def _decode_reqs(setup: LoraSetup, slots: list[int]) -> list[ReqState]:
    """Requests whose prompt minus its last token is 'cached' (garbage KV is fine for both paths)."""
    prompts = [setup.prompts[name] for name in ("all", "base", "mlp", "head")]
    reqs = []
    for i, (prompt, slot) in enumerate(zip(prompts, slots)):
        blocks = list(range(8 * i, 8 * i + 8))
        reqs.append(ReqState(f"r{i}", list(prompt), len(prompt), GREEDY, blocks, len(prompt) - 1, 1, slot))
    return reqs


@pytest.mark.parametrize(
    "slots", [[-1, -1, -1, -1], [0, -1, 1, 2], [2, 2, 0, 0], [5, -1, 0, 2]], ids=["base", "mixed", "pairs", "high-slot"]
)
def test_graph_replay_matches_eager(lora_setup: LoraSetup, slots: list[int]) -> None:
    runner = _runner(lora_setup)
    assert runner.graphs is not None
    reqs = _decode_reqs(lora_setup, slots)
    assert runner.graphs.fits(reqs)
    inputs = build_step_inputs(reqs, BLOCK_SIZE, runner.device, runner.staging)
    hidden = runner.model(inputs, runner.kv_cache.layers)
    eager = runner.model.compute_logits(hidden[inputs.sample_indices], inputs.sample_lora)
    assert sorted(runner.graphs.sets) == [0, 4, 6]  # no LoRA; slot buckets 4 and max_loras
    graph = runner.graphs.replay(runner.inputs.stage_graph(reqs)).clone()
    assert runner.graphs.replays == 1 and torch.isfinite(graph).all()
    err = float((graph - eager).norm() / eager.norm())
    assert err < 1e-2, err  # same kernels; only the decode split over the padded block table differs


def test_runner_decodes_through_graphs_and_enforce_eager_turns_them_off(lora_setup: LoraSetup) -> None:
    assert _runner(lora_setup, enforce_eager=True).graphs is None
    runner = _runner(lora_setup)
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    sched.add("a", lora_setup.prompts["all"], GREEDY, chunk=32, lora_slot=0)
    sched.add("b", lora_setup.prompts["base"], GREEDY, chunk=32)
    done = run_to_completion(runner, sched)
    assert runner.graphs is not None and runner.graphs.replays > 0
    assert all(len(req.outputs) == GREEDY.max_tokens for req in done.values())
