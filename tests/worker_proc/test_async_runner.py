"""ModelRunner one step ahead (async scheduling): plan N+1 is launched before step N's tokens
are read back, with placeholders for the tokens step N samples. It must give what the
synchronous path gives, and a placeholder the rule does not allow fails its request alone."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.shared.events import CachedReq, NewReq, StepPlan
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.runner import ModelRunner
from tests.reference import assert_greedy_matches
from tests.worker_proc.fake_scheduler import FakeReq, FakeScheduler, run_one_step_ahead, run_to_completion
from tests.worker_proc.lora_setup import BLOCK_SIZE as LORA_BLOCK_SIZE
from tests.worker_proc.lora_setup import GREEDY as LORA_GREEDY
from tests.worker_proc.lora_setup import NUM_BLOCKS as LORA_NUM_BLOCKS
from tests.worker_proc.lora_setup import LoraSetup, load_all, lora_config
from tests.worker_proc.test_lora_runner import CHUNKS
from tests.worker_proc.test_runner import BLOCK_SIZE, NUM_BLOCKS, tiny_config

ODD_IDS = tuple(range(3, 256, 2))  # stop ids that min_tokens must mask: half the vocabulary
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2)
# name -> (prompt length, chunk, sampling): every kind of request the ahead path must reproduce
REQS = {
    "greedy": (13, 5, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)),
    "seeded": (1, 1, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True, logprobs=1)),
    "min-tokens": (
        22,
        7,
        SamplingParams(max_tokens=10, temperature=0.0, min_tokens=6, stop_token_ids=ODD_IDS, logprobs=0),
    ),
    "one-token": (6, 3, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)),
    "seeded-min-tokens": (
        9,
        2,
        SamplingParams(
            max_tokens=9,
            temperature=0.8,
            top_k=40,
            seed=7,
            min_tokens=4,
            stop_token_ids=ODD_IDS,
            ignore_eos=True,
            logprobs=3,
        ),
    ),
}


def results(done: dict[str, FakeReq]) -> dict[str, tuple[list[int], list]]:
    """req_id -> (output tokens, their logprobs)."""
    return {req_id: (req.outputs, req.logprobs) for req_id, req in done.items()}


def _run(path: str, names: list[str], ahead: bool, plan_past_max_tokens: bool = False) -> dict[str, FakeReq]:
    runner = ModelRunner(tiny_config(path))
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS, plan_past_max_tokens)
    gen = torch.Generator().manual_seed(11)
    for name, (prompt_len, chunk, params) in REQS.items():
        prompt = torch.randint(3, 256, (prompt_len,), generator=gen).tolist()
        if name in names:
            sched.add(name, prompt, params, chunk=chunk)
    done = (run_one_step_ahead if ahead else run_to_completion)(runner, sched)
    assert runner.requests.reqs == {} and sorted(done) == sorted(names)
    return done


@pytest.mark.parametrize("plan_past_max_tokens", [False, True], ids=["stop-at-max", "past-max"])
def test_one_request_ahead_gives_exactly_the_sync_tokens_and_logprobs(
    tiny_checkpoint: str, plan_past_max_tokens: bool
) -> None:
    for name, (_, _, params) in REQS.items():
        sync, ahead = _run(tiny_checkpoint, [name], False), _run(tiny_checkpoint, [name], True, plan_past_max_tokens)
        assert ahead[name].outputs == sync[name].outputs, name
        assert ahead[name].logprobs == sync[name].logprobs, name
        assert len(sync[name].outputs) == params.max_tokens


def test_a_batch_ahead_gives_exactly_the_sync_tokens_and_logprobs(tiny_checkpoint: str) -> None:
    sync, ahead = _run(tiny_checkpoint, list(REQS), False), _run(tiny_checkpoint, list(REQS), True)
    assert results(ahead) == results(sync)


def test_a_batch_planned_past_max_tokens_gives_the_sync_tokens(tiny_checkpoint: str) -> None:
    """Logprobs agree to float32 rounding only: a request that finished at step N still has a
    row in step N+1 (its extra token is dropped), and a batch's size moves the CPU matmul's rounding."""
    sync, ahead = _run(tiny_checkpoint, list(REQS), False), _run(tiny_checkpoint, list(REQS), True, True)
    for name in REQS:
        assert ahead[name].outputs == sync[name].outputs, name
        for got, want in zip(ahead[name].logprobs, sync[name].logprobs, strict=True):
            assert (got is None) == (want is None), name
            if got is not None:
                assert got.top_token_ids == want.top_token_ids and abs(got.logprob - want.logprob) < 1e-5


def test_min_tokens_masks_the_stop_ids_ahead(tiny_checkpoint: str) -> None:
    """A placeholder step counts its pending token, so the first output it may stop on is min_tokens'."""
    outputs = _run(tiny_checkpoint, ["min-tokens"], True)["min-tokens"].outputs
    assert all(t not in ODD_IDS for t in outputs[:6])


