"""`--event-log-content hashed`: the core, fed prefix digests instead of token ids (and blank
logprobs), decides exactly what it decides on token ids, the shell gets every token id and logprob
back on the way out, and the tables it keeps for that end with their requests."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from ledgerserve.scheduler_proc.redaction import MIN_DIGEST, Redactor
from ledgerserve.shared import events as ev
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.sim.workload import run_adapter_workload, run_workload
from tests.scheduler_proc.driver import EOS, FILLER, Driver
from tests.scheduler_proc.test_adapter_random import _marked_driver


class RedactedCore:
    """The core behind the shell's redaction, as the ledger (scheduler_proc/ledger.py) puts it: each
    input is pseudonymized before the core (and the log) sees it, each decision restored after."""

    def __init__(self, core: Any, redactor: Redactor) -> None:
        self.core, self.redactor = core, redactor
        self.seen: list[Any] = []  # what the log holds: inputs as applied, decisions as made

    def apply(self, event: Any) -> list[Any]:
        logged = self.redactor.inbound(event)
        decisions = self.core.apply(logged)
        self.seen += [logged, *decisions]
        return [self.redactor.outbound(decision) for decision in decisions]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)


def hashed(d: Driver) -> Driver:
    """`d` (built with ready=False) with its core behind a hashing redactor, then ready."""
    d.core = RedactedCore(d.core, Redactor("hashed"))
    d.ready()
    return d


def keyless(decision: Any) -> Any:
    """What does not depend on the digests' key: block hashes and state digests chain from them."""
    if isinstance(decision, ev.PrefixCached):
        return msgspec.structs.replace(decision, block_hashes=[])
    if isinstance(decision, ev.StateDigest):
        return msgspec.structs.replace(decision, digest=0)
    return decision


def check_content_free(seen: list[Any]) -> None:
    """No prompt or sampled token id reached the core, but a sampled stop that ended its request."""
    for i, event in enumerate(seen):
        if isinstance(event, ev.RequestArrived):
            assert all(v >= MIN_DIGEST for v in event.prompt_token_ids)
        if isinstance(event, ev.StepCompleted):
            for token in event.sampled:
                if token.token_id < MIN_DIGEST:
                    emitted = next(e for e in seen[i:] if isinstance(e, ev.TokensEmitted) and e.req_id == token.req_id)
                    assert (emitted.finish_reason, emitted.stop_token_id) == ("stop", token.token_id)


def test_the_core_decides_on_digests_as_on_token_ids():
    """Random workloads over small pools (prefix hits, preemptions, min_tokens over EOS, stop ids,
    aborts), one step at a time and with async scheduling: every decision is the one made on token
    ids (block hashes and state digests aside), restored."""
    num_preempted = num_cached = num_eos_passed = 0
    for seed in range(30):
        for steps_in_flight in (1, 2):
            settings = dict(
                num_kv_blocks=6 + seed % 9,
                max_num_seqs=1 + seed % 5,
                max_num_batched_tokens=1 + seed % 25,
                max_steps_in_flight=steps_in_flight,
            )
            plain, redacted = Driver(**settings), hashed(Driver(ready=False, **settings))
            run_workload(plain, seed, 80)
            run_workload(redacted, seed, 80)
            assert [keyless(x) for x in redacted.decisions] == [keyless(x) for x in plain.decisions], seed
            assert redacted.core.redactor.reqs == {}  # every request's table went with it
            check_content_free(redacted.core.seen)
            num_preempted += len(plain.of_type(ev.RequestPreempted))
            num_cached += sum(e.num_cached_tokens for e in plain.of_type(ev.TokensEmitted))
            num_eos_passed += sum(EOS in out[:-1] for out in plain.outputs.values())
    assert num_preempted and num_cached and num_eos_passed  # the workloads reach what is at stake


@pytest.mark.parametrize("overlap", [False, True])
def test_adapter_workloads_decide_the_same(overlap):
    """Adapter namespaces, failed loads failing their requests, requests for unknown adapters."""
    for seed in range(6):
        plain = _marked_driver(seed, overlap, max_steps_in_flight=2)
        redacted = hashed(_marked_driver(seed, overlap, max_steps_in_flight=2, ready=False))
        run_adapter_workload(plain, seed, marks=True)
        run_adapter_workload(redacted, seed, marks=True)
        assert [keyless(x) for x in redacted.decisions] == [keyless(x) for x in plain.decisions], seed
        assert redacted.core.redactor.reqs == {}
        check_content_free(redacted.core.seen)


