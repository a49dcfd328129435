"""Async scheduling (max_steps_in_flight=2): step s + 1 is planned while step s runs.
What users see must not change: the same tokens and finish reasons as the one-step loop,
no token past max_tokens scheduled, exact block accounting, and a log that replays."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledgerserve.scheduler_proc.core import Core, CoreConfig
from ledgerserve.scheduler_proc.replay import replay
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import EventLogWriter
from ledgerserve.sim.slots import LoadPolicy
from ledgerserve.sim.workload import run_adapter_workload, run_workload
from tests.scheduler_proc.driver import EOS, Driver
from tests.scheduler_proc.workload import WORKLOAD_SPACE


def async_driver(num_kv_blocks: int = 64, **kw) -> Driver:
    return Driver(num_kv_blocks, max_steps_in_flight=2, **kw)


def outcome(d: Driver) -> tuple[dict, dict, dict]:
    rejected = {x.req_id: x.code for x in d.of_type(ev.RequestRejected)}
    return d.outputs, d.finish_reasons, rejected


def test_decode_runs_one_step_ahead():
    d = async_driver()
    d.arrive("a", 5, max_tokens=4)
    assert d.num_in_flight == 2  # the prefill and, behind it, a's first decode step
    first, second = d.plans
    assert first.new_reqs[0].num_scheduled_tokens == 5
    ahead = second.cached_reqs[0]
    assert (ahead.new_token_ids, ahead.num_computed_tokens, ahead.num_scheduled_tokens) == ([], 5, 1)
    d.complete()
    assert d.num_in_flight == 2 and d.plans[2].cached_reqs[0].new_token_ids == [7]  # the token step 1 sampled
    d.run()
    assert d.outputs["a"] == [7, 7, 7, 7] and d.finish_reasons["a"] == "length"
    d.check_idle()


def test_no_step_runs_past_max_tokens():
    d = async_driver()
    d.arrive("a", 3, max_tokens=3)
    d.run()
    scheduled = sum(Driver.scheduled_tokens(plan).get("a", 0) for plan in d.plans)
    assert scheduled == 3 + 3 - 1  # the prompt and every output but the last
    assert d.outputs["a"] == [7, 7, 7]


def test_eos_while_a_step_runs_ahead_emits_nothing_more():
    d = async_driver()
    d.script("a", [5, EOS, 6, 6])
    d.arrive("a", 4, max_tokens=10)
    d.arrive("b", 4, max_tokens=6)
    d.run()
    assert d.outputs["a"] == [5, EOS] and d.finish_reasons["a"] == "stop"
    assert d.outputs["b"] == [7] * 6
    a_steps = [plan.step for plan in d.plans if "a" in Driver.scheduled_tokens(plan)]
    assert len(a_steps) == 3  # prefill, the decode that sampled EOS, and the one ahead of it (discarded)
    d.check_idle()


def test_penalised_request_waits_for_its_token():
    d = async_driver()
    d.arrive("a", 4, max_tokens=3, repetition_penalty=1.2)
    d.arrive("b", 4, max_tokens=3)
    d.run()
    num_known = {"a": 4, "b": 4}  # tokens the worker has been sent
    num_ahead = {"a": 0, "b": 0}  # steps scheduled past them
    for plan in d.plans:
        for cached in plan.cached_reqs:
            num_known[cached.req_id] += len(cached.new_token_ids)
            num_ahead[cached.req_id] += (
                cached.num_computed_tokens + cached.num_scheduled_tokens > num_known[cached.req_id]
            )
    assert num_ahead == {"a": 0, "b": 2}  # b runs ahead for its 2nd and 3rd tokens; a never does
    assert d.outputs == {"a": [7, 7, 7], "b": [7, 7, 7]}


def test_abort_while_two_steps_are_in_flight():
    d = async_driver()
    d.arrive("a", 4, max_tokens=8)
    d.arrive("b", 4, max_tokens=8)
    d.complete()
    assert d.num_in_flight == 2
    d.abort("a")
    d.run()
    assert d.finish_reasons["a"] == "abort" and d.outputs["b"] == [7] * 8
    d.check_idle()


def test_step_ahead_never_preempts():
    """Blocks run out for the step planned ahead: it stops there; the next step, planned with
    nothing in flight, may preempt."""
    d = async_driver(4, block_size=4, max_num_seqs=2, max_model_len=32)
    d.arrive("a", 7, max_tokens=5)
    d.arrive("b", 7, max_tokens=5)
    d.run()
    assert d.outputs == {"a": [7] * 5, "b": [7] * 5}
    preempted_at = {p.step for p in d.of_type(ev.RequestPreempted)}
    in_flight_at_plan = _in_flight_when_planned(d)
    assert all(in_flight_at_plan[step] == 0 for step in preempted_at)
    d.check_idle()


def _in_flight_when_planned(d: Driver) -> dict[int, int]:
    """step -> how many steps were in flight when it was planned (the driver keeps inputs and
    decisions apart, so the core's order is rebuilt by applying the inputs to a fresh core)."""
    core, planned, completed, out = Core(d.config), 0, 0, {}
    for event in d.inputs:
        completed += isinstance(event, ev.StepCompleted)
        for decision in core.apply(event):
            if isinstance(decision, ev.StepPlan):
                out[decision.step] = planned - completed
                planned += 1
    return out


@settings(max_examples=40, deadline=None)
@given(**WORKLOAD_SPACE)
def test_random_workloads_match_the_one_step_loop(seed, num_kv_blocks, max_num_seqs, max_num_batched_tokens):
    """Scripted tokens are per request, so the outputs must not depend on how steps interleave;
    aborts land at other moments, so only requests never aborted are compared."""
    kw = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=4, max_model_len=32)
    sync, ahead = Driver(num_kv_blocks, **kw), async_driver(num_kv_blocks, **kw)
    run_workload(sync, seed)
    run_workload(ahead, seed)  # the driver checks integrity after every event
    ahead.check_idle()
    assert not ahead.of_type(ev.EngineFailed)
    aborted = {x.req_id for x in sync.inputs if isinstance(x, ev.RequestAborted)}
    for got, want in zip(outcome(ahead), outcome(sync)):
        assert {k: v for k, v in got.items() if k not in aborted} == {k: v for k, v in want.items() if k not in aborted}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_adapter_workloads_keep_slots_and_blocks_exact(seed):
    d = async_driver(
        12,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        max_model_len=40,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
    )
    run_adapter_workload(d, seed)  # slot pins and KV namespaces checked on every plan
    d.check_idle()
    assert not d.of_type(ev.EngineFailed)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), tp=st.integers(1, 2))
