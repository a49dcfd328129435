"""Targeted drains (overlapped loading): a waiting request whose adapter can have no slot gets
one slot drained for it, the one that frees soonest and that no request ahead of it needs;
only that slot's adapter stops being admitted behind it, so batches stay full; its wait stays
bounded by the max wait plus the victim's remaining tokens; a draining slot goes to no other
version; a drain is cancelled cleanly when it is no longer needed; and unloads, load
failures and preemption leave nothing behind."""

from ledgerserve.shared import events as ev
from tests.scheduler_proc.driver import Driver
from tests.scheduler_proc.test_adapter_movement import _moves, _slot_states


def drain_driver(**kwargs) -> Driver:
    kwargs.setdefault("max_num_seqs", 8)
    return Driver(enable_lora=True, lora_overlap_loading=True, **kwargs)


def _drains(decisions) -> list[ev.AdapterDrainStarted | ev.AdapterDrainCancelled]:
    return [x for x in decisions if isinstance(x, (ev.AdapterDrainStarted, ev.AdapterDrainCancelled))]


def _first_step_of(d: Driver, req_id: str) -> int | None:
    return next((plan.step for plan in d.plans if req_id in Driver.scheduled_tokens(plan)), None)


def _check_clean_end(d: Driver) -> None:
    d.run()
    d.check_idle()
    adapters = d.core.snapshot()["adapters"]
    assert adapters["drains"] == [] and adapters["loads_in_flight"] == []
    assert (
        d.engine_stats.num_pinned_slots == 0
        and d.engine_stats.num_deferred_evictions == 0
        and not d.of_type(ev.EngineFailed)
    )


def _three_resident(max_tokens: dict[str, int], **kwargs) -> Driver:
    """Slots 0, 1, 2 hold a, b, c, each with one running request of `max_tokens[name]` tokens
    (a1 from step 1, b1 and c1 from step 2); d is registered and in no slot; then d1 arrives
    (`d1_tokens`) while step 2 runs. Max wait 2: d1 is aged once step 3 is planned."""
    d1_tokens = kwargs.pop("d1_tokens", 2)
    d = drain_driver(max_loras=3, lora_max_wait_steps=2, **kwargs)
    for name in "abcd":
        d.load(name)
    for name in "abc":
        d.arrive(f"{name}1", 3, lora=name, max_tokens=max_tokens[name])
    d.finish_loads()  # a's load ends first: step 1 runs a1; b1 and c1 join in step 2
    d.complete()
    assert _slot_states(d) == [("PINNED", 1), ("PINNED", 2), ("PINNED", 3)] and d.core.step == 2
    d.arrive("d1", 3, lora="d", max_tokens=d1_tokens)
    return d


def _age(d: Driver) -> list:
    """Complete steps 2 and 3: the pass after step 3 finds d1 aged. Then a1 has 3 tokens, b1
    and c1 have 2."""
    decisions = d.complete()
    assert _drains(decisions) == []  # the affinity window: requests of resident adapters pass d1
    return decisions + d.complete()


def test_the_victim_is_the_slot_whose_requests_end_soonest():
    d = _three_resident({"a": 8, "b": 4, "c": 6})
    decisions = _age(d)  # a1 may generate 5 more tokens, b1 2, c1 4
    assert _drains(decisions) == [ev.AdapterDrainStarted(1, 2, 4, 2)]
    assert d.core.snapshot()["adapters"]["drains"] == [{"slot": 1, "version_id": 2, "for_version_id": 4}]
    rows = d.core.state_rows()
    d.core.adapters.slots.end_drain(1)
    assert d.core.state_rows() != rows  # the StateDigest covers the drain marks
    d.core.adapters.slots.start_drain(1, 4)
    _check_clean_end(d)
    assert d.finish_reasons["d1"] == "length"


def test_ties_go_to_the_fewest_waiting_then_the_lowest_index():
    """a1, b1 and c1 may each generate 6 more tokens; a2 waits behind d1 (max_num_seqs), so
    a's slot loses the tie on waiting requests, and b's the one with c on the index."""
    d = _three_resident({"a": 9, "b": 8, "c": 8}, max_num_seqs=3)
    d.arrive("a2", 3, lora="a", max_tokens=1)
    assert _drains(_age(d)) == [ev.AdapterDrainStarted(1, 2, 4, 6)]
    _check_clean_end(d)


