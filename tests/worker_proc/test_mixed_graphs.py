"""CUDA bf16: steps that are not pure decode by mixed-graph replay against the eager forward on the
same inputs, with and without adapters, and the runner prefilling through its mixed graphs."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.shared.events import AdapterSlotAssigned
from ledgerserve.worker_proc.mixed_graphs import MixedStep
from ledgerserve.worker_proc.requests import ReqState, StepBatch
from ledgerserve.worker_proc.runner import ModelRunner
from ledgerserve.worker_proc.step_inputs import build_step_inputs
from tests.worker_proc.fake_scheduler import FakeScheduler, run_to_completion
from tests.worker_proc.lora_setup import BLOCK_SIZE, GREEDY, NUM_BLOCKS, LoraSetup, lora_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _runner(setup: LoraSetup, **kw) -> ModelRunner:
    runner = ModelRunner(lora_config(setup.base_dir, device="cuda", dtype="bfloat16", **kw))
    for slot, name in [(0, "all"), (1, "head"), (5, "mlp")]:  # 5: past the first slot bucket (4)
        runner.adapters.load(AdapterSlotAssigned(slot, 100 + slot, setup.adapter_dirs[name]))
    return runner


def _mixed_reqs(setup: LoraSetup, slots: list[int]) -> list[ReqState]:
    """A whole prompt, a chunk after a cached prefix, and a decode row ('cached' KV is garbage for both paths)."""
    a, b, c = setup.prompts["all"], setup.prompts["attn"], setup.prompts["base"]
    return [
        ReqState("a", list(a), len(a), GREEDY, list(range(0, 5)), 0, len(a), slots[0]),
        ReqState("b", list(b), len(b), GREEDY, list(range(5, 11)), 4, 9, slots[1]),
        ReqState("c", list(c), len(c), GREEDY, list(range(11, 15)), len(c) - 1, 1, slots[2]),
    ]


@pytest.mark.parametrize("slots", [[-1, -1, -1], [0, -1, 1], [5, 5, 0]], ids=["base", "mixed", "high-slot"])
def test_mixed_replay_matches_eager(lora_setup: LoraSetup, slots: list[int]) -> None:
    runner = _runner(lora_setup)
    assert runner.mixed is not None and sorted({s for s, _ in runner.mixed.graphs}) == [0, 6]  # no LoRA; every slot
    reqs = _mixed_reqs(lora_setup, slots)
    assert not runner.graphs.fits(reqs) and runner.mixed.fits(reqs)
    inputs = build_step_inputs(reqs, BLOCK_SIZE, runner.device, runner.staging)
    eager_hidden = runner.model(inputs, runner.kv_cache.layers)
    eager = runner.model.compute_logits(eager_hidden[inputs.sample_indices], inputs.sample_lora)
    staged = runner.inputs.build(StepBatch(0, reqs, [], [], [], []), None)
    assert isinstance(staged, MixedStep) and staged.num_tokens == eager_hidden.shape[0]
    logits, hidden = runner.forward.logits(staged)
    assert runner.mixed.replays == 1 and logits is not None and hidden is not None
    err = float((logits - eager).norm() / eager.norm())
    assert err < 1e-2, err  # the same math; LoRA in the grouped layout, attention over the tile table
    assert float((hidden - eager_hidden).norm() / eager_hidden.norm()) < 1e-2


def test_runner_prefills_through_mixed_graphs(lora_setup: LoraSetup) -> None:
    runner = _runner(lora_setup)
    eager = _runner(lora_setup, enforce_eager=True)
    assert eager.mixed is None
    outputs = []
    for r in (runner, eager):
        sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
        sched.add("a", lora_setup.prompts["all"], GREEDY, chunk=8, lora_slot=0)
        sched.add("b", lora_setup.prompts["base"], GREEDY, chunk=8)
        sched.add("c", lora_setup.prompts["mlp"], GREEDY, chunk=8, lora_slot=5)
        done = run_to_completion(r, sched)
        outputs.append({req_id: req.outputs for req_id, req in done.items()})
    assert runner.mixed is not None and runner.mixed.replays > 0
    assert all(len(out) == GREEDY.max_tokens for out in outputs[0].values())
    agree = sum(a == b for req_id in outputs[0] for a, b in zip(outputs[0][req_id], outputs[1][req_id]))
    assert agree >= 0.9 * 3 * GREEDY.max_tokens  # bf16: a near tie may flip late in a sequence, not more
