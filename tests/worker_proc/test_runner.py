"""ModelRunner driven step by step through execute(), checked against transformers."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import CachedReq, NewReq, StepPlan
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.runner import ModelRunner
from tests.model_factory import load_reference
from tests.worker_proc.fake_scheduler import FakeScheduler, run_to_completion

BLOCK_SIZE = 4
NUM_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)


def tiny_config(path: str, **kw) -> EngineConfig:
    base = dict(
        model_dir=path,
        served_model_name="tiny",
        max_model_len=128,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_BLOCKS,
        seed=0,
    )
    return EngineConfig(**{**base, **kw})


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (13, 1, 22, 6)]


def _check_greedy_against_reference(ref, prompt: list[int], outputs: list[int], logprobs: list) -> None:
    ids = torch.tensor([prompt + outputs])
    with torch.no_grad():
        logits = ref(ids).logits[0, len(prompt) - 1 : -1]  # [num_outputs, vocab] predicting each output
    raw = torch.log_softmax(logits, -1)
    for i, token in enumerate(outputs):
        top2 = logits[i].topk(2).values
        if token != int(logits[i].argmax()):
            assert float(top2[0] - top2[1]) < 1e-4, f"output {i}: {token} vs {int(logits[i].argmax())}"
        assert abs(logprobs[i].logprob - float(raw[i, token])) < 1e-4
        assert logprobs[i].top_token_ids == raw[i].topk(2).indices.tolist() or float(top2[0] - top2[1]) < 1e-4


def test_chunked_prefill_and_decode_match_transformers(tiny_checkpoint: str) -> None:
    runner = ModelRunner(tiny_config(tiny_checkpoint))
    ref = load_reference(tiny_checkpoint)
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    for i, (prompt, chunk) in enumerate(zip(_prompts(runner.model_cfg.vocab_size), (5, 1, 7, 3))):
        sched.add(f"req-{i}", prompt, GREEDY, chunk=chunk)
    done = run_to_completion(runner, sched)
    assert sorted(done) == ["req-0", "req-1", "req-2", "req-3"]
    for req in done.values():
        assert len(req.outputs) == 16
        _check_greedy_against_reference(ref, req.prompt, req.outputs, req.logprobs)
    assert runner.requests.reqs == {}


def test_prefix_cached_blocks_are_reused(tiny_checkpoint: str) -> None:
    runner = ModelRunner(tiny_config(tiny_checkpoint))
    ref = load_reference(tiny_checkpoint)
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    prompt = _prompts(runner.model_cfg.vocab_size)[2]  # 22 tokens
    sched.add("a", prompt, GREEDY, chunk=8)
    completed, _ = runner.execute(sched.plan())  # computes tokens 0..7: blocks 0 and 1 full
    sched.complete(completed)
    shared = sched.running["a"].block_ids[:2]
    other = prompt[:8] + [5, 6, 7]
    sched.add("b", other, GREEDY, chunk=16, prefix_blocks=shared)
    done = run_to_completion(runner, sched)
    _check_greedy_against_reference(ref, other, done["b"].outputs, done["b"].logprobs)
    _check_greedy_against_reference(ref, prompt, done["a"].outputs, done["a"].logprobs)


def test_seeded_sampling_survives_preemption_and_batch_mix(tiny_checkpoint: str) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    prompts = _prompts(256)

    def run(preempt_at: int | None, with_other: bool) -> list[int]:
        runner = ModelRunner(tiny_config(tiny_checkpoint, seed=99 if with_other else 0))
        sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
        sched.add("s", prompts[0], params, chunk=6)
        if with_other:
            sched.add("o", prompts[2], SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True), chunk=3)
        for _ in range(200):
            if "s" not in sched.running:
                return sched.done["s"].outputs
            if preempt_at is not None and len(sched.running["s"].outputs) == preempt_at:
                sched.preempt("s")
                preempt_at = None
            completed, _ = runner.execute(sched.plan())
            sched.complete(completed)
        raise AssertionError("did not finish")

    plain = run(None, False)
    assert run(5, False) == plain
    assert run(3, True) == plain


def test_digest_ranks_and_isolated_failures(tiny_checkpoint: str) -> None:
    rank0 = ModelRunner(tiny_config(tiny_checkpoint), rank=0)
    rank1 = ModelRunner(tiny_config(tiny_checkpoint), rank=1)
    good = NewReq("good", [3, 4, 5], 3, GREEDY, [7], 0, 3)
    bad_block = NewReq("bad", [3, 4, 5], 3, GREEDY, [NUM_BLOCKS + 1], 0, 3)
    plan = StepPlan(0, [good, bad_block], [CachedReq("ghost", [1], [], 0, 1)])
    done0, digest0 = rank0.execute(plan)
    done1, digest1 = rank1.execute(plan)
    assert [s.req_id for s in done0.sampled] == ["good"] and done1.sampled == []
    assert sorted(f.req_id for f in done0.failed) == ["bad", "ghost"]
    assert digest0.digest == digest1.digest == rank0.digest()
    nxt = StepPlan(1, cached_reqs=[CachedReq("good", [done0.sampled[0].token_id], [9], 3, 1)])
    _, digest_after = rank0.execute(nxt)
    assert digest_after.digest != digest0.digest
    _, digest_empty = rank0.execute(StepPlan(2, finished_req_ids=["good"]))
    assert rank0.requests.reqs == {} and digest_empty.digest != digest_after.digest


def test_cached_update_with_a_block_out_of_range_fails_alone(tiny_checkpoint: str) -> None:
    runner = ModelRunner(tiny_config(tiny_checkpoint))
    plan = StepPlan(0, [NewReq(r, [3, 4, 5, 6], 4, GREEDY, [i], 0, 4) for i, r in enumerate(["a", "b"])])
    done, _ = runner.execute(plan)
    last = {s.req_id: s.token_id for s in done.sampled}
    # each request's 5th token needs a second block: b's is out of range
    cached = [CachedReq("a", [last["a"]], [5], 4, 1), CachedReq("b", [last["b"]], [NUM_BLOCKS], 4, 1)]
    done, _ = runner.execute(StepPlan(1, cached_reqs=cached))
    assert [s.req_id for s in done.sampled] == ["a"]
    assert [f.req_id for f in done.failed] == ["b"] and "out of range" in done.failed[0].message
    assert sorted(runner.requests.reqs) == ["a"]


def test_fault_switch_fails_only_the_request_holding_the_token(tiny_checkpoint: str, monkeypatch) -> None:
    clean = ModelRunner(tiny_config(tiny_checkpoint), rank=0)
    monkeypatch.setenv("LEDGERSERVE_TEST_FAULT_TOKEN_ID", "6")
    faulty = ModelRunner(tiny_config(tiny_checkpoint), rank=0)
    good = NewReq("good", [3, 4, 5], 3, GREEDY, [7], 0, 3)
    plan = StepPlan(0, [good, NewReq("bad", [3, 6, 5], 3, GREEDY, [8], 0, 3)])
    done, _ = faulty.execute(plan)
    expected, _ = clean.execute(StepPlan(0, [good]))
    assert [f.req_id for f in done.failed] == ["bad"] and "test fault" in done.failed[0].message
    assert done.sampled == expected.sampled and list(faulty.requests.reqs) == ["good"]


def test_mid_prefill_chunk_samples_nothing(tiny_checkpoint: str) -> None:
    runner = ModelRunner(tiny_config(tiny_checkpoint))
    done, _ = runner.execute(StepPlan(0, [NewReq("r", list(range(3, 13)), 10, GREEDY, [0, 1, 2], 0, 4)]))
    assert done.sampled == [] and done.failed == []
    done, _ = runner.execute(StepPlan(1, cached_reqs=[CachedReq("r", [], [], 4, 6)]))
    assert [s.req_id for s in done.sampled] == ["r"]


def test_ready_and_dummy_load(tiny_checkpoint: str) -> None:
    runner = ModelRunner(tiny_config(tiny_checkpoint, load_format="dummy", num_kv_blocks=None, max_num_seqs=2))
    ready = runner.ready()
    assert ready.num_kv_blocks == 2 * 32 and ready.vocab_size == 256 and ready.eos_token_ids == [2]
    assert ready.device == "cpu" and ready.dtype == "float32"
    sched = FakeScheduler(BLOCK_SIZE, ready.num_kv_blocks)
    sched.add("d", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0.8, seed=3), chunk=2)
    assert len(run_to_completion(runner, sched)["d"].outputs) == 4


def test_bad_config_raises(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        ModelRunner(tiny_config(str(tmp_path)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runner_matches_cpu(tiny_checkpoint: str) -> None:
    outputs = {}
    for device in ("cpu", "cuda"):
        runner = ModelRunner(tiny_config(tiny_checkpoint, device=device))
        sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
        for i, prompt in enumerate(_prompts(256)):
            sched.add(f"req-{i}", prompt, GREEDY, chunk=5)
        outputs[device] = {k: v.outputs for k, v in run_to_completion(runner, sched).items()}
    assert outputs["cuda"] == outputs["cpu"]