def test_a_slot_needed_by_a_request_ahead_is_never_the_victim():
    """b1 ends soonest, but b2 waits ahead of d1 (max_num_seqs): c's slot drains instead."""
    d = drain_driver(max_loras=3, lora_max_wait_steps=2, max_num_seqs=3)
    for name in "abcd":
        d.load(name)
    for name, max_tokens in (("a", 8), ("b", 4), ("c", 6)):
        d.arrive(f"{name}1", 3, lora=name, max_tokens=max_tokens)
    d.finish_loads()
    d.complete()
    d.arrive("b2", 3, lora="b", max_tokens=1)
    d.arrive("d1", 3, lora="d", max_tokens=2)
    assert _drains(_age(d)) == [ev.AdapterDrainStarted(2, 3, 4, 4)]
    _check_clean_end(d)
    assert d.finish_reasons["b2"] == "length" and d.finish_reasons["d1"] == "length"


def test_the_drain_bars_only_the_victims_adapter_behind_its_request():
    d = _three_resident({"a": 9, "b": 4, "c": 8})
    assert _drains(_age(d)) == [ev.AdapterDrainStarted(1, 2, 4, 2)]  # step 4 runs b1's third token
    for req_id, lora in (("b2", "b"), ("a2", "a"), ("c2", "c"), ("z", None)):
        d.arrive(req_id, 3, lora=lora, max_tokens=1)
    d.complete()
    assert sorted(Driver.scheduled_tokens(d.plans[-1])) == ["a1", "a2", "b1", "c1", "c2", "z"]  # not b2
    decisions = d.complete()  # b1 ends: its slot is idle, d loads there
    assert _moves(decisions) == [("evict", 1, 2), ("assign", 1, 4)]
    # b2, aged too, now has no slot: a's slot (a1 and c1 may each generate 4 more tokens) drains for it
    assert _drains(decisions) == [ev.AdapterDrainStarted(0, 1, 2, 4)]
    d.finish_loads()
    d.complete()
    assert "d1" in Driver.scheduled_tokens(d.plans[-1]) and _first_step_of(d, "b2") is None
    _check_clean_end(d)
    assert d.finish_reasons["b2"] == "length"  # b got a slot back later


# ---------------------------------------------------------------- the hard bound

A_TOKENS = 4  # each streamed request runs 4 steps


def _two_streams(max_wait_steps: int, num_steps: int = 40) -> Driver:
    """Two slots; a new request for `a` and for `c` every step keeps both pinned; `b1` arrives
    at step 0 behind a0 and c0. Loads end before the next step."""
    d = drain_driver(max_loras=2, lora_max_wait_steps=max_wait_steps, max_num_seqs=16)
    for name in "abc":
        d.load(name)
    d.arrive("a0", 3, lora="a", max_tokens=A_TOKENS)
    d.arrive("c0", 3, lora="c", max_tokens=A_TOKENS)
    d.arrive("b1", 3, lora="b", max_tokens=2)
    for i in range(1, num_steps):
        d.arrive(f"a{i}", 3, lora="a", max_tokens=A_TOKENS)
        d.arrive(f"c{i}", 3, lora="c", max_tokens=A_TOKENS)
        d.finish_loads()
        if d.in_flight is not None:
            d.complete()
    return d


def test_the_wait_is_bounded_by_the_max_wait_and_the_victims_remaining_tokens():
    """b1 arrives at step 0. Its drain starts at the first pass before planning a step at least
    W after its arrival where a slot may drain (both are pinned from step 1): after step s0 =
    max(W - 1, 1) is planned. The victim's requests may then generate at most D tokens (logged),
    one a step from step s0 on, so the slot is idle once step s0 + D - 1 completes (here exactly:
    every request runs to max_tokens); step s0 + D is planned then, without b1, while b loads,
    and b1 runs in step s0 + D + 1. Meanwhile the other adapter's requests, behind b1, keep
    running. (The bound in drain.py: t0 + W + D + L, L the steps a load spans.)"""
    for max_wait_steps in (1, 2, 5, 9):
        d = _two_streams(max_wait_steps)
        (started, *_) = [x for x in d.decisions if isinstance(x, ev.AdapterDrainStarted)]
        start_step = max(max_wait_steps - 1, 1)
        assert started.for_version_id == 2 and started.num_remaining_tokens <= A_TOKENS
        assert _first_step_of(d, "b1") == start_step + started.num_remaining_tokens + 1
        victim = "a" if started.version_id == 1 else "c"
        other = "c" if victim == "a" else "a"
        draining = range(start_step + 1, _first_step_of(d, "b1") + 1)
        assert not any(_first_step_of(d, f"{victim}{i}") in draining for i in range(40))
        assert any(_first_step_of(d, f"{other}{i}") in draining for i in range(40))  # batches stay full
        assert all(len(d.plan_versions(plan)) <= 2 for plan in d.plans)
        _check_clean_end(d)
        assert len(d.finish_reasons) == 81


