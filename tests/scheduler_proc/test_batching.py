"""Continuous batching, chunked prefill budgets, step pacing."""

from ledgerserve.shared import events as ev
from tests.scheduler_proc.driver import Driver


def test_no_plan_before_every_rank_is_ready():
    d = Driver(tensor_parallel_size=2, ready=False)
    assert d.arrive("a", 4) == []
    assert d.ready(rank=0) == []
    decisions = d.ready(rank=1)
    assert [type(x) for x in decisions] == [ev.StepPlan, ev.StateDigest]
    assert d.engine_stats.num_total_blocks == 64


def test_capacity_is_the_smallest_rank():
    d = Driver(tensor_parallel_size=2, ready=False)
    d.send(ev.WorkerReady(0, 30, 1000, [2], "cpu", "float32"))
    d.send(ev.WorkerReady(1, 20, 1000, [2], "cpu", "float32"))
    assert d.engine_stats.num_total_blocks == 20


def test_one_step_in_flight_at_a_time():
    d = Driver()
    d.arrive("a", 4)
    assert d.in_flight is not None and d.in_flight.step == 1
    assert [type(x) for x in d.arrive("b", 4)] == []  # b waits for step 1 to complete
    d.complete()
    assert d.scheduled_tokens(d.in_flight) == {"a": 1, "b": 4}


def test_chunked_prefill_under_token_budget():
    d = Driver(max_num_batched_tokens=10)
    d.arrive("a", 25, max_tokens=2)
    assert d.scheduled_tokens(d.in_flight) == {"a": 10}
    d.arrive("b", list(range(300, 307)), max_tokens=2)  # no prefix shared with a
    d.complete()  # no sample: prefill chunk does not reach the end
    assert d.outputs == {}
    assert d.scheduled_tokens(d.in_flight) == {"a": 10}
    d.complete()
    assert d.scheduled_tokens(d.in_flight) == {"a": 5, "b": 5}  # b's prefill chunked to fit
    d.complete()
    assert d.outputs == {"a": [7]}
    assert d.scheduled_tokens(d.in_flight) == {"a": 1, "b": 2}
    d.run()
    assert d.finish_reasons == {"a": "length", "b": "length"}


def test_running_requests_go_first_then_waiting_fcfs():
    d = Driver(max_num_batched_tokens=6)
    d.arrive("a", 4, max_tokens=5)
    d.arrive("b", 4, max_tokens=5)
    d.arrive("c", 1, max_tokens=5)
    d.complete()
    plan = d.in_flight
    assert [r.req_id for r in plan.cached_reqs] == ["a"]
    assert [(r.req_id, r.num_scheduled_tokens) for r in plan.new_reqs] == [("b", 4), ("c", 1)]


def test_max_num_seqs_caps_running():
    d = Driver(max_num_seqs=2)
    for name in "abc":
        d.arrive(name, 3, max_tokens=3)
    d.complete()
    assert set(d.scheduled_tokens(d.in_flight)) == {"a"} | {"b"}  # c waits for a free seat
    d.run()
    assert sorted(d.finish_reasons) == ["a", "b", "c"]
    assert max(len(d.scheduled_tokens(p)) for p in d.plans) == 2


def test_cached_req_carries_only_the_delta():
    d = Driver(block_size=4)
    d.arrive("a", 4, max_tokens=3)
    d.script("a", [50, 51, 52])
    d.complete()
    (cached,) = d.in_flight.cached_reqs
    assert cached.new_token_ids == [50]
    assert cached.num_computed_tokens == 4 and cached.num_scheduled_tokens == 1
    assert cached.new_block_ids == [1]  # token 5 needs a second block
    d.complete()
    (cached,) = d.in_flight.cached_reqs
    assert cached.new_token_ids == [51] and cached.new_block_ids == []


def test_finished_ids_reach_workers_in_next_plan():
    d = Driver()
    d.arrive("a", 3, max_tokens=1)
    d.complete()
    assert d.finish_reasons == {"a": "length"} and d.in_flight is None
    d.arrive("b", 3, max_tokens=1)
    assert d.in_flight.finished_req_ids == ["a"]


def test_state_digest_after_every_plan():
    d = Driver()
    d.arrive("a", 3, max_tokens=3)
    d.run()
    digests = d.of_type(ev.StateDigest)
    assert [x.step for x in digests] == [p.step for p in d.plans] == [1, 2, 3]
    assert len({x.digest for x in digests}) == 3
