"""Overlapped adapter loading when loads fail or race: a failure on any rank fails the
version and frees its slot at once (a rank still loading clears it later; its completion
comes late and is ignored), a slow rank holds back only that version's requests, an unload
or in-place reload mid-load frees the slot when the load ends, and a preempted request
resumes on its slot. No slot, pin, CPU entry or block leaks."""

from ledgerserve.shared import events as ev
from tests.scheduler_proc.driver import Driver
from tests.scheduler_proc.test_adapter_movement import _moves, _slot_states, overlap_driver

DIGEST_MISMATCH = "adapter_model.safetensors hashes to 0x1234, not the registered 0xa1: the files changed"


def _check_clean_end(d: Driver) -> None:
    d.run()
    d.check_idle()
    adapters = d.core.snapshot()["adapters"]
    assert (
        d.engine_stats.num_pinned_slots == 0
        and d.engine_stats.num_loading_slots == 0
        and d.engine_stats.num_deferred_evictions == 0
    )
    assert adapters["loads_in_flight"] == [] and not d.of_type(ev.EngineFailed)
    assert [v for v, _ in adapters["cpu_tier"]] == sorted(adapters["registry"].values())  # only live versions


def test_a_failure_on_one_rank_fails_the_version_and_frees_its_slot():
    d = overlap_driver(tensor_parallel_size=2, digests=True, max_loras=1)
    d.load("a", content_digest=0xA1)
    d.load("b")
    d.arrive("z", 3, max_tokens=4)
    d.arrive("a1", 3, lora="a", max_tokens=2)
    d.arrive("a2", 3, lora="a", max_tokens=2)
    d.arrive("b1", 3, lora="b", max_tokens=1)
    d.finish_loads(slot=-1)
    d.finish_loads(slot=0, rank=1)
    decisions = d.fail_load(0, 0, DIGEST_MISMATCH)
    rejected = [x for x in decisions if isinstance(x, ev.RequestRejected)]
    assert [(x.req_id, x.code) for x in rejected] == [("a1", 500), ("a2", 500)]
    assert all("on rank 0" in x.message and "the files changed" in x.message for x in rejected)
    assert _moves(decisions) == [("evict", 0, 1), ("unstage", -1, 1), ("assign", 0, 2)]  # b takes the slot at once
    assert ev.AdapterUnloaded("a", 1) in decisions and d.arrive("a3", 3, lora="a")[0].code == 404
    assert d.send(ev.AdapterLoadFailed(1, 0, 1, "again")) == []  # the version is gone
    _check_clean_end(d)
    assert d.finish_reasons == {"z": "length", "b1": "length"}


def test_a_late_completion_after_a_failure_is_ignored():
    d = overlap_driver(tensor_parallel_size=2, digests=True, max_loras=1)
    d.load("a")
    d.load("b")
    d.arrive("a1", 3, lora="a", max_tokens=1)
    d.arrive("b1", 3, lora="b", max_tokens=1)
    d.fail_load(0, 1, DIGEST_MISMATCH)  # rank 0 still loads a into slot 0 ...
    assert _slot_states(d) == [("LOADING", 2)]  # ... while b is already assigned to it (cleared after a's load)
    d.finish_loads(slot=0, rank=1)  # b done on rank 1
    assert d.finish_loads(slot=0, rank=0, version_id=1) == []  # rank 0's late completion of a: ignored
    assert _slot_states(d) == [("LOADING", 2)]
    assert isinstance(d.finish_loads(slot=0, rank=0)[0], ev.StepPlan)
    _check_clean_end(d)
    assert d.finish_reasons == {"b1": "length"}


def test_a_failed_cpu_staging_fails_the_version():
    d = overlap_driver(tensor_parallel_size=2, digests=True)
    d.load("a")
    d.arrive("a1", 3, lora="a", max_tokens=1)
    decisions = d.send(ev.AdapterLoadFailed(1, -1, 1, DIGEST_MISMATCH))
    assert [x.req_id for x in decisions if isinstance(x, ev.RequestRejected)] == ["a1"]
    assert _moves(decisions) == [("evict", 0, 1), ("unstage", -1, 1)]
    _check_clean_end(d)


def test_a_slow_rank_holds_back_only_its_version():
    d = overlap_driver(tensor_parallel_size=2, digests=True, max_loras=2)
    d.load("a")
    d.load("b")
    d.arrive("a1", 3, lora="a", max_tokens=6)
    d.arrive("b1", 3, lora="b", max_tokens=2)
    d.finish_loads(slot=0)
    d.finish_loads(slot=1, rank=0)  # rank 1 is slow to load b
    for i in range(4):
        d.arrive(f"z{i}", 3, max_tokens=1)
        d.arrive(f"a{i + 2}", 3, lora="a", max_tokens=1)
        d.complete()
    ran = [req_id for plan in d.plans for req_id in Driver.scheduled_tokens(plan)]
    assert "b1" not in ran and {"z0", "z1", "z2", "a2", "a3", "a4"} <= set(ran)
    assert d.engine_stats.num_lora_wait_steps == len(d.plans)  # every step left b1 waiting on its load
    d.finish_loads(slot=1, rank=1)
    d.complete()
    assert "b1" in Driver.scheduled_tokens(d.plans[-1])
    _check_clean_end(d)


