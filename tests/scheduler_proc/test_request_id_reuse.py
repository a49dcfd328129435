"""A request id (a client's X-Request-Id) names a new request once its old request ended and no
step in flight still holds it; while one does, its report would name the id, so the core refuses."""

from ledgerserve.shared import events as ev
from tests.scheduler_proc.driver import Driver


def test_an_id_is_free_again_once_its_request_ended():
    d = Driver()
    d.arrive("a", 3, max_tokens=2)
    d.run()
    assert d.finish_reasons == {"a": "length"} and d.core.finished_req_ids == ["a"]  # not told to workers yet
    decisions = d.arrive("a", 5, max_tokens=3)  # accepted: no step holds the old one
    assert not any(isinstance(x, ev.RequestRejected) for x in decisions)
    plan = d.plans[-1]
    assert plan.finished_req_ids == ["a"] and [r.req_id for r in plan.new_reqs] == ["a"]  # the old one dropped first
    d.run()
    assert d.outputs["a"] == [7] * 5 and d.finish_reasons == {"a": "length"}
    assert d.of_type(ev.RequestRejected) == []
    d.check_idle()


def test_an_id_held_by_a_step_in_flight_is_refused_until_that_step_completes():
    d = Driver(max_steps_in_flight=2)
    d.arrive("a", 3, max_tokens=8)
    d.complete()  # step 1 done; step 2 (sampling for a) is in flight
    assert d.num_in_flight >= 1
    d.abort("a")
    (rejected,) = d.arrive("a", 4, max_tokens=1)
    assert isinstance(rejected, ev.RequestRejected) and "already in use" in rejected.message
    while d.num_in_flight:
        d.complete()
    assert not any(isinstance(x, ev.RequestRejected) for x in d.arrive("a", 4, max_tokens=1))
    d.run()
    assert d.finish_reasons == {"a": "length"}
    d.check_idle()
