"""Adapters in the core: registry replies, the per-step cap, pinning, promotion order, LRU
tie-breaks, deferred evictions, in-place reloads, failed loads, the CPU tier."""

import pytest

from ledgerserve.scheduler_proc.core import IllegalSlotTransition, SlotAction, SlotState, SlotTable, transition_slot
from ledgerserve.shared import events as ev
from tests.scheduler_proc.driver import Driver


def lora_driver(**kwargs) -> Driver:
    return Driver(enable_lora=True, **kwargs)


def _types(decisions) -> list[str]:
    return [type(d).__name__ for d in decisions]


def _use(d: Driver, req_id: str, lora: str | None) -> None:
    """Run one single-token request of `lora` to its end."""
    d.arrive(req_id, 3, lora=lora, max_tokens=1)
    d.run()


def test_load_and_unload_replies():
    d = lora_driver()
    first = d.load("b")
    assert (first.code, first.version_id) == (200, 1)
    second = d.load("a", path="/x/a")
    assert (second.code, second.version_id) == (200, 2)
    assert second.adapters == []  # the registry travels unlogged: what the op changed, before its reply
    assert d.registry_changes[-1] == ev.AdapterRegistryChanged([ev.AdapterInfo("a", 2, "/x/a")])
    assert d.core.adapters.infos() == [ev.AdapterInfo("a", 2, "/x/a"), ev.AdapterInfo("b", 1, "/adapters/b")]
    assert d.of_type(ev.AdapterRegistered) == [
        ev.AdapterRegistered("b", 1, "/adapters/b"),
        ev.AdapterRegistered("a", 2, "/x/a"),
    ]
    again = d.load("a")
    assert again.code == 400 and "already" in again.message and d.core.adapters.resolve("a") == 2
    assert d.unload("zzz").code == 404
    gone = d.unload("a")
    assert gone.code == 200 and gone.version_id == 2 and d.registry_changes[-1] == ev.AdapterRegistryChanged([], ["a"])
    assert [i.name for i in d.core.adapters.infos()] == ["b"]
    assert d.of_type(ev.AdapterUnloaded) == [ev.AdapterUnloaded("a", 2)]
    (rejected,) = d.arrive("x", 3, lora="a")
    assert (rejected.code, rejected.param) == (404, "model") and "`a`" in rejected.message


def test_lora_disabled_replies_400_naming_the_flag():
    d = Driver()
    for reply in (d.load("a"), d.unload("a")):
        assert reply.code == 400 and "--enable-lora" in reply.message
    assert d.of_type(ev.RequestRejected) == []
    (rejected,) = d.arrive("x", 3, lora="a")
    assert rejected.code == 404


def test_cap_holds_and_skipped_requests_do_not_use_it():
    d = lora_driver(max_loras=2)
    for name in "abc":
        d.load(name)
    d.arrive("a1", 4, lora="a", max_tokens=4)  # planned at once, alone
    for req_id, lora in (("b1", "b"), ("c1", "c"), ("base1", None), ("a2", "a"), ("b2", "b")):
        d.arrive(req_id, 4, lora=lora, max_tokens=4)
    d.complete()
    second = d.plans[1]
    assert sorted(Driver.scheduled_tokens(second)) == ["a1", "a2", "b1", "b2", "base1"]  # c1 waits; later ones go ahead
    assert [r.req_id for r in d.core.scheduler.waiting] == ["c1"]
    d.run()
    assert all(len(d.plan_versions(plan)) <= 2 for plan in d.plans)
    assert sorted(d.finish_reasons) == ["a1", "a2", "b1", "b2", "base1", "c1"]


def test_request_short_of_blocks_does_not_take_a_slot():
    d = lora_driver(max_loras=1, num_kv_blocks=6, block_size=4, max_model_len=32)
    d.load("a")
    d.load("b")
    d.arrive("base", 16, max_tokens=4)  # holds 4-5 of 6 blocks
    d.arrive("b1", 12, lora="b", max_tokens=1)  # cannot get its blocks yet
    d.complete()
    assert "b1" not in Driver.scheduled_tokens(d.plans[-1]) and d.of_type(ev.AdapterSlotAssigned) == []
    d.run()
    assert d.finish_reasons["b1"] == "length" and d.of_type(ev.AdapterSlotAssigned) == [
        ev.AdapterSlotAssigned(0, 2, "/adapters/b")
    ]


def test_running_request_pins_its_slot():
    d = lora_driver(max_loras=1)
    d.load("a")
    d.load("b")
    d.arrive("a1", 4, lora="a", max_tokens=6)
    d.arrive("b1", 4, lora="b", max_tokens=2)
    while "a1" not in d.finish_reasons:
        assert d.engine_stats.num_pinned_slots == 1 and d.core.adapters.slots.slots[0].version_id == 1
        assert "b1" not in Driver.scheduled_tokens(d.in_flight)
        decisions = d.complete()
    order = _types(decisions)
    assert (
        order.index("RequestFinished")
        < order.index("AdapterEvicted")
        < order.index("AdapterSlotAssigned")
        < order.index("StepPlan")
    )
    assert d.of_type(ev.AdapterEvicted) == [ev.AdapterEvicted(0, 1)]
    d.run()
    assert d.engine_stats.num_pinned_slots == 0


