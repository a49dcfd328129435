"""Sampler vs direct torch computations."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.sampler import Sampler, SamplingReq, apply_penalties, filtered_probs

CPU = torch.device("cpu")
VOCAB = 12


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _req(prompt=(1, 2), output=(), **kw) -> SamplingReq:
    return SamplingReq(SamplingParams(**kw), [*prompt, *output], len(prompt))


def test_greedy_is_argmax() -> None:
    logits = _logits(3)
    out = Sampler([], 0, CPU).sample(logits, [_req(temperature=0.0)] * 3)
    assert [r.token_id for r in out] == logits.argmax(-1).tolist()


def test_penalties_match_direct_formula() -> None:
    logits = _logits(1)
    prompt, output = [0, 3, 3], [5, 5, 7]
    req = _req(prompt, output, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits.clone(), [req])[0]
    want = logits[0].clone()
    for t in {0, 3, 5, 7}:
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t, count in ((5, 2), (7, 1)):
        want[t] -= 0.25 * count + 0.5
    torch.testing.assert_close(got, want)


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 2] = 10.0  # eos
    logits[:, 4] = 9.0  # stop id
    reqs = [
        _req(output=[7], temperature=0.0, min_tokens=2, stop_token_ids=(4,)),
        _req(output=[7, 8], temperature=0.0, min_tokens=2),
    ]
    out = Sampler([2], 0, CPU).sample(logits, reqs)
    assert out[0].token_id not in (2, 4)
    assert out[1].token_id == 2
    ignore = _req(output=[], temperature=0.0, min_tokens=3, ignore_eos=True)
    assert Sampler([2], 0, CPU).sample(logits[:1], [ignore])[0].token_id == 2


def test_filtered_probs_match_direct() -> None:
    logits = _logits(1, seed=4)
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.8, min_p=0.05)
    got = filtered_probs(logits, [params])[0]
    scaled = logits[0] / 0.7
    probs = torch.softmax(scaled, -1)
    keep = probs >= 0.05 * probs.max()
    keep &= scaled >= scaled.sort(descending=True).values[5]
    order = torch.argsort(torch.where(keep, probs, torch.zeros_like(probs)), descending=True)
    renorm = torch.where(keep, probs, torch.zeros_like(probs))
    renorm = renorm / renorm.sum()
    top_p_keep = torch.zeros(VOCAB, dtype=torch.bool)
    total = 0.0
    for t in order.tolist():  # smallest prefix of most likely tokens reaching top_p
        top_p_keep[t] = True
        total += float(renorm[t])
        if total >= 0.8:
            break
    want = torch.where(top_p_keep, probs, torch.zeros_like(probs))
    torch.testing.assert_close(got, want / want.sum())


def test_seeded_sampling_ignores_batch_and_follows_position() -> None:
    logits = _logits(3, seed=1)
    seeded = _req(output=[1, 1, 1], seed=42)
    alone = Sampler([], 0, CPU).sample(logits[1:2], [seeded])[0].token_id
    other = [_req(), _req(seed=7)]
    in_batch = Sampler([], 123, CPU).sample(logits, [other[0], seeded, other[1]])[1].token_id
    assert alone == in_batch
    draws = {Sampler([], 0, CPU).sample(logits[1:2], [_req(output=[1] * n, seed=42)])[0].token_id for n in range(20)}
    assert len(draws) > 1  # position changes the draw


def test_sampling_distribution_follows_softmax() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    probs = torch.softmax(logits[0] / 0.9, -1)
    sampler = Sampler([], 0, CPU)
    counts = torch.zeros(4)
    for seed in range(3000):
        counts[sampler.sample(logits, [_req(seed=seed, temperature=0.9)])[0].token_id] += 1
    torch.testing.assert_close(counts / 3000, probs, atol=0.03, rtol=0)


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits(4, seed=9)
    reqs = [_req(top_k=1, seed=1), _req(top_p=1e-6, seed=2), _req(top_k=1), _req(min_p=1.0)]
    out = Sampler([], 0, CPU).sample(logits, reqs)
    assert [r.token_id for r in out] == logits.argmax(-1).tolist()


def test_logprobs_are_raw_log_softmax() -> None:
    logits = _logits(2, seed=5)
    reqs = [_req(temperature=0.5, logprobs=3, repetition_penalty=2.0, seed=3), _req(temperature=0.0, logprobs=0)]
    out = Sampler([], 0, CPU).sample(torch.cat([logits, logits[:1]]), reqs + [_req(temperature=0.0)])
    assert out[2].logprobs is None  # asked for none, in a step where others did
    raw = torch.log_softmax(logits, -1)
    lp0 = out[0].logprobs
    assert abs(lp0.logprob - float(raw[0, out[0].token_id])) < 1e-6
    values, ids = raw[0].topk(3)
    assert lp0.top_token_ids == ids.tolist()
    torch.testing.assert_close(torch.tensor(lp0.top_logprobs), values)
    assert out[1].logprobs.top_token_ids == [] and abs(out[1].logprobs.logprob - float(raw[1].max())) < 1e-6


def _dense_bias(pairs: tuple[tuple[int, float], ...]) -> torch.Tensor:  # [VOCAB]
    bias = torch.zeros(VOCAB)
    for token_id, value in pairs:
        bias[token_id] += value
    return bias


def test_logit_bias_equals_sampling_from_biased_logits() -> None:
    """A batch mixing biased and unbiased rows, greedy and seeded: the tokens are those drawn from
    logits + bias computed apart; logprobs stay the raw ones; the input logits are not touched."""
    logits = _logits(6, seed=11)
    before = logits.clone()
    biases = [((3, 5.0), (7, -2.5)), (), ((0, 100.0),), ((int(logits[3].argmax()), -100.0),), ((1, 1.5), (9, 4.0)), ()]
    kinds = [
        dict(temperature=0.0, logprobs=2),
        dict(temperature=0.0),
        dict(seed=5),
        dict(temperature=0.0),
        dict(seed=9, temperature=0.8, top_k=5, top_p=0.9, min_p=0.01),
        dict(seed=2),
    ]
    got = Sampler([], 0, CPU).sample(logits, [_req(logit_bias=b, **k) for b, k in zip(biases, kinds)])
    biased = logits + torch.stack([_dense_bias(b) for b in biases])
    want = Sampler([], 0, CPU).sample(biased, [_req(**k) for k in kinds])
    assert [r.token_id for r in got] == [r.token_id for r in want]
    for row in (0, 1, 3):  # greedy: the argmax of the biased logits
        assert got[row].token_id == int(biased[row].argmax())
    assert got[2].token_id == 0 and got[3].token_id != int(logits[3].argmax())
    raw = torch.log_softmax(logits[0], -1)
    assert abs(got[0].logprobs.logprob - float(raw[got[0].token_id])) < 1e-6
    assert torch.equal(logits, before)


def test_logit_bias_comes_before_the_repetition_penalty() -> None:
    """vLLM's order: (logit + bias) is penalised, not (penalised logit) + bias."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 4], logits[0, 5] = -2.0, 0.4
    req = _req(output=[4], temperature=0.0, repetition_penalty=2.0, logit_bias=((4, 3.0),))
    # bias first: (-2 + 3) / 2 = 0.5 beats 0.4; penalty first would give -2 * 2 + 3 = -1
    assert Sampler([], 0, CPU).sample(logits, [req])[0].token_id == 4