def test_unload_mid_load_frees_the_slot_when_the_load_ends():
    d = overlap_driver(tensor_parallel_size=2, digests=True)
    d.load("a")
    d.arrive("a1", 3, lora="a", max_tokens=1)
    d.abort("a1")
    d.unload("a")
    assert d.of_type(ev.AdapterEvictionDeferred) == [ev.AdapterEvictionDeferred(1, 0, 0)]
    assert _slot_states(d)[0] == ("LOADING", 1) and not d.of_type(ev.AdapterEvicted)  # never evicted mid-load
    assert d.engine_stats.num_deferred_evictions == 1
    assert d.finish_loads(slot=0, rank=0) == []
    assert _moves(d.finish_loads(slot=0, rank=1)) == [("evict", 0, 1), ("unstage", -1, 1)]
    _check_clean_end(d)


def test_unload_mid_load_then_a_failure_frees_the_slot_at_once():
    d = overlap_driver(tensor_parallel_size=2, digests=True)
    d.load("a")
    d.arrive("a1", 3, lora="a", max_tokens=1)
    d.abort("a1")
    d.unload("a")
    decisions = d.fail_load(0, 1, DIGEST_MISMATCH)
    assert _moves(decisions) == [("evict", 0, 1), ("unstage", -1, 1)] and not d.of_type(ev.RequestRejected)
    assert d.finish_loads() == []  # rank 0's completion, late
    _check_clean_end(d)


def test_unload_mid_load_with_a_waiting_request_runs_it_on_its_version():
    d = overlap_driver()
    d.load("a")
    d.arrive("a1", 3, lora="a", max_tokens=2)
    d.unload("a")
    assert d.of_type(ev.AdapterEvictionDeferred) == [ev.AdapterEvictionDeferred(1, 0, 1)]
    d.finish_loads()
    d.run()
    assert d.finish_reasons == {"a1": "length"} and d.of_type(ev.AdapterEvicted) == [ev.AdapterEvicted(0, 1)]
    _check_clean_end(d)


def test_the_last_holder_leaving_mid_load_defers_the_eviction_to_the_load_end():
    d = overlap_driver(tensor_parallel_size=2, digests=True)
    d.load("a")
    d.arrive("a1", 3, lora="a", max_tokens=2)
    d.unload("a")  # a1 still holds version 1
    d.finish_loads(rank=0)
    assert _moves(d.abort("a1")) == [] and _slot_states(d)[0] == ("LOADING", 1)  # rank 1 still loads it
    assert _moves(d.finish_loads(rank=1)) == [("evict", 0, 1), ("unstage", -1, 1)]
    _check_clean_end(d)


def test_load_inplace_mid_load_serves_both_versions():
    d = overlap_driver(max_loras=2)
    d.load("a")
    d.arrive("a1", 3, lora="a", max_tokens=2)
    d.load("a", path="/adapters/a-v2", inplace=True)
    assert d.of_type(ev.AdapterEvictionDeferred) == [ev.AdapterEvictionDeferred(1, 0, 1)]
    assert _moves(d.arrive("a2", 3, lora="a", max_tokens=2)) == [("assign", 1, 2)]
    d.finish_loads(slot=1)  # the new version is ready first: a2 runs while a1 still waits
    assert sorted(Driver.scheduled_tokens(d.plans[-1])) == ["a2"]
    d.finish_loads(slot=0)
    d.run()
    assert d.finish_reasons == {"a1": "length", "a2": "length"}
    assert d.of_type(ev.AdapterEvicted) == [ev.AdapterEvicted(0, 1)]
    _check_clean_end(d)


def test_load_inplace_twice_mid_load_leaks_nothing():
    d = overlap_driver(tensor_parallel_size=2, digests=True, max_loras=1, max_cpu_loras=2)
    d.load("a")
    d.arrive("a1", 3, lora="a", max_tokens=1)
    d.abort("a1")
    d.load("a", inplace=True)  # version 1 loads, held by nobody: dropped when its load ends
    d.arrive("a2", 3, lora="a", max_tokens=1)  # version 2: no slot while 1 loads, staged instead
    d.load("a", inplace=True)  # version 2 is held by a2: deferred
    d.arrive("a3", 3, lora="a", max_tokens=1)
    assert d.engine_stats.num_deferred_evictions == 2 and d.engine_stats.num_cpu_tier_versions <= 2
    _check_clean_end(d)
    assert d.finish_reasons == {"a1": "abort", "a2": "length", "a3": "length"}


def test_a_preempted_request_resumes_on_its_slot():
    """A preempted request waits at the head of the queue, so the prefetch pass never takes
    its slot (it is needed first): it resumes there without a new load, and an adapter
    request behind it waits for the slot."""
    d = overlap_driver(max_loras=1, num_kv_blocks=6, block_size=4, max_model_len=32)
    d.load("a")
    d.load("b")
    d.arrive("z", 8, max_tokens=12)  # grows to 5 blocks
    d.arrive("a1", 4, lora="a", max_tokens=12)  # grows to 4 blocks: the pool of 6 cannot hold both
    d.finish_loads()
    d.arrive("b1", 3, lora="b", max_tokens=1)
    while not d.of_type(ev.RequestPreempted):
        d.complete()
    assert [x.req_id for x in d.of_type(ev.RequestPreempted)] == ["a1"]  # the newer one goes
    assert _slot_states(d) == [("LOADED", 1)] and [r.req_id for r in d.core.scheduler.waiting] == ["a1", "b1"]
    d.complete()
    assert _moves(d.decisions)[-1] == ("assign", 0, 1)  # a's slot stays for a1, not taken by b1
    d.run()
    assert [x.version_id for x in d.of_type(ev.AdapterSlotAssigned)] == [1, 2]
    _check_clean_end(d)
    assert len(d.finish_reasons) == 3
