"""Preemption by recompute, rejection of requests that can never fit, aborts."""

from ledgerserve.shared import events as ev
from tests.scheduler_proc.driver import Driver


def _fill_pool() -> Driver:
    # 4 blocks of 4 tokens; a and b each take 2 blocks for their 8-token prompts.
    d = Driver(num_kv_blocks=4, block_size=4, max_num_batched_tokens=64)
    d.arrive("a", 7, max_tokens=6)
    d.arrive("b", list(range(200, 207)), max_tokens=6)  # no prefix shared with a
    d.complete()  # step 1: a prefills; step 2 planned: a decodes, b prefills
    return d


def test_newest_running_request_is_preempted_and_resumes_in_full():
    d = _fill_pool()
    d.script("a", [60, 61])
    d.script("b", [70])
    assert d.engine_stats.num_free_blocks == 0
    d.complete()  # a and b each need a third block: b (newest) is preempted
    (preempted,) = d.of_type(ev.RequestPreempted)
    assert preempted.req_id == "b" and preempted.step == d.in_flight.step
    assert d.in_flight.preempted_req_ids == ["b"]
    assert d.scheduled_tokens(d.in_flight) == {"a": 1}
    assert d.core.snapshot()["waiting"] == ["b"]
    d.run()
    resumed = [r for p in d.plans for r in p.new_reqs if r.req_id == "b"][1]
    assert resumed.token_ids == list(range(200, 207)) + [70]  # prompt + outputs so far
    # b's first block entered the prefix cache before the preemption and was not evicted
    # (free blocks go first), so b resumes from it and recomputes only the rest
    (cached,) = [x for x in d.of_type(ev.PrefixCached) if x.req_id == "b" and x.block_ids == resumed.block_ids[:1]]
    assert resumed.num_prompt_tokens == 7 and resumed.num_computed_tokens == 4
    assert len(d.outputs["a"]) == 6 and len(d.outputs["b"]) == 6
    assert d.finish_reasons == {"a": "length", "b": "length"}
    d.check_idle()


def test_preempted_request_goes_to_the_front_of_waiting():
    d = _fill_pool()
    d.arrive("c", 3, max_tokens=2)
    d.complete()
    assert d.core.snapshot()["waiting"] == ["b", "c"]
    assert d.of_type(ev.RequestPreempted)[0].req_id == "b"


def test_request_that_can_never_fit_is_rejected_not_livelocked():
    d = Driver(num_kv_blocks=4, block_size=4)
    (rejected,) = d.arrive("big", 17, max_tokens=1)
    assert isinstance(rejected, ev.RequestRejected) and rejected.code == 400
    assert "KV cache holds only 4 blocks" in rejected.message
    d.arrive("long", 8, max_tokens=100)  # fits the prompt, not the generation
    assert d.of_type(ev.RequestRejected)[-1].req_id == "long"
    assert not d.core.has_unfinished() and d.in_flight is None


def test_rejection_waits_for_capacity():
    d = Driver(num_kv_blocks=2, block_size=4, ready=False)
    assert d.arrive("a", 20) == []
    decisions = d.ready()
    assert [type(x) for x in decisions] == [ev.RequestRejected]


def test_prompt_longer_than_max_model_len_and_empty_prompt_rejected():
    d = Driver(max_model_len=16)
    assert "maximum context length is 16" in d.arrive("a", 17)[0].message
    assert "empty" in d.arrive("b", [])[0].message


def test_duplicate_req_id_rejected():
    d = Driver()
    d.arrive("a", 3)
    (rejected,) = d.arrive("a", 3)
    assert isinstance(rejected, ev.RequestRejected) and "already in use" in rejected.message


def test_abort_frees_blocks_at_once_and_ignores_late_tokens():
    d = Driver(num_kv_blocks=8)
    d.arrive("a", 9, max_tokens=5)
    assert d.engine_stats.num_free_blocks == 5
    decisions = d.abort("a")  # step 1 is still in flight
    assert d.engine_stats.num_free_blocks == 8
    emitted, finished = decisions
    assert emitted == ev.TokensEmitted("a", [], "abort", num_prompt_tokens=9)
    assert finished == ev.RequestFinished("a", "abort", 0)
    assert d.complete() == []  # its sampled token is ignored; nothing left to plan
    assert d.outputs == {"a": []}
    d.arrive("b", 3)
    assert d.in_flight.finished_req_ids == ["a"]


def test_abort_waiting_request_and_unknown_ids():
    d = Driver(max_num_seqs=1)
    d.arrive("a", 3)
    d.arrive("b", 3)
    assert [type(x) for x in d.abort("b")] == [ev.TokensEmitted, ev.RequestFinished]
    assert d.abort("b") == [] and d.abort("nope") == []
    d.complete()
    assert d.in_flight.finished_req_ids == []  # workers never saw b


def test_worker_failing_one_request():
    d = Driver()
    d.arrive("a", 3, max_tokens=4)
    d.arrive("b", 3, max_tokens=2)
    d.complete()
    decisions = d.complete(failed={"a": "NaN in logits"})
    finished = [x for x in decisions if isinstance(x, ev.RequestFinished)]
    assert finished[0] == ev.RequestFinished("a", "error", 1)
    assert any(isinstance(x, ev.RequestRejected) and x.code == 500 for x in decisions)
    d.run()
    assert d.finish_reasons == {"b": "length"}
    d.check_idle()