def test_without_a_drainable_slot_the_max_wait_starts_nothing():
    """A slot still loading cannot drain, and a waiting request needing it is ahead: nothing drains."""
    d = drain_driver(max_loras=1, lora_max_wait_steps=1)
    d.load("a")
    d.load("b")
    d.arrive("a1", 3, lora="a", max_tokens=1)
    d.arrive("b1", 3, lora="b", max_tokens=1)
    assert _drains(d.decisions) == [] and _slot_states(d) == [("LOADING", 1)]
    _check_clean_end(d)


# ---------------------------------------------------------------- no thrash, cancellation


def _protected_a(a_tokens: int) -> Driver:
    """max_num_seqs 3: a1, b1, c1 run; a2 waits ahead of d1, so a's slot may not drain for d."""
    d = drain_driver(max_loras=3, lora_max_wait_steps=2, max_num_seqs=3)
    for name in "abcde":
        d.load(name)
    for name, max_tokens in (("a", a_tokens), ("b", 12), ("c", 9)):
        d.arrive(f"{name}1", 3, lora=name, max_tokens=max_tokens)
    d.finish_loads()
    d.complete()
    d.arrive("a2", 3, lora="a", max_tokens=2)
    d.arrive("d1", 3, lora="d", max_tokens=2)
    return d


def test_a_draining_slot_goes_to_its_version_only():
    """c's slot drains for d (a's is needed ahead); then a1 ends, a2 runs on a's slot and e1
    arrives: a's slot drains for e and idles before c's, and e takes it while d, first in the
    slot order, waits for c's: no version takes a slot drained for another."""
    d = _protected_a(a_tokens=4)
    assert _drains(_age(d)) == [ev.AdapterDrainStarted(2, 3, 4, 7)]
    d.arrive("e1", 3, lora="e", max_tokens=1)
    decisions = []
    while not d.of_type(ev.AdapterEvicted):
        decisions += d.complete()
        d.finish_loads()
    assert _drains(decisions) == [ev.AdapterDrainStarted(0, 1, 5, 1)]
    assert _moves(d.decisions)[-2:] == [("evict", 0, 1), ("assign", 0, 5)]
    assert d.core.snapshot()["adapters"]["drains"] == [  # e's slot stays e's until e1 runs there
        {"slot": 0, "version_id": 5, "for_version_id": 5},
        {"slot": 2, "version_id": 3, "for_version_id": 4},
    ]
    d.complete()
    assert "e1" in Driver.scheduled_tokens(d.plans[-1]) and _moves(d.decisions)[-1] == ("assign", 0, 5)
    decisions = d.complete()  # e1 ends: e's slot is idle, and d, with no slot yet, takes it
    assert _moves(decisions) == [("evict", 0, 5), ("assign", 0, 4)]
    assert _drains(decisions) == [ev.AdapterDrainCancelled(2, 3, 4, "it has another slot")]
    _check_clean_end(d)


def test_an_aborted_request_cancels_its_drain():
    d = _three_resident({"a": 8, "b": 6, "c": 9})
    assert _drains(_age(d)) == [ev.AdapterDrainStarted(1, 2, 4, 4)]
    d.arrive("b2", 3, lora="b", max_tokens=1)
    d.complete()
    assert "b2" not in Driver.scheduled_tokens(d.plans[-1])
    decisions = d.abort("d1")
    assert _drains(decisions) == [ev.AdapterDrainCancelled(1, 2, 4, "no request waits for it")]
    d.complete()
    assert "b2" in Driver.scheduled_tokens(d.plans[-1])  # b is admitted again
    _check_clean_end(d)
    assert d.of_type(ev.AdapterEvicted) == []


