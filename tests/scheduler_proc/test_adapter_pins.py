"""User-pinned adapters in the core: a pinned version takes a slot at registration and keeps it
through churn of more adapters than slots (the driver also fails any eviction of a registered
pinned version), at most max_loras - 1 are pinned, unload frees the pin (deferred while a
request runs), and load_inplace keeps or changes the pin. On both the reference path and with
overlapped loading."""

import pytest

from ledgerserve.shared import events as ev
from tests.scheduler_proc.driver import Driver

MODES = {"reference": False, "overlap": True}


def _driver(overlap: bool, **kwargs) -> Driver:
    return Driver(enable_lora=True, lora_overlap_loading=overlap, **kwargs)


def _assigned(d: Driver, version_id: int) -> list[int]:
    return [x.slot for x in d.of_type(ev.AdapterSlotAssigned) if x.version_id == version_id]


def _evicted(d: Driver, version_id: int) -> list[int]:
    return [x.slot for x in d.of_type(ev.AdapterEvicted) if x.version_id == version_id]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_pinned_adapter_keeps_its_slot_through_churn(mode):
    d = _driver(MODES[mode], max_loras=3, max_cpu_loras=4)
    names = [f"n{i}" for i in range(6)]
    for name in names:
        d.load(name)
    reply = d.load("p", pinned=True)
    pinned = reply.version_id
    assert reply.code == 200 and _assigned(d, pinned) == [0]  # at registration, before any request needs it
    assert [i.pinned for i in d.registry_changes[-1].registered if i.name == "p"] == [True]
    d.run()  # overlapped loading: the load completes
    for round_ in range(4):
        for i, name in enumerate(names):
            d.arrive(f"{name}-{round_}", 3, lora=name, max_tokens=2)
            if i % 2:
                d.arrive(f"p-{round_}-{i}", 3, lora="p", max_tokens=2)
        d.run()
    assert _assigned(d, pinned) == [0] and _evicted(d, pinned) == []
    assert len(d.of_type(ev.AdapterEvicted)) >= 10  # the other six went through the two other slots
    assert all(len(d.plan_versions(plan)) <= 3 for plan in d.plans)
    assert len(d.finish_reasons) == 6 * 4 + 3 * 4 and d.core.adapters.pinned_versions() == [pinned]
    d.check_idle()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_pinned_adapter_waits_for_a_slot_in_use_then_takes_it(mode):
    d = _driver(MODES[mode], max_loras=2)
    d.load("a")
    d.load("b")
    d.arrive("a1", 3, lora="a", max_tokens=3)
    d.arrive("b1", 3, lora="b", max_tokens=3)
    d.finish_loads()
    d.complete()
    assert d.engine_stats.num_pinned_slots == 2  # both slots run requests
    pinned = d.load("p", pinned=True).version_id
    assert _assigned(d, pinned) == []  # every slot is used by a running request
    d.run()
    assert len(_assigned(d, pinned)) == 1 and d.finish_reasons == {"a1": "length", "b1": "length"}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_at_most_max_loras_minus_one_pins(mode):
    d = _driver(MODES[mode], max_loras=3)
    assert d.load("p1", pinned=True).code == 200 and d.load("p2", pinned=True).code == 200
    refused = d.load("p3", pinned=True)
    assert refused.code == 400 and "max_loras - 1 = 2" in refused.message and "--max-loras 3" in refused.message
    assert "p3" not in d.registry and d.load("p3").code == 200  # unpinned, it loads
    assert d.load("p2", path="/other/p2", inplace=True, pinned=True).code == 200  # a reload keeps its own pin's place
    assert d.unload("p1").code == 200
    assert d.load("p4", pinned=True).code == 200  # the unload freed a pin
    one_slot = _driver(MODES[mode], max_loras=1)
    assert one_slot.load("p", pinned=True).code == 400 and one_slot.registry == {}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_unload_of_a_pinned_adapter_frees_its_pin_after_its_requests(mode):
    d = _driver(MODES[mode], max_loras=2)
    pinned = d.load("p", pinned=True).version_id
    d.run()
    d.arrive("p1", 3, lora="p", max_tokens=4)
    d.complete()
    assert d.unload("p").code == 200
    (deferred,) = d.of_type(ev.AdapterEvictionDeferred)
    assert (deferred.version_id, deferred.num_reqs) == (pinned, 1) and _evicted(d, pinned) == []
    assert d.core.adapters.pinned_versions() == []
    d.run()
    assert _evicted(d, pinned) == [0] and d.finish_reasons == {"p1": "length"}
    d.check_idle()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_load_inplace_changes_the_pin(mode):
    d = _driver(MODES[mode], max_loras=2)
    v1 = d.load("p", pinned=True).version_id
    d.run()
    d.arrive("p1", 3, lora="p", max_tokens=4)
    d.complete()
    v2 = d.load("p", path="/other/p", inplace=True).version_id  # unpinned from now on
    assert d.core.adapters.pinned_versions() == [] and _evicted(d, v1) == []  # p1 still runs on v1
    d.run()
    assert _evicted(d, v1) == [0]  # once p1 ended
    d.arrive("p2", 3, lora="p", max_tokens=1)
    d.run()
    for name in "abc":  # churn: the unpinned v2 loses its slot
        d.load(name)
        d.arrive(f"{name}1", 3, lora=name, max_tokens=1)
        d.run()
    assert _evicted(d, v2)
    v3 = d.load("p", path="/third/p", inplace=True, pinned=True).version_id  # pinned again
    assert d.core.adapters.pinned_versions() == [v3]
    d.run()
    assert len(_assigned(d, v3)) == 1
    for name in "abc":
        d.arrive(f"{name}2", 3, lora=name, max_tokens=1)
        d.run()
    assert len(_assigned(d, v3)) == 1 and _evicted(d, v3) == []
    d.check_idle()


def test_pins_show_in_the_snapshot_and_digest():
    d = _driver(True, max_loras=2)
    d.load("a")
    plain = d.core.state_rows()
    pinned = d.load("p", pinned=True).version_id
    snapshot = d.core.snapshot()["adapters"]
    assert snapshot["pinned"] == [pinned] and [v["pinned"] for v in snapshot["versions"]] == [False, True]
    rows = d.core.state_rows()
    assert len(rows[5]) == len(plain[5]) + 1 and rows[5][-1] == [[[pinned, True, False, 0]], 0]
