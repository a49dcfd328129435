"""Greedy parity with transformers through the real core and runner: a batch of prompts
of different lengths, some longer than the chunked-prefill budget, in a KV pool small
enough to force preemption. Every output equals `model.generate` for 32 new tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ledgerserve.scheduler_proc.views.engine_stats import engine_stats
from ledgerserve.shared import events
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.sampling import SamplingParams
from tests.engine.harness import run_engine
from tests.model_factory import make_tiny_checkpoint
from tests.reference import assert_greedy_matches, greedy_reference

NUM_NEW_TOKENS = 32
PROMPT_LENS = [5, 9, 17, 26, 33, 41, 50, 61]  # budget below is 24 tokens per step


def _prompts(vocab_size: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return {f"req-{i}": torch.randint(3, vocab_size, (n,), generator=gen).tolist() for i, n in enumerate(PROMPT_LENS)}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_greedy_parity_with_chunked_prefill_and_preemption(arch, tmp_path):
    model_dir = make_tiny_checkpoint(arch, tmp_path / arch)
    config = EngineConfig(
        model_dir=str(model_dir),
        served_model_name=arch,
        max_model_len=128,
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        max_num_batched_tokens=24,
        block_size=4,
        num_kv_blocks=48,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(model.config.vocab_size)
    greedy = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    arrivals = [events.RequestArrived(req_id, ids, greedy) for req_id, ids in prompts.items()]

    run, core = run_engine(config, arrivals)

    assert run.count(events.RequestPreempted) > 0, "the KV pool was meant to force preemption"
    assert max(len(p) for p in prompts.values()) > config.max_num_batched_tokens
    assert all(run.finish_reasons[r] == "length" for r in prompts)
    refs = {r: greedy_reference(model, ids, NUM_NEW_TOKENS) for r, ids in prompts.items()}
    notes = assert_greedy_matches(run.outputs, refs)
    print("near ties accepted:", notes or "none")
    core.check_integrity()
    stats = engine_stats(core)
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
