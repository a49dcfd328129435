"""ModelRunner with LoRA: base and four adapters in the same forward passes (chunked
prefill, then decode) against PEFT greedy generation; evicting and reloading a slot."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.shared.events import AdapterEvicted, AdapterLoadCompleted, AdapterSlotAssigned
from ledgerserve.worker_proc.lora import layout
from ledgerserve.worker_proc.runner import ModelRunner
from ledgerserve.worker_proc.warm_up import warm_up_batches
from tests.reference import assert_greedy_matches
from tests.worker_proc.fake_scheduler import FakeScheduler, run_to_completion
from tests.worker_proc.lora_setup import ADAPTERS, BLOCK_SIZE, GREEDY, NUM_BLOCKS, LoraSetup, load_all, lora_config

CHUNKS = {"base": 5, "head": 3, "attn": 7, "mlp": 4, "all": 6}


def _run_mixed(runner: ModelRunner, setup: LoraSetup) -> None:
    """Base requests and every adapter (one twice) in the same steps, checked against PEFT."""
    slots = load_all(runner, setup)
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    for name, prompt in setup.prompts.items():
        sched.add(name, prompt, GREEDY, chunk=CHUNKS[name], lora_slot=slots.get(name, -1))
    sched.add("all-twin", setup.prompts["all"], GREEDY, chunk=2, lora_slot=slots["all"])
    done = run_to_completion(runner, sched)
    results = {name: req.outputs for name, req in done.items()}
    notes = assert_greedy_matches(results, {**setup.refs, "all-twin": setup.refs["all"]})
    print("\n".join(notes))


def test_mixed_adapters_in_one_batch_match_peft(lora_setup: LoraSetup) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir))
    _run_mixed(runner, lora_setup)
    for name in ADAPTERS:  # every adapter really changes the output
        assert lora_setup.refs[name].token_ids != _base_output(runner, lora_setup.prompts[name])


def test_warm_up_leaves_nothing_behind(lora_setup: LoraSetup) -> None:
    """The start-up warm-up (run by CUDA workers) writes KV into blocks the first requests then
    get, reads an empty adapter slot and samples: every later output still matches PEFT."""
    batches = warm_up_batches(BLOCK_SIZE, NUM_BLOCKS, 128, 256, lora_slot=0)
    assert [[(r.num_computed_tokens, r.num_scheduled_tokens, r.lora_slot) for r in b] for b in batches] == [
        [(0, 9, -1), (0, 8, 0)],
        [(0, 8, -1), (0, 4, 0)],
        [(4, 7, -1), (4, 1, 0)],
        [(4, 8, -1), (4, 4, 0)],
        [(4, 1, 0)],
    ]
    small_pool = warm_up_batches(BLOCK_SIZE, 2, 128, 256, lora_slot=-1)  # only the lone decode row fits
    assert [[(r.num_computed_tokens, r.num_scheduled_tokens, r.lora_slot) for r in b] for b in small_pool] == [
        [(4, 1, -1)]
    ]
    runner = ModelRunner(lora_config(lora_setup.base_dir))
    calls = []
    real_choose = layout.choose

    def choose(weights, stacked, mapping, x):  # the LoRA kernels really run (an empty slot would skip them)
        calls.append(weights.batch_rank(mapping.slots))
        return real_choose(weights, stacked, mapping, x)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layout, "choose", choose)
        runner.warm_up()
    assert calls and min(calls) == 32
    assert not runner.requests.reqs and runner.prev_token_ids is None and not runner.lora.slots
    assert all(max(w.rank_table[0]) == 0 and not w.b[0].any() for w in runner.lora.weights.values())
    _run_mixed(runner, lora_setup)  # FakeScheduler hands out block 0 first: the warm-up's blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mixed_adapters_match_peft(lora_setup: LoraSetup) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir, device="cuda"))
    _run_mixed(runner, lora_setup)
    assert runner.lora.pool.blocks and all(block.is_pinned() for block in runner.lora.pool.blocks)


def test_evict_and_reload_slot_with_another_adapter(lora_setup: LoraSetup) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir))
    slots = load_all(runner, lora_setup)
    slot = slots["head"]  # held an adapter with an lm_head delta; the new one has none
    runner.adapters.evict(AdapterEvicted(slot, 100 + slot))
    assert slot not in runner.lora.slots
    done = runner.adapters.load(AdapterSlotAssigned(slot, 200, lora_setup.adapter_dirs["attn"]))
    assert isinstance(done, AdapterLoadCompleted) and (done.slot, done.version_id) == (slot, 200)
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    sched.add("attn", lora_setup.prompts["attn"], GREEDY, chunk=8, lora_slot=slot)
    sched.add("mlp", lora_setup.prompts["mlp"], GREEDY, chunk=8, lora_slot=slots["mlp"])
    done = run_to_completion(runner, sched)
    assert_greedy_matches(
        {name: req.outputs for name, req in done.items()}, {name: lora_setup.refs[name] for name in ("attn", "mlp")}
    )


def _base_output(runner: ModelRunner, prompt: list[int]) -> list[int]:
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    sched.add("probe", prompt, GREEDY, chunk=32)
    return run_to_completion(runner, sched)["probe"].outputs