def test_mixed_adapters_ahead_match_peft_and_sync(lora_setup: LoraSetup) -> None:
    def run(ahead: bool) -> dict[str, list[int]]:
        runner = ModelRunner(lora_config(lora_setup.base_dir))
        slots = load_all(runner, lora_setup)
        sched = FakeScheduler(LORA_BLOCK_SIZE, LORA_NUM_BLOCKS)
        for name, prompt in lora_setup.prompts.items():
            sched.add(name, prompt, LORA_GREEDY, chunk=CHUNKS[name], lora_slot=slots.get(name, -1))
        done = (run_one_step_ahead if ahead else run_to_completion)(runner, sched)
        return {name: req.outputs for name, req in done.items()}

    ahead = run(True)
    assert ahead == run(False)
    assert_greedy_matches(ahead, lora_setup.refs)


def _prefill(runner: ModelRunner, req_ids: list[str], sampling: SamplingParams = GREEDY) -> dict[str, int]:
    """Step 0: each request's 4-token prompt, sampling its first output; req_id -> that output."""
    plan = StepPlan(0, [NewReq(r, [3, 4, 5, 6], 4, sampling, [2 * i, 2 * i + 1], 0, 4) for i, r in enumerate(req_ids)])
    done, _ = runner.execute(plan)
    assert done.failed == []
    return {s.req_id: s.token_id for s in done.sampled}


def _decode(req_id: str, new_token_ids: list[int], num_computed: int, num_scheduled: int = 1) -> CachedReq:
    return CachedReq(req_id, new_token_ids, [], num_computed, num_scheduled)


def test_placeholder_takes_the_previous_steps_token_on_the_device(tiny_checkpoint: str) -> None:
    sync, ahead = ModelRunner(tiny_config(tiny_checkpoint)), ModelRunner(tiny_config(tiny_checkpoint))
    first = _prefill(sync, ["a"])["a"]
    assert _prefill(ahead, ["a"]) == {"a": first}
    want, _ = sync.execute(StepPlan(1, cached_reqs=[_decode("a", [first], 4)]))
    got, _ = ahead.execute(StepPlan(1, cached_reqs=[_decode("a", [], 4)]))  # token 4 is a placeholder
    assert got == want
    # the next plan brings token 4 and schedules token 5 as a placeholder again
    want, _ = sync.execute(StepPlan(2, cached_reqs=[_decode("a", [want.sampled[0].token_id], 5)]))
    got, _ = ahead.execute(StepPlan(2, cached_reqs=[_decode("a", [first], 5)]))
    assert got == want and ahead.requests.reqs["a"].token_ids == [3, 4, 5, 6, first]


def test_placeholders_the_rule_does_not_allow_fail_their_request_alone(tiny_checkpoint: str) -> None:
    runner = ModelRunner(tiny_config(tiny_checkpoint))
    first = _prefill(runner, ["ok", "two-tokens", "gap"])
    plan = StepPlan(
        1,
        [NewReq("mid-prefill", list(range(3, 13)), 10, GREEDY, [20, 21, 22], 0, 4)],
        [_decode("ok", [], 4), _decode("two-tokens", [], 4, 2)],
    )  # "gap" sits this step out
    done, _ = runner.execute(plan)
    assert [s.req_id for s in done.sampled] == ["ok"]
    assert [f.req_id for f in done.failed] == ["two-tokens"]
    assert "scheduled up to token 6 but only 4 tokens are known" in done.failed[0].message
    # "gap" sampled in step 0, not in step 1; "mid-prefill" computed tokens 0..3 and sampled nothing
    plan = StepPlan(
        2, cached_reqs=[_decode("ok", [first["ok"]], 5), _decode("gap", [], 4), _decode("mid-prefill", [], 10)]
    )
    done, _ = runner.execute(plan)
    assert [s.req_id for s in done.sampled] == ["ok"]
    assert {f.req_id: f.message for f in done.failed} == {
        "gap": "scheduled up to token 5 but only 4 tokens are known",
        "mid-prefill": "scheduled up to token 11 but only 10 tokens are known",
    }
    assert sorted(runner.requests.reqs) == ["ok"]