def test_promotion_never_evicts_an_adapter_the_step_needs():
    d = lora_driver(max_loras=2)
    for name in "abc":
        d.load(name)
    _use(d, "a1", "a")  # slot 0 = a, used at step 1
    _use(d, "b1", "b")  # slot 1 = b, used at step 2: a is the LRU slot
    d.arrive("z", 3, max_tokens=3)
    d.arrive("c1", 3, lora="c", max_tokens=1)  # c first: a naive pick would evict a ...
    d.arrive("a2", 3, lora="a", max_tokens=1)  # ... which this same step needs
    decisions = d.complete()
    assert [x for x in decisions if isinstance(x, (ev.AdapterEvicted, ev.AdapterSlotAssigned))] == [
        ev.AdapterEvicted(1, 2),
        ev.AdapterSlotAssigned(1, 3, "/adapters/c"),
    ]
    d.run()


def test_lru_by_step_with_slot_index_tie_break():
    d = lora_driver(max_loras=2)
    for name in "abcd":
        d.load(name)
    d.arrive("z", 3, max_tokens=2)
    d.arrive("a1", 3, lora="a", max_tokens=1)
    d.arrive("b1", 3, lora="b", max_tokens=1)
    d.run()  # a -> slot 0, b -> slot 1, both last used at step 2
    _use(d, "c1", "c")  # tie on step: the lower index goes
    _use(d, "d1", "d")  # b (step 2) is older than c (step 3)
    assert d.of_type(ev.AdapterEvicted) == [ev.AdapterEvicted(0, 1), ev.AdapterEvicted(1, 2)]
    assert [(x.slot, x.version_id) for x in d.of_type(ev.AdapterSlotAssigned)] == [(0, 1), (1, 2), (0, 3), (1, 4)]


def test_unload_while_running_defers_until_finish():
    d = lora_driver()
    d.load("a")
    d.arrive("a1", 4, lora="a", max_tokens=4)
    d.complete()
    reply = d.unload("a")
    assert _types(d.decisions[-4:]) == [
        "AdapterUnloaded",
        "AdapterEvictionDeferred",
        "NamespaceEvicted",
        "AdapterOpReplied",
    ]
    assert d.decisions[-3] == ev.AdapterEvictionDeferred(1, 0, 1) and reply.code == 200
    assert d.decisions[-2] == ev.NamespaceEvicted(1, 0, 1)  # a1's first block is locked
    assert d.engine_stats.num_deferred_evictions == 1 and d.of_type(ev.AdapterEvicted) == []
    assert d.arrive("a2", 3, lora="a")[0].code == 404
    d.run()
    assert d.finish_reasons["a1"] == "length" and d.of_type(ev.AdapterEvicted) == [ev.AdapterEvicted(0, 1)]
    assert d.engine_stats.num_deferred_evictions == 0 and d.core.snapshot()["adapters"]["versions"] == []


def test_unload_then_abort_evicts_at_the_abort():
    d = lora_driver()
    d.load("a")
    d.arrive("a1", 4, lora="a", max_tokens=8)
    d.complete()
    d.unload("a")
    decisions = d.abort("a1")
    assert _types(decisions)[:3] == ["TokensEmitted", "RequestFinished", "AdapterEvicted"]
    assert d.engine_stats.num_deferred_evictions == 0 and d.engine_stats.num_pinned_slots == 0
    d.run()


def test_unload_of_an_idle_or_waiting_adapter():
    d = lora_driver()
    d.load("a")
    _use(d, "a1", "a")
    d.unload("a")  # idle: evicted at once, its CPU copy too
    assert _types(d.decisions[-5:]) == [
        "AdapterUnloaded",
        "AdapterEvicted",
        "AdapterCpuEvicted",
        "NamespaceEvicted",
        "AdapterOpReplied",
    ]
    d = lora_driver(ready=False)
    d.load("b")
    d.arrive("b1", 3, lora="b", max_tokens=2)
    d.unload("b")  # held by a waiting request that never had a slot
    assert d.of_type(ev.AdapterEvictionDeferred) == [ev.AdapterEvictionDeferred(1, -1, 1)]
    d.ready()
    d.run()  # b1 still runs on its version, then the slot goes
    assert d.finish_reasons["b1"] == "length" and d.of_type(ev.AdapterEvicted) == [ev.AdapterEvicted(0, 1)]
    assert d.engine_stats.num_deferred_evictions == 0


