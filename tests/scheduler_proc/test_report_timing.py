"""Two runs of the same traffic decide alike however the workers' reports that no decision waits
on fall between the steps: a CPU-tier staging, or one rank's part of a slot load on two ranks.
Their timing is the workers'; the decisions, StateDigests included, must not follow it."""

from __future__ import annotations

from collections.abc import Callable

from ledgerserve.shared import codec
from ledgerserve.shared import events as ev
from tests.scheduler_proc.driver import Driver


def _decisions(deliver_early: Callable[[Driver], None] | None, tensor_parallel_size: int = 1) -> list[bytes]:
    """Load `x` (staged into the CPU tier at once), then a base request of 6 tokens; the loads end
    after the first step (`deliver_early`) or once the request is done."""
    d = Driver(enable_lora=True, lora_overlap_loading=True, tensor_parallel_size=tensor_parallel_size, digests=True)
    d.load("x")
    d.arrive("b", 3, max_tokens=6)
    d.complete()
    if deliver_early is not None:
        deliver_early(d)
    while d.num_in_flight:
        d.complete()
    d.finish_loads()
    d.check_idle()
    return [codec.encode(x) for x in d.decisions]


def test_a_staging_reported_between_steps_changes_no_decision():
    late = _decisions(None)
    early = _decisions(lambda d: d.finish_loads(slot=-1))
    assert any(ev.StateDigest.__name__.encode() in x for x in early)
    assert early == late


def test_one_ranks_part_of_a_slot_load_changes_no_decision():
    """Two ranks: `x`'s request waits for its slot while `b` runs; rank 0 reports its part of the
    slot load early or late, rank 1 only after `b` is done."""

    def run(early: bool) -> list[bytes]:
        d = Driver(enable_lora=True, lora_overlap_loading=True, tensor_parallel_size=2, digests=True)
        d.load("x")
        d.finish_loads(slot=-1)
        d.arrive("b", 3, max_tokens=6)
        d.arrive("r", 3, lora="x", max_tokens=2)  # gets a slot; its load runs beside b's steps
        d.complete()
        if early:
            d.finish_loads(rank=0)
        while d.num_in_flight:
            d.complete()
        d.finish_loads()
        d.run()
        assert d.finish_reasons == {"b": "length", "r": "length"}
        d.check_idle()
        return [codec.encode(x) for x in d.decisions]

    assert run(early=True) == run(early=False)