def test_random_adapter_workloads_with_overlapped_loading_keep_slots_and_blocks_exact(seed, tp):
    """Loads end at random between the steps in flight: a slot a step in flight reads is never
    reassigned, and a plan uses only slots every rank has loaded (checked by the driver)."""
    d = async_driver(
        12,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        max_model_len=40,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
        lora_overlap_loading=True,
        load_policy=LoadPolicy(seed, p_finish=0.3),
        tensor_parallel_size=tp,
        digests=True,
    )
    run_adapter_workload(d, seed)
    d.check_idle()
    assert not d.of_type(ev.EngineFailed) and d.engine_stats.num_loading_slots == 0


def test_async_log_replays_and_its_config_travels_in_the_header(tmp_path):
    engine = EngineConfig(
        model_dir="m",
        served_model_name="m",
        max_model_len=32,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        async_scheduling=True,
        lora_overlap_loading=False,
    )
    writer = EventLogWriter(str(tmp_path), engine.to_json(), run_id="async")
    d = async_driver(10, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, log=writer)
    assert CoreConfig.from_engine(engine) == d.config
    run_workload(d, 7, num_events=120)
    writer.append(ev.LogClosed("done"))
    writer.close()
    assert max(_in_flight_when_planned(d).values()) == 1  # steps were planned ahead
    result = replay(writer.path)
    assert result.ok and result.core.step == d.core.step and not result.core.has_unfinished()


def test_config_bounds():
    with pytest.raises(ValueError, match="max_steps_in_flight"):
        Driver(max_steps_in_flight=3)


def test_two_ranks_run_ahead_once_the_step_before_agreed():
    """With several ranks, step s + 1 still waits until every rank's digest of step s - 1 agreed:
    planned ahead of step s when the ranks keep up, and the outputs are the one-step loop's."""

    def run(d: Driver) -> None:
        d.arrive("a", 5, max_tokens=6)
        d.arrive("b", 9, max_tokens=4)
        while d.in_flight is not None:
            step = d.in_flight.step
            d.complete()
            for rank in (0, 1):
                d.send(ev.RankDigest(step, rank, 0xD16E57))

    sync, ahead = Driver(tensor_parallel_size=2), async_driver(tensor_parallel_size=2)
    run(sync)
    run(ahead)
    assert ahead.outputs == sync.outputs == {"a": [7] * 6, "b": [7] * 4}
    assert (
        list(_in_flight_when_planned(ahead).values()) == [0, 1, 1, 1, 1, 1] and ahead.core.step == sync.core.step == 6
    )
    ahead.check_idle()