def test_load_inplace_new_arrivals_get_the_new_version():
    d = lora_driver()
    d.load("a")
    d.arrive("a1", 4, lora="a", max_tokens=4)
    d.complete()
    reply = d.load("a", path="/adapters/a-v2", inplace=True)
    assert reply.code == 200 and reply.version_id == 2
    assert d.registry_changes[-1] == ev.AdapterRegistryChanged([ev.AdapterInfo("a", 2, "/adapters/a-v2")])
    assert d.of_type(ev.AdapterRegistered)[-1] == ev.AdapterRegistered("a", 2, "/adapters/a-v2", replaced_version_id=1)
    assert d.of_type(ev.AdapterEvictionDeferred) == [ev.AdapterEvictionDeferred(1, 0, 1)]
    d.arrive("a2", 4, lora="a", max_tokens=2)
    d.run()
    assert d.core.requests == {} and d.of_type(ev.AdapterSlotAssigned)[-1] == ev.AdapterSlotAssigned(
        1, 2, "/adapters/a-v2"
    )
    assert d.of_type(ev.AdapterEvicted) == [ev.AdapterEvicted(0, 1)] and d.engine_stats.num_deferred_evictions == 0
    _use(d, "a3", "a")
    d.load("a", inplace=True)  # nobody holds version 2: its slot goes at once
    assert d.of_type(ev.AdapterEvicted)[-1] == ev.AdapterEvicted(1, 2)


def test_load_failed_fails_its_requests_and_unregisters():
    d = lora_driver()
    d.load("a")
    d.arrive("z", 3, max_tokens=3)
    d.arrive("a1", 3, lora="a", max_tokens=3)
    d.arrive("a2", 3, lora="a", max_tokens=3)
    d.complete()
    decisions = d.send(ev.AdapterLoadFailed(0, 0, 1, "adapter_model.safetensors is truncated"))
    rejected = [x for x in decisions if isinstance(x, ev.RequestRejected)]
    assert [(x.req_id, x.code) for x in rejected] == [("a1", 500), ("a2", 500)]
    assert all("truncated" in x.message for x in rejected)
    assert [x for x in decisions if isinstance(x, (ev.AdapterEvicted, ev.AdapterUnloaded))] == [
        ev.AdapterUnloaded("a", 1),
        ev.AdapterEvicted(0, 1),
    ]
    assert d.finish_reasons == {} and [x.finish_reason for x in d.of_type(ev.RequestFinished)] == ["error", "error"]
    assert d.send(ev.AdapterLoadFailed(1, 0, 1, "again")) == []  # another rank: already gone
    assert d.arrive("a3", 3, lora="a")[0].code == 404
    d.run()
    assert d.finish_reasons == {"z": "length"} and d.engine_stats.num_pinned_slots == 0


def test_load_completed_is_logged_only():
    d = lora_driver()
    d.load("a")
    assert d.send(ev.AdapterLoadCompleted(0, 0, 1)) == []


def test_cpu_tier_drops_the_lru_version_not_in_a_slot():
    d = lora_driver(max_loras=1, max_cpu_loras=2)
    for name in "abc":
        d.load(name)
    for req_id, lora in (("a1", "a"), ("b1", "b"), ("c1", "c")):
        _use(d, req_id, lora)
    assert d.of_type(ev.AdapterCpuEvicted) == [ev.AdapterCpuEvicted(1)]
    _use(d, "a2", "a")  # a comes back; b (older than c, neither in the slot) goes
    assert d.of_type(ev.AdapterCpuEvicted) == [ev.AdapterCpuEvicted(1), ev.AdapterCpuEvicted(2)]
    assert [v for v, _ in d.core.snapshot()["adapters"]["cpu_tier"]] == [1, 3]


def test_snapshot_shows_registry_slots_and_deferred():
    d = lora_driver(max_loras=2)
    d.load("a")
    d.arrive("a1", 3, lora="a", max_tokens=3)
    d.unload("a")
    snap = d.core.snapshot()["adapters"]
    assert snap["registry"] == {} and snap["deferred_evictions"] == [1]
    assert snap["slots"][0] == {"slot": 0, "state": "PINNED", "version_id": 1, "num_pins": 1, "last_used_step": 1}
    assert d.core.snapshot()["requests"][0]["lora_slot"] == 0
    d.run()


def test_slot_lifecycle_rejects_illegal_edges():
    table = SlotTable(2)
    with pytest.raises(IllegalSlotTransition):
        table.pin(0)  # FREE -> PINNED
    table.assign(0, 7, step=1)
    table.pin(0)
    with pytest.raises(IllegalSlotTransition):
        table.evict(0)  # PINNED -> FREE
    with pytest.raises(IllegalSlotTransition):
        table.assign(0, 8, step=2)  # PINNED -> LOADED by assignment
    table.pin(0)
    table.unpin(0)
    assert table.slots[0].state == SlotState.PINNED and table.num_pinned == 1
    table.unpin(0)
    assert table.evict(0) == 7 and table.slots[0].state == SlotState.FREE
    with pytest.raises(IllegalSlotTransition):
        transition_slot(table.slots[1], SlotAction.UNPIN)


def test_adapter_ops_after_engine_failure_get_503():
    d = lora_driver()
    d.send(ev.WorkerFailed(0, "gone"))
    assert d.load("a").code == 503 and d.unload("a").code == 503
