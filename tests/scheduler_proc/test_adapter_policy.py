"""FCFS with adapter affinity, bounded by aging: under a skewed workload that keeps one
adapter busy forever, a request for another adapter still gets its slot."""

from ledgerserve.scheduler_proc.core.policy import Policy
from tests.scheduler_proc.driver import Driver


def _first_step_of(d: Driver, req_id: str) -> int | None:
    return next((plan.step for plan in d.plans if req_id in Driver.scheduled_tokens(plan)), None)


def _skewed(aging_steps: int, num_steps: int = 40) -> Driver:
    """One slot; a new request for `a` every step keeps `a` pinned; `b1` arrives at step 1."""
    d = Driver(enable_lora=True, max_loras=1, lora_max_wait_steps=aging_steps, max_num_seqs=8)
    d.load("a")
    d.load("b")
    d.arrive("a0", 3, lora="a", max_tokens=4)
    d.arrive("b1", 3, lora="b", max_tokens=2)
    for i in range(1, num_steps):
        d.arrive(f"a{i}", 3, lora="a", max_tokens=4)
        d.complete()
    return d


def test_affinity_lets_the_busy_adapter_go_ahead_until_aging():
    d = _skewed(aging_steps=4)
    assert _first_step_of(d, "a1") == 2  # arrived after b1, went ahead of it
    first_b = _first_step_of(d, "b1")
    # b1 arrived at step 1; from step 5 nothing overtakes it; `a` drains within 4 + 1 steps
    assert first_b is not None and first_b <= 1 + 4 + 4 + 2
    d.run()
    assert all(len(d.plan_versions(plan)) <= 1 for plan in d.plans)
    assert len(d.finish_reasons) == 41


def test_without_aging_the_skewed_workload_starves_the_other_adapter():
    d = _skewed(aging_steps=10_000)
    assert _first_step_of(d, "b1") is None  # the contrast: only aging bounds the wait
    d.run()
    assert d.finish_reasons["b1"] == "length"


def test_aged_request_still_lets_base_requests_through():
    d = _skewed(aging_steps=2, num_steps=4)
    d.arrive("base", 3, max_tokens=1)
    d.complete()
    assert "base" in Driver.scheduled_tokens(d.plans[-1])
    d.run()


# ---------------------------------------------------------------- overlapped loading

A_TOKENS = 4  # each `a` request runs 4 steps: its prefill samples the first token, 3 decodes follow


def _skewed_overlap(max_wait_steps: int, num_steps: int = 40, targeted_drain: bool = True) -> Driver:
    """As `_skewed` with overlapped loading: every load ends before the next step, and the
    engine idles (no step) while the only runnable request waits on a load."""
    d = Driver(
        enable_lora=True,
        max_loras=1,
        lora_max_wait_steps=max_wait_steps,
        max_num_seqs=8,
        lora_overlap_loading=True,
        policy=Policy.current() if targeted_drain else Policy.for_schema(3),
    )
    d.load("a")
    d.load("b")
    d.arrive("a0", 3, lora="a", max_tokens=A_TOKENS)
    d.arrive("b1", 3, lora="b", max_tokens=2)  # arrives at step 0: b has no slot, a's loads
    for i in range(1, num_steps):
        d.arrive(f"a{i}", 3, lora="a", max_tokens=A_TOKENS)
        d.finish_loads()
        if d.in_flight is not None:
            d.complete()
    return d


def test_overlap_starvation_is_bounded_by_the_max_wait_without_targeted_drains():
    """The schema 3 policy (replay keeps it for those logs; targeted drains have their own
    bound, test_adapter_drain.py). b1 arrives at step 0 with a's requests streaming in, one a
    step, keeping the one slot pinned. From step W = lora_max_wait_steps on nothing passes b1; a0, ahead of it, starts
    at step 1 (the first). So the last `a` request starts at step max(W - 1, 1) at the latest
    and ends A_TOKENS - 1 steps later; that step's completion frees the slot, the prefetch
    pass loads b into it, and b1 runs in the next step: at step max(W - 1, 1) + A_TOKENS at
    the latest (plus the steps a load takes while other requests run; here none)."""
    for max_wait_steps in (1, 2, 5, 9):
        d = _skewed_overlap(max_wait_steps, targeted_drain=False)
        first_b = _first_step_of(d, "b1")
        assert first_b is not None and max_wait_steps < first_b <= max(max_wait_steps - 1, 1) + A_TOKENS
        passed_b1 = _first_step_of(d, "a1") < first_b  # affinity: a1, behind b1, went ahead until the max wait
        assert passed_b1 == (max_wait_steps > 1)
        d.run()
        assert all(len(d.plan_versions(plan)) <= 1 for plan in d.plans)
        assert len(d.finish_reasons) == 41 and d.engine_stats.num_pinned_slots == 0


def test_overlap_without_the_max_wait_the_stream_starves_the_other_adapter():
    d = _skewed_overlap(max_wait_steps=10_000)
    assert _first_step_of(d, "b1") is None
    d.run()
    assert d.finish_reasons["b1"] == "length"


def test_overlap_a_loading_slot_bars_nothing():
    """A request whose slot is loading does not stop others: past its max wait, requests of
    a ready adapter behind it still run while its load takes many steps."""
    d = Driver(enable_lora=True, max_loras=2, lora_max_wait_steps=2, lora_overlap_loading=True)
    d.load("a")
    d.load("b")
    d.arrive("a0", 3, lora="a", max_tokens=1)
    d.finish_loads()
    d.run()
    d.arrive("b1", 3, lora="b", max_tokens=1)  # b loads into the free slot, slowly
    for i in range(1, 8):
        d.arrive(f"a{i}", 3, lora="a", max_tokens=1)
        d.complete()
    assert all(f"a{i}" in d.finish_reasons for i in range(1, 7)) and "b1" not in d.finish_reasons
    d.finish_loads()
    d.run()
    assert d.finish_reasons["b1"] == "length"
