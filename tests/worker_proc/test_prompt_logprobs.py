"""Prompt logprobs computed by ModelRunner, checked against transformers (and PEFT) over one
forward of the whole prompt: requests with and without them share batches, and chunked prefill
splits prompts across steps, so chunk boundaries are scored by the step that computes the chunk."""

from __future__ import annotations

import math
from types import SimpleNamespace

import msgspec
import pytest
import torch

from ledgerserve.shared.events import PromptLogprobs
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc import prompt_logprobs
from ledgerserve.worker_proc.runner import ModelRunner
from tests.adapter_factory import load_peft_reference
from tests.model_factory import load_reference
from tests.prompt_logprobs_ref import Entry, check_entries, prompt_logprobs_reference
from tests.worker_proc.fake_scheduler import FakeScheduler, run_one_step_ahead, run_to_completion
from tests.worker_proc.lora_setup import BLOCK_SIZE as LORA_BLOCK_SIZE
from tests.worker_proc.lora_setup import NUM_BLOCKS as LORA_NUM_BLOCKS
from tests.worker_proc.lora_setup import LoraSetup, load_all, lora_config
from tests.worker_proc.test_runner import BLOCK_SIZE, NUM_BLOCKS, tiny_config

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def with_prompt_logprobs(k: int) -> SamplingParams:
    return msgspec.structs.replace(GREEDY, prompt_logprobs=k)


def entries(reports: list[PromptLogprobs], num_prompt_tokens: int) -> list[Entry | None]:
    """A request's reports as one entry per prompt position; each position must come exactly once."""
    out: list[Entry | None] = [None] * num_prompt_tokens
    for r in reports:
        tops = r.top_token_ids or [[] for _ in r.logprobs]
        top_values = r.top_logprobs or [[] for _ in r.logprobs]
        for i, (logprob, rank, ids, values) in enumerate(zip(r.logprobs, r.ranks, tops, top_values)):
            assert out[r.start + i] is None, f"position {r.start + i} reported twice"
            out[r.start + i] = Entry(logprob, rank, dict(zip(ids, values)))
    return out


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ],
)
@pytest.mark.parametrize("run", [run_to_completion, run_one_step_ahead], ids=["in-step", "one-step-ahead"])
def test_mixed_batch_with_chunked_prefill_matches_transformers(tiny_checkpoint: str, device: str, run) -> None:
    """On CUDA (float32: the reference kernels) the rows go up through pinned memory and come back
    on the step's own copy event; one step ahead, step N + 1 is launched before step N is read."""
    runner = ModelRunner(tiny_config(tiny_checkpoint, device=device))
    ref_model = load_reference(tiny_checkpoint)
    gen = torch.Generator().manual_seed(3)
    prompts = {
        name: torch.randint(3, 256, (n,), generator=gen).tolist()
        for name, n in {"chunked": 13, "plain": 11, "whole": 9, "top0": 7, "one": 1}.items()
    }
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    sched.add("chunked", prompts["chunked"], with_prompt_logprobs(5), chunk=5)  # steps of 5, 5, 3 tokens
    sched.add("plain", prompts["plain"], GREEDY, chunk=4)
    sched.add("whole", prompts["whole"], with_prompt_logprobs(20), chunk=16)
    sched.add("top0", prompts["top0"], with_prompt_logprobs(0), chunk=3)
    sched.add("one", prompts["one"], with_prompt_logprobs(2), chunk=4)
    done = run(runner, sched)
    assert [(r.start, len(r.logprobs)) for r in done["chunked"].prompt_logprobs] == [(1, 5), (6, 5), (11, 2)]
    assert [(r.start, len(r.logprobs)) for r in done["top0"].prompt_logprobs] == [(1, 3), (4, 3)]
    assert done["plain"].prompt_logprobs == [] and done["one"].prompt_logprobs == []
    for name, k in {"chunked": 5, "whole": 20, "top0": 0}.items():
        ref = prompt_logprobs_reference(ref_model, prompts[name])
        check_entries(ref, prompts[name], entries(done[name].prompt_logprobs, len(prompts[name])), k)
    for name in ("chunked", "plain"):  # the sampled rows are as without prompt logprobs (near ties aside)
        logits = ref_model(torch.tensor([prompts[name]])).logits[0, -1]
        top2 = logits.topk(2).values
        assert done[name].outputs[0] == int(logits.argmax()) or float(top2[0] - top2[1]) < 1e-4


def test_lora_prompt_logprobs_match_peft(lora_setup: LoraSetup) -> None:
    """lm_head with an adapter delta ("head") and every projection ("all"), next to a base request."""
    runner = ModelRunner(lora_config(lora_setup.base_dir))
    slots = load_all(runner, lora_setup)
    sched = FakeScheduler(LORA_BLOCK_SIZE, LORA_NUM_BLOCKS)
    sched.add("head", lora_setup.prompts["head"], with_prompt_logprobs(4), chunk=4, lora_slot=slots["head"])
    sched.add("all", lora_setup.prompts["all"], with_prompt_logprobs(3), chunk=6, lora_slot=slots["all"])
    sched.add("base", lora_setup.prompts["base"], with_prompt_logprobs(3), chunk=5)
    done = run_to_completion(runner, sched)
    models = {
        "head": load_peft_reference(lora_setup.base_dir, lora_setup.adapter_dirs["head"]),
        "all": load_peft_reference(lora_setup.base_dir, lora_setup.adapter_dirs["all"]),
        "base": load_reference(lora_setup.base_dir),
    }
    for name, k in {"head": 4, "all": 3, "base": 3}.items():
        prompt = lora_setup.prompts[name]
        ref = prompt_logprobs_reference(models[name], prompt)
        check_entries(ref, prompt, entries(done[name].prompt_logprobs, len(prompt)), k)


def test_minus_infinity_is_clamped_and_nan_fails_only_its_request() -> None:
    logits = torch.randn(3, 10)
    logits[0, 4] = float("-inf")  # row 0 scores token 4: impossible
    logits[1, [2, 7]] = float("-inf")
    logits[2, 5] = float("nan")
    model = SimpleNamespace(compute_logits=lambda hidden, lora=None: logits[hidden[:, 0].long()])
    hidden = torch.arange(3, dtype=torch.float32)[:, None]  # row i of the batch gives logits[i]
    rows = prompt_logprobs.PromptRows(
        [0, 1, 2],
        [4, 3, 1],
        [-1, -1, -1],
        [prompt_logprobs.PromptSpan("a", 1, 2, 9), prompt_logprobs.PromptSpan("b", 5, 1, 2)],
    )
    reports, failed = prompt_logprobs.finish(prompt_logprobs.launch(model, hidden, rows, vocab_size=10))
    ref = torch.log_softmax(logits[:2], dim=-1)
    (a,) = reports
    assert a.req_id == "a" and a.start == 1 and a.logprobs[0] == -9999.0
    assert a.logprobs[1] == float(ref[1, 3]) and a.ranks == [10, int((ref[1] >= ref[1, 3]).sum())]
    assert a.top_token_ids == [ref[i].topk(9).indices.tolist() for i in range(2)]
    assert a.top_logprobs[1][-1] == -9999.0 and all(math.isfinite(v) for top in a.top_logprobs for v in top)
    assert [f.req_id for f in failed] == ["b"] and "NaN" in failed[0].message and "5..5" in failed[0].message
