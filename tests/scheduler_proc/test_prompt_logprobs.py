"""Prompt logprobs in the core: a request asking for them takes no prefix-cache hit (a cached
position has no logits) but still caches its blocks, and the core passes rank 0's reports on
so that every prompt position goes out exactly once, before the first token, through chunked
prefill, async scheduling and preemption (a recompute reports positions again)."""

from __future__ import annotations

import msgspec
import pytest

from ledgerserve.shared import events as ev
from ledgerserve.sim import group as group_module
from ledgerserve.sim.reports import fake_reports
from tests.scheduler_proc.driver import Driver


def new_reqs(d: Driver, req_id: str) -> list[ev.NewReq]:
    return [r for plan in d.plans for r in plan.new_reqs if r.req_id == req_id]


def sent(d: Driver, req_id: str) -> list[ev.PromptLogprobs]:
    return [e.prompt_logprobs for e in d.emitted if e.req_id == req_id and e.prompt_logprobs is not None]


def first_reports(d: Driver, req_id: str) -> dict[int, tuple[float, int, list[int], list[float]]]:
    """Position -> the first value rank 0 reported for it, from the logged inputs."""
    out: dict[int, tuple[float, int, list[int], list[float]]] = {}
    for event in d.inputs:
        for r in getattr(event, "prompt_logprobs", []):
            if r.req_id != req_id:
                continue
            tops = zip(r.top_token_ids or [[]] * len(r.logprobs), r.top_logprobs or [[]] * len(r.logprobs))
            for i, (lp, rank, (ids, values)) in enumerate(zip(r.logprobs, r.ranks, tops)):
                out.setdefault(r.start + i, (lp, rank, ids, values))
    return out


def check_sent_once(d: Driver, req_id: str, num_prompt_tokens: int) -> None:
    """Positions 1..P-1 went out exactly once, each as first reported, all before the first token."""
    got: dict[int, tuple[float, int, list[int], list[float]]] = {}
    for r in sent(d, req_id):
        tops = zip(r.top_token_ids or [[]] * len(r.logprobs), r.top_logprobs or [[]] * len(r.logprobs))
        for i, (lp, rank, (ids, values)) in enumerate(zip(r.logprobs, r.ranks, tops)):
            assert r.start + i not in got, f"position {r.start + i} sent twice"
            got[r.start + i] = (lp, rank, ids, values)
    assert sorted(got) == list(range(1, num_prompt_tokens))
    assert got == first_reports(d, req_id)
    events = [e for e in d.emitted if e.req_id == req_id]
    first_token = next(i for i, e in enumerate(events) if e.new_token_ids)
    assert all(e.prompt_logprobs is None for e in events[first_token:])
    assert all(not e.new_token_ids and e.finish_reason is None for e in events[:first_token])


def test_no_prefix_hit_for_prompt_logprobs_but_its_blocks_are_cached() -> None:
    d = Driver(num_kv_blocks=32, block_size=4)
    prompt = list(range(100, 110))  # two full blocks and two tokens
    d.arrive("first", prompt, max_tokens=2)
    d.run()
    d.arrive("plain", prompt, max_tokens=2)
    d.arrive("scored", prompt, max_tokens=2, prompt_logprobs=1)
    d.run()
    assert new_reqs(d, "plain")[0].num_computed_tokens == 8
    (scored,) = new_reqs(d, "scored")
    assert scored.num_computed_tokens == 0 and scored.num_scheduled_tokens == 10
    assert {e.num_cached_tokens for e in d.emitted if e.req_id == "scored"} == {0}
    check_sent_once(d, "scored", len(prompt))
    assert sent(d, "plain") == [] and sent(d, "first") == []
    fresh = list(range(300, 310))
    d.arrive("scored-fresh", fresh, max_tokens=2, prompt_logprobs=0)
    d.run()
    assert sum(len(c.block_ids) for c in d.of_type(ev.PrefixCached) if c.req_id == "scored-fresh") == 2
    d.arrive("plain-after", fresh, max_tokens=2)
    d.run()
    assert new_reqs(d, "plain-after")[0].num_computed_tokens == 8
    check_sent_once(d, "scored-fresh", len(fresh))
    d.check_idle()


