"""Adapters registered on demand in the core: past max_on_demand_loras a new one unregisters
the least recently used idle one (logged: AdapterUnloaded with reason "lru"), never one a
waiting or running request holds, never one loaded explicitly; with every one in use the new
one gets 503 and nothing changes. A request that names an adapter unregistered since gets the
core's 404, never another adapter loaded under the same name."""

import pytest

from ledgerserve.scheduler_proc.replay import replay
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import EventLogWriter
from ledgerserve.shared.sampling import SamplingParams
from tests.scheduler_proc.driver import Driver


def _driver(overlap: bool = False, **kwargs) -> Driver:
    return Driver(enable_lora=True, lora_overlap_loading=overlap, max_on_demand_loras=2, **kwargs)


def _lru_unloads(decisions) -> list[str]:
    return [x.name for x in decisions if isinstance(x, ev.AdapterUnloaded) and x.reason == "lru"]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_least_recently_used_idle_one_goes(overlap):
    d = _driver(overlap)
    d.load("od1", on_demand=True)
    d.load("od2", on_demand=True)
    d.arrive("r1", 3, lora="od1", max_tokens=1)  # od1 is now more recent than od2
    d.run()
    before = len(d.decisions)
    reply = d.load("od3", on_demand=True)
    decisions = d.decisions[before:]
    assert reply.code == 200 and _lru_unloads(decisions) == ["od2"]
    assert decisions.index(ev.AdapterUnloaded("od2", 2, "lru")) < decisions.index(reply)
    assert sorted(d.registry) == ["od1", "od3"] and [i.name for i in d.core.adapters.infos()] == ["od1", "od3"]
    od3 = ev.AdapterInfo("od3", reply.version_id, "/adapters/od3", on_demand=True)
    assert d.registry_changes[-1] == ev.AdapterRegistryChanged([od3], ["od2"])  # the LRU one leaves the mirror
    (rejected,) = d.arrive("late", 3, lora="od2")  # resolved by the HTTP process before the unload
    assert (rejected.code, rejected.param) == (404, "model") and "`od2`" in rejected.message
    d.check_idle()


@pytest.mark.parametrize("overlap", [False, True])
def test_never_a_busy_or_explicit_adapter(overlap):
    d = _driver(overlap)
    d.load("explicit")  # the oldest and idle, but loaded explicitly: never unregistered implicitly
    d.load("od1", on_demand=True)
    d.load("od2", on_demand=True)
    d.arrive("w1", 3, lora="od1", max_tokens=4)  # od1, the older, is held: a waiting/running request
    d.arrive("w2", 3, lora="od2", max_tokens=4)  # od2 now the most recent, also held
    reply = d.load("od3", on_demand=True)
    assert reply.code == 503 and "--max-on-demand-loras" in reply.message and "in use" in reply.message
    assert sorted(d.registry) == ["explicit", "od1", "od2"] and _lru_unloads(d.decisions) == []
    d.finish_loads()
    d.complete()  # both run now
    d.abort("w1")  # od1 is idle again: it goes, although od2 was used later
    reply = d.load("od3", on_demand=True)
    assert reply.code == 200 and _lru_unloads(d.decisions) == ["od1"]
    d.run()
    assert d.finish_reasons == {"w1": "abort", "w2": "length"}  # w2 kept its adapter to the end
    assert sorted(d.registry) == ["explicit", "od2", "od3"]
    d.check_idle()


def test_explicit_loads_do_not_count_toward_the_bound():
    d = _driver()
    for name in ("e1", "e2", "e3"):
        d.load(name)
    assert d.load("od1", on_demand=True).code == 200 and d.load("od2", on_demand=True).code == 200
    assert sorted(d.registry) == ["e1", "e2", "e3", "od1", "od2"]
    assert d.load("od3", on_demand=True).code == 200 and _lru_unloads(d.decisions) == ["od1"]


def test_a_request_in_flight_keeps_its_adapter_until_it_ends():
    d = Driver(enable_lora=True, max_on_demand_loras=1)
    v1 = d.load("od1", on_demand=True).version_id
    d.arrive("r1", 3, lora="od1", max_tokens=3)
    assert d.load("od2", on_demand=True).code == 503  # od1 runs r1
    d.run()
    assert d.load("od2", on_demand=True).code == 200 and _lru_unloads(d.decisions) == ["od1"]
    assert d.finish_reasons == {"r1": "length"}
    assert all(r.lora_slot == 0 for p in d.plans for r in p.new_reqs + p.cached_reqs)  # r1 ran on od1's slot
    assert d.of_type(ev.AdapterEvicted) == [ev.AdapterEvicted(0, v1)]  # freed once od1 went


def test_on_demand_marks_and_the_use_clock_are_state():
    d = _driver()
    d.load("od1", on_demand=True)
    d.load("od2", on_demand=True)
    d.arrive("r1", 3, lora="od1", max_tokens=1)
    d.run()
    snapshot = d.core.snapshot()["adapters"]
    assert [(v["name"], v["on_demand"], v["last_used"]) for v in snapshot["versions"]] == [
        ("od1", True, 3),
        ("od2", True, 2),
    ]
    assert snapshot["on_demand_use_clock"] == 3
    assert d.core.state_rows()[5][-1] == [[[1, False, True, 3], [2, False, True, 2]], 3]