def test_a_slot_coming_free_elsewhere_cancels_the_drain():
    """c's slot drains for d (a's is needed ahead by a2); a's requests end first, and d takes
    a's idle slot: c's drain is cancelled and c is admitted again."""
    d = _protected_a(a_tokens=3)
    assert _drains(_age(d)) == [ev.AdapterDrainStarted(2, 3, 4, 7)]
    decisions = []
    while not d.of_type(ev.AdapterEvicted):
        decisions += d.complete()
    assert _moves(decisions) == [("evict", 0, 1), ("assign", 0, 4)]
    assert _drains(decisions) == [ev.AdapterDrainCancelled(2, 3, 4, "it has another slot")]
    _check_clean_end(d)


# ---------------------------------------------------------------- unload, load failure, preemption


def test_unloading_the_waiting_adapter_keeps_the_drain_for_its_requests():
    """An unloaded version's waiting requests still run on it: the drain goes on, and the
    version is dropped once they end."""
    d = _three_resident({"a": 8, "b": 4, "c": 6})
    assert _drains(_age(d)) == [ev.AdapterDrainStarted(1, 2, 4, 2)]
    assert d.unload("d").code == 200 and d.core.snapshot()["adapters"]["drains"] != []
    _check_clean_end(d)
    assert d.finish_reasons["d1"] == "length" and [x.slot for x in d.of_type(ev.AdapterSlotAssigned)][-1] == 1
    assert 4 not in [v["version_id"] for v in d.core.snapshot()["adapters"]["versions"]]


def test_a_load_failure_of_the_waiting_adapter_cancels_its_drain():
    d = _three_resident({"a": 8, "b": 4, "c": 6})
    assert _drains(_age(d)) == [ev.AdapterDrainStarted(1, 2, 4, 2)]
    d.arrive("b2", 3, lora="b", max_tokens=1)
    decisions = d.send(ev.AdapterLoadFailed(0, -1, 4, "adapter_model.safetensors is truncated"))
    assert [x.req_id for x in decisions if isinstance(x, ev.RequestRejected)] == ["d1"]
    assert _drains(decisions) == [ev.AdapterDrainCancelled(1, 2, 4, "no request waits for it")]
    d.complete()
    assert "b2" in Driver.scheduled_tokens(d.plans[-1])
    _check_clean_end(d)
    assert d.finish_reasons["b2"] == "length"


def test_unloading_the_victim_frees_its_slot_when_its_requests_end():
    d = _three_resident({"a": 8, "b": 4, "c": 6})
    assert _drains(_age(d)) == [ev.AdapterDrainStarted(1, 2, 4, 2)]
    d.unload("b")  # b1 still runs: a deferred eviction
    decisions = d.complete() + d.complete()
    assert _moves(decisions) == [("evict", 1, 2), ("unstage", -1, 2), ("assign", 1, 4)]
    _check_clean_end(d)
    assert d.finish_reasons["d1"] == "length"


def test_a_preempted_request_of_the_victim_resumes_ahead_of_the_drain():
    """KV pressure preempts the victim's running request: back at the head of the queue, ahead
    of the drain's request, it is admitted again on its slot (not barred), and the slot goes
    to the waiting version once it ends; a request of the victim behind b1 waits throughout."""
    d = drain_driver(max_loras=1, lora_max_wait_steps=1, num_kv_blocks=6, block_size=4, max_model_len=32)
    d.load("a")
    d.load("b")
    d.arrive("z", 8, max_tokens=12)  # grows to 5 blocks
    d.arrive("a1", 4, lora="a", max_tokens=12)  # grows to 4 blocks: the pool of 6 cannot hold both
    d.finish_loads()
    d.arrive("b1", 3, lora="b", max_tokens=1)
    d.complete()
    d.complete()
    # a1 waits ahead of b1 until step 2, so a's slot drains only after a1 sampled its first token
    assert _drains(d.decisions) == [ev.AdapterDrainStarted(0, 1, 2, 11)]
    d.arrive("a2", 3, lora="a", max_tokens=1)  # behind b1: barred while a's slot drains
    while not d.of_type(ev.RequestPreempted):
        d.complete()
    assert [x.req_id for x in d.of_type(ev.RequestPreempted)] == ["a1"]
    d.run()
    a1_starts = [plan.step for plan in d.plans if "a1" in [r.req_id for r in plan.new_reqs]]
    assert len(a1_starts) == 2 and a1_starts[1] < _first_step_of(d, "b1") < _first_step_of(d, "a2")
    assert [x.version_id for x in d.of_type(ev.AdapterSlotAssigned)] == [1, 2, 1]
    _check_clean_end(d)
    assert len(d.finish_reasons) == 4
