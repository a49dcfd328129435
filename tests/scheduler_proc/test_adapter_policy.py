"""FCFS with adapter affinity, bounded by aging: under a skewed workload that keeps one
adapter busy forever, a request for another adapter still gets its slot."""

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