def test_a_penalised_request_with_a_placeholder_fails_alone(tiny_checkpoint: str) -> None:
    runner = ModelRunner(tiny_config(tiny_checkpoint))
    first = _prefill(runner, ["ok"])["ok"]
    penalised = SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3)
    plan = StepPlan(1, [NewReq("pen", [3, 4, 5, 6], 4, penalised, [10, 11], 0, 4)], [_decode("ok", [], 4)])
    second = {s.req_id: s.token_id for s in runner.execute(plan)[0].sampled}
    done, _ = runner.execute(StepPlan(2, cached_reqs=[_decode("ok", [first], 5), _decode("pen", [], 4)]))
    assert [f.req_id for f in done.failed] == ["pen"] and "penalties" in done.failed[0].message
    assert sorted(runner.requests.reqs) == ["ok"] and runner.requests.reqs["ok"].token_ids == [3, 4, 5, 6, first]
    clean = ModelRunner(tiny_config(tiny_checkpoint))  # "ok" alone, in step: the same tokens
    _prefill(clean, ["ok"])
    want = clean.execute(StepPlan(1, cached_reqs=[_decode("ok", [first], 4)]))[0].sampled
    assert [s.token_id for s in want] == [second["ok"]]
    want = clean.execute(StepPlan(2, cached_reqs=[_decode("ok", [second["ok"]], 5)]))[0].sampled
    assert [s.token_id for s in done.sampled] == [s.token_id for s in want]


def test_a_step_with_nothing_scheduled_ends_every_placeholder(tiny_checkpoint: str) -> None:
    runner = ModelRunner(tiny_config(tiny_checkpoint))
    _prefill(runner, ["a", "b"])
    in_flight = runner.launch(StepPlan(1, finished_req_ids=["b"]))
    done, digest = runner.complete(in_flight)
    assert done.sampled == [] and done.failed == [] and digest.step == 1 and sorted(runner.requests.reqs) == ["a"]
    done, _ = runner.execute(StepPlan(2, cached_reqs=[_decode("a", [], 4)]))
    assert [f.req_id for f in done.failed] == ["a"] and "only 4 tokens are known" in done.failed[0].message


def test_launch_reports_failures_and_the_digest_before_the_read_back(tiny_checkpoint: str) -> None:
    runner = ModelRunner(tiny_config(tiny_checkpoint))
    plan = StepPlan(
        0, [NewReq("good", [3, 4, 5], 3, GREEDY, [7], 0, 3), NewReq("bad", [3, 4, 5], 3, GREEDY, [NUM_BLOCKS], 0, 3)]
    )
    in_flight = runner.launch(plan)
    assert [f.req_id for f in in_flight.failed] == ["bad"] and in_flight.digest.digest == runner.digest()
    assert in_flight.sampling_req_ids == ["good"]
    done, digest = runner.complete(in_flight)
    assert [s.req_id for s in done.sampled] == ["good"] and done.failed == in_flight.failed
    assert digest == in_flight.digest


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_cuda_ahead_matches_sync(lora_setup: LoraSetup, enforce_eager: bool) -> None:
    """bf16 on CUDA, decode by graph replay (or eager): the placeholders are written into the
    graph's static input row (or the eager batch) on the device; tokens match the sync path's."""

    def run(ahead: bool) -> tuple[dict[str, list[int]], int]:
        runner = ModelRunner(
            lora_config(lora_setup.base_dir, device="cuda", dtype="bfloat16", enforce_eager=enforce_eager)
        )
        slots = load_all(runner, lora_setup)
        sched = FakeScheduler(LORA_BLOCK_SIZE, LORA_NUM_BLOCKS)
        for name, prompt in lora_setup.prompts.items():
            sched.add(name, prompt, LORA_GREEDY, chunk=CHUNKS[name], lora_slot=slots.get(name, -1))
        for name, (prompt_len, chunk, params) in REQS.items():
            sched.add(name, lora_setup.prompts["all"][:prompt_len], params, chunk=chunk, lora_slot=slots["mlp"])
        done = (run_one_step_ahead if ahead else run_to_completion)(runner, sched)
        return {name: req.outputs for name, req in done.items()}, runner.graphs.replays if runner.graphs else 0

    (ahead, ahead_replays), (sync, sync_replays) = run(True), run(False)
    assert ahead == sync
    assert (ahead_replays > 0 and sync_replays > 0) != enforce_eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_cuda_launch_with_placeholders_never_waits_on_the_device(lora_setup: LoraSetup, enforce_eager: bool) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir, device="cuda", dtype="bfloat16", enforce_eager=enforce_eager))
    params = [REQS[name][2] for name in ("greedy", "seeded", "min-tokens", "seeded-min-tokens")]
    runner.launch(
        StepPlan(0, [NewReq(f"r{i}", [3 + i, 4, 5, 6], 4, p, [2 * i, 2 * i + 1], 0, 4) for i, p in enumerate(params)])
    )
    decode = StepPlan(1, cached_reqs=[_decode(f"r{i}", [], 4) for i in range(len(params))])
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing CUDA call raises
    try:
        in_flight = runner.launch(decode)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert in_flight.failed == [] and len(runner.complete(in_flight)[0].sampled) == len(params)
    assert (runner.graphs is not None and runner.graphs.replays == 1) != enforce_eager