def test_prefix_digests_say_nothing_of_single_tokens():
    redactor = Redactor("hashed")
    sampling = SamplingParams()
    values = redactor.inbound(ev.RequestArrived("a", [7] * 8 + [1, 2, 3], sampling)).prompt_token_ids
    assert len(set(values)) == 11 and all(MIN_DIGEST <= v < 2**63 for v in values)  # a repeated token too
    other = redactor.inbound(ev.RequestArrived("b", [7] * 8 + [1, 2, 4], sampling)).prompt_token_ids
    assert other[:10] == values[:10] and other[10] != values[10]  # equal prefixes, equal digests
    elsewhere = redactor.inbound(ev.RequestArrived("c", [1, 2, 3], sampling)).prompt_token_ids
    assert not set(elsewhere) & set(values)  # the same tokens after another prefix
    next_run = Redactor("hashed").inbound(ev.RequestArrived("a", [7] * 8 + [1, 2, 3], sampling)).prompt_token_ids
    assert not set(next_run) & set(values)  # another run, another key
    arrived = ev.RequestArrived("a", [7, 8], sampling)
    assert Redactor("tokens").inbound(arrived) is arrived and Redactor().outbound(arrived) is arrived


def test_a_duplicate_id_leaves_the_live_request_whole():
    """An arrival reusing a live id is refused by the core; the live request's table stays."""
    d = hashed(Driver(ready=False))
    d.arrive("a", 6, max_tokens=3)
    d.complete()
    (rejected,) = d.arrive("a", 4, max_tokens=2)
    assert rejected.param == "request_id"
    d.script("a", [40, 41])
    d.run()
    assert d.outputs["a"] == [FILLER, 40, 41] and d.finish_reasons["a"] == "length"
    assert d.core.redactor.reqs == {}


def test_logprobs_go_back_on_their_tokens():
    """Sampled and prompt logprobs reach the core as zeros of their shape (the core checks prompt
    reports' shapes) and the client as they were sampled."""
    redactor = Redactor("hashed")
    redactor.inbound(ev.WorkerReady(0, 8, 100, [EOS], "cpu", "float32"))
    arrived = redactor.inbound(ev.RequestArrived("a", [11, 12, 13], SamplingParams(logprobs=2, prompt_logprobs=1)))
    real = ev.TokenLogprobs(-0.5, [21, 22], [-0.5, -1.25])
    report = ev.PromptLogprobs("a", 1, [-1.5, -2.5], [3, 1], [[40], [41]], [[-0.1], [-0.2]])
    logged = redactor.inbound(ev.StepCompleted(1, 0, [ev.SampledToken("a", 21, real)], [], [report]))
    (token,) = logged.sampled
    assert token.token_id >= MIN_DIGEST and token.logprobs == ev.TokenLogprobs(0.0, [0, 0], [0.0, 0.0])
    assert logged.prompt_logprobs == [ev.PromptLogprobs("a", 1, [0.0, 0.0], [0, 0], [[0], [0]], [[0.0], [0.0]])]
    blank_tail = ev.PromptLogprobs("a", 2, [0.0], [0], [[0]], [[0.0]])  # position 1 went out before
    sent = redactor.outbound(ev.TokensEmitted("a", [token.token_id], None, [token.logprobs], 3, 0, None, blank_tail))
    assert sent.new_token_ids == [21] and sent.logprobs == [real]
    assert sent.prompt_logprobs == ev.PromptLogprobs("a", 2, [-2.5], [1], [[41]], [[-0.2]])
    plan = ev.StepPlan(2, [ev.NewReq("a", arrived.prompt_token_ids + [token.token_id], 3, arrived.sampling, [0], 0, 4)])
    assert redactor.outbound(plan).new_reqs[0].token_ids == [11, 12, 13, 21]  # after a preemption
    redactor.outbound(ev.RequestFinished("a", "length", 1))
    assert redactor.reqs == {}