def test_sampling_req_splits_its_token_ids_without_holding_copies() -> None:
    token_ids = [5, 6, 7, 8, 9]
    req = SamplingReq(SamplingParams(), token_ids, 3)
    assert req.token_ids is token_ids  # the worker's list, not a per-step copy
    assert (req.prompt_token_ids, req.output_token_ids, req.num_output_tokens) == ([5, 6, 7], [8, 9], 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reading_a_step_back_does_not_wait_for_the_work_queued_after_it() -> None:
    """Async scheduling queues step N+1 before step N is read back: N's tokens (and logprobs)
    come back on their own copy's event, not behind N+1 on the stream."""
    device = torch.device("cuda")
    logits = _logits(4, seed=2).to(device)
    reqs = [_req(temperature=0.0, logprobs=2), _req(temperature=0.7, seed=1), _req(temperature=0.0), _req(logprobs=0)]
    sampler = Sampler([], 0, device)
    pending = sampler.launch(logits, reqs)
    torch.cuda._sleep(4_000_000_000)  # the next step: seconds of work on the same stream
    next_step_done = torch.cuda.Event()
    next_step_done.record()
    out = sampler.finish(pending)
    assert not next_step_done.query()  # read back while the next step still runs
    torch.cuda.synchronize()
    want = Sampler([], 0, CPU).sample(logits.cpu(), reqs)
    assert [r.token_id for r in out][::2] == [r.token_id for r in want][::2]  # the greedy rows
    assert abs(out[0].logprobs.logprob - want[0].logprobs.logprob) < 1e-5 and out[2].logprobs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_logit_bias_on_cuda_matches_the_cpu() -> None:
    """The bias scatter runs on the device from pinned host lists: the same greedy tokens as on the CPU."""
    logits = _logits(4, seed=3)
    reqs = [
        _req(temperature=0.0, logit_bias=((2, 50.0),)),
        _req(temperature=0.0),
        _req(temperature=0.0, logit_bias=((int(logits[2].argmax()), -100.0), (5, 1.0))),
        _req(output=[1], temperature=0.0, repetition_penalty=1.5, logit_bias=((1, 3.0), (8, -0.5))),
    ]
    on_cuda = Sampler([], 0, torch.device("cuda")).sample(logits.cuda(), reqs)
    on_cpu = Sampler([], 0, CPU).sample(logits, reqs)
    assert [r.token_id for r in on_cuda] == [r.token_id for r in on_cpu]
    assert on_cuda[0].token_id == 2 and on_cuda[2].token_id != int(logits[2].argmax())