@pytest.mark.parametrize("max_steps_in_flight", [1, 2])
def test_chunked_prefill_sends_each_chunk_once_before_the_first_token(max_steps_in_flight: int) -> None:
    d = Driver(max_num_batched_tokens=8, max_steps_in_flight=max_steps_in_flight)
    d.arrive("long", 22, max_tokens=3, prompt_logprobs=4)
    d.arrive("short", 5, max_tokens=3)
    d.arrive("one", 1, max_tokens=3, prompt_logprobs=2)  # nothing scores position 0
    d.run()
    assert [(r.start, len(r.logprobs)) for r in sent(d, "long")] == [(1, 8), (9, 8), (17, 5)]
    check_sent_once(d, "long", 22)
    assert sent(d, "one") == [] and d.outputs["one"] == [7, 7, 7]
    d.check_idle()


@pytest.mark.parametrize("budget", [4, 5, 8])
def test_preempted_request_sends_no_position_twice_and_loses_none(budget: int) -> None:
    """b is preempted mid-prefill (several times), then recomputes from position 0."""
    d = Driver(num_kv_blocks=5, block_size=4, max_num_batched_tokens=budget)
    d.arrive("a", 8, max_tokens=10)
    d.arrive("b", list(range(200, 211)), max_tokens=4, prompt_logprobs=2)
    d.run()
    assert d.of_type(ev.RequestPreempted) and all(p.req_id == "b" for p in d.of_type(ev.RequestPreempted))
    assert all(r.num_computed_tokens == 0 for r in new_reqs(d, "b"))
    check_sent_once(d, "b", 11)
    assert len(d.outputs["a"]) == 10 and len(d.outputs["b"]) == 4
    d.check_idle()


def test_preemption_after_prefill_sends_nothing_again() -> None:
    d = Driver(num_kv_blocks=4, block_size=4, max_num_batched_tokens=64)
    d.arrive("a", 7, max_tokens=6)
    d.arrive("b", list(range(200, 207)), max_tokens=6, prompt_logprobs=3)
    d.run()
    (preempted,) = d.of_type(ev.RequestPreempted)
    resumed = new_reqs(d, "b")[1]
    assert preempted.req_id == "b" and resumed.token_ids[7:] and resumed.num_computed_tokens == 0
    check_sent_once(d, "b", 7)
    assert len(sent(d, "b")) == 1
    d.check_idle()


def _drop(reports: list[ev.PromptLogprobs]) -> list[ev.PromptLogprobs]:
    return []


def _shift(reports: list[ev.PromptLogprobs]) -> list[ev.PromptLogprobs]:
    return [msgspec.structs.replace(r, start=r.start + 1) for r in reports]


def _short_top(reports: list[ev.PromptLogprobs]) -> list[ev.PromptLogprobs]:
    return [msgspec.structs.replace(r, top_logprobs=r.top_logprobs[:-1]) for r in reports]


def _unasked(reports: list[ev.PromptLogprobs]) -> list[ev.PromptLogprobs]:
    return reports + [ev.PromptLogprobs("plain", 1, [-1.0], [1])]


@pytest.mark.parametrize(
    ("mangle", "failed", "words"),
    [
        (_drop, "scored", "no prompt logprobs for positions 1..9"),
        (_shift, "scored", "expected 9 from position 1"),
        (_short_top, "scored", "mismatched lengths"),
        (_unasked, "plain", "none were due"),
    ],
)
def test_bad_report_fails_only_its_request(monkeypatch, mangle, failed: str, words: str) -> None:
    monkeypatch.setattr(group_module, "fake_reports", lambda plan, asks: mangle(fake_reports(plan, asks)))
    d = Driver()
    d.arrive("scored", 10, max_tokens=3, prompt_logprobs=2)
    d.arrive("plain", list(range(300, 310)), max_tokens=3)
    d.run()
    (rejected,) = d.of_type(ev.RequestRejected)
    assert rejected.req_id == failed and rejected.code == 500 and words in rejected.message
    assert [f.req_id for f in d.of_type(ev.RequestFinished) if f.finish_reason == "error"] == [failed]
    (other,) = {"scored", "plain"} - {failed}
    assert d.finish_reasons[other] == "length" and d.core.failure is None
    d.check_idle()