def test_a_request_never_runs_on_an_adapter_loaded_afresh_under_its_name():
    """The HTTP process names the version it resolved: an in-place reload since is the same
    adapter (the request runs on the new version); an unload and a fresh load is not (404)."""
    d = Driver(enable_lora=True, max_on_demand_loras=1)
    v1 = d.load("od", on_demand=True).version_id
    assert d.load("other", on_demand=True).code == 200  # od was idle: unregistered
    v3 = d.load("od", path="/elsewhere/od", on_demand=True).version_id  # a fresh registration of the name
    (rejected,) = d.send(
        ev.RequestArrived("stale", [1, 2, 3], SamplingParams(max_tokens=1), lora_name="od", lora_version_id=v1)
    )
    assert (rejected.code, rejected.param) == (404, "model") and "retry" in rejected.message
    v4 = d.load("od", path="/third/od", inplace=True).version_id  # an in-place reload: the same adapter
    for req_id, named in (("by-v3", v3), ("by-v4", v4)):
        d.worker.req_versions[req_id] = v4
        d.send(
            ev.RequestArrived(req_id, [1, 2, 3], SamplingParams(max_tokens=1), lora_name="od", lora_version_id=named)
        )
    d.run()
    assert d.finish_reasons == {"by-v3": "length", "by-v4": "length"}
    assert [x.req_id for x in d.of_type(ev.RequestRejected)] == ["stale"]


def _arrive_with_load(d: Driver, req_id: str, name: str, named_version: int, expected_version: int) -> list:
    """A RequestArrived naming the on-demand adapter `name` as the HTTP process resolved it
    (`named_version`), carrying its load; the fake worker expects it on `expected_version`."""
    d.worker.req_versions[req_id] = expected_version
    load = ev.OnDemandLoad(f"/adapters/{name}", 8, 1000)
    sampling = SamplingParams(max_tokens=3)
    return d.send(
        ev.RequestArrived(req_id, [1, 2, 3], sampling, lora_name=name, lora_version_id=named_version, on_demand=load)
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_an_adapter_unregistered_before_its_request_arrives_is_registered_again(overlap, tmp_path):
    """The HTTP process resolved od1, then od2's load unregistered it (idle, least recently used)
    before od1's request arrived: the request registers it again, in the same apply, and runs."""
    writer = EventLogWriter(str(tmp_path), _engine(overlap).to_json(), run_id="od")
    d = Driver(enable_lora=True, lora_overlap_loading=overlap, max_on_demand_loras=1, log=writer)
    v1 = d.load("od1", on_demand=True).version_id
    assert d.load("od2", on_demand=True).code == 200 and _lru_unloads(d.decisions) == ["od1"]
    decisions = _arrive_with_load(d, "r1", "od1", v1, expected_version=3)
    assert not d.of_type(ev.RequestRejected)
    registered = [x for x in decisions if isinstance(x, ev.AdapterRegistered)]
    assert [(x.name, x.version_id, x.path) for x in registered] == [("od1", 3, "/adapters/od1")]
    assert ev.AdapterUnloaded("od2", 2, "lru") in decisions  # the bound holds: od2 was idle
    assert not any(isinstance(x, ev.AdapterOpReplied) for x in decisions)  # no op to answer
    decisions = _arrive_with_load(d, "r2", "od1", v1, expected_version=3)  # resolved before r1 came
    assert not any(isinstance(x, (ev.AdapterRegistered, ev.RequestRejected)) for x in decisions)  # the same files
    d.run()
    assert d.finish_reasons == {"r1": "length", "r2": "length"} and sorted(d.registry) == ["od1"]
    d.check_idle()
    writer.append(ev.LogClosed("done"))
    writer.close()
    assert replay(writer.path).ok  # decided from logged inputs alone


def test_registering_again_is_refused_with_503_while_in_use_and_never_over_a_registered_name():
    d = Driver(enable_lora=True, max_on_demand_loras=1)
    v1 = d.load("od1", on_demand=True).version_id
    d.load("od2", on_demand=True)
    d.arrive("r2", 3, lora="od2", max_tokens=4)  # holds od2
    before = len(d.decisions)
    (rejected,) = _arrive_with_load(d, "r1", "od1", v1, expected_version=0)
    assert (rejected.req_id, rejected.code, rejected.param) == ("r1", 503, "model")
    assert "--max-on-demand-loras" in rejected.message and "retry later" in rejected.message
    assert d.decisions[before:] == [rejected] and sorted(d.registry) == ["od2"]
    d.run()
    assert d.finish_reasons == {"r2": "length"}
    # od1 now names an adapter the user loaded: the request's load does not register a second
    # one; the usual check refuses the request (it named another adapter)
    v3 = d.load("od1", path="/elsewhere/od1").version_id
    (rejected,) = _arrive_with_load(d, "r3", "od1", v1, expected_version=v3)
    assert (rejected.code, rejected.param) == (404, "model") and "retry" in rejected.message
    assert [x.version_id for x in d.of_type(ev.AdapterRegistered)] == [1, 2, 3]
    d.check_idle()


def _engine(overlap: bool) -> EngineConfig:
    return EngineConfig(
        model_dir="m",
        served_model_name="m",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=4,
        enable_lora=True,
        lora_overlap_loading=overlap,
        max_on_demand_loras=1,
    )
