"""Tensor-parallel digests: the test-only fault switch and the core's reaction to it."""

import pytest

from ledgerserve.shared import events as ev
from ledgerserve.shared.env import FAULT_DIGEST_RANK as FAULT_DIGEST_RANK_ENV
from ledgerserve.shared.env import FAULT_DIGEST_STEP as FAULT_DIGEST_STEP_ENV
from ledgerserve.worker_proc.loop import maybe_fault
from tests.scheduler_proc.driver import Driver


def test_fault_switch_off_by_default(monkeypatch):
    monkeypatch.delenv(FAULT_DIGEST_RANK_ENV, raising=False)
    digest = ev.RankDigest(3, 1, 0x1234)
    assert maybe_fault(digest) is digest


def test_fault_switch_flips_only_its_rank_from_its_step(monkeypatch):
    monkeypatch.setenv(FAULT_DIGEST_RANK_ENV, "1")
    monkeypatch.setenv(FAULT_DIGEST_STEP_ENV, "3")
    assert maybe_fault(ev.RankDigest(2, 1, 7)).digest == 7  # before its step
    assert maybe_fault(ev.RankDigest(3, 0, 7)).digest == 7  # another rank
    faulty = maybe_fault(ev.RankDigest(3, 1, 7))
    assert (faulty.step, faulty.rank) == (3, 1) and faulty.digest != 7


@pytest.mark.parametrize("tp,odd", [(2, [1]), (4, [2]), (4, [1, 3])])
def test_core_reports_mismatch_then_fails(monkeypatch, tp, odd):
    monkeypatch.setenv(FAULT_DIGEST_STEP_ENV, "1")
    d = Driver(tensor_parallel_size=tp)
    d.arrive("a", 3, max_tokens=4)
    out = []
    for rank in range(tp):
        monkeypatch.setenv(FAULT_DIGEST_RANK_ENV, str(rank) if rank in odd else "-1")
        out += d.send(maybe_fault(ev.RankDigest(1, rank, 0xC0FFEE)))
    mismatch, failed = out
    assert mismatch.step == 1 and mismatch.odd_ranks == odd and len(mismatch.digests) == tp
    assert isinstance(failed, ev.EngineFailed)
    assert "after step 1" in failed.message and f"ranks {odd}" in failed.message
    assert d.arrive("b", 3)[0].code == 503  # the engine stays failed


def test_digests_of_one_step_wait_for_every_rank():
    d = Driver(tensor_parallel_size=2)
    d.arrive("a", 3)
    assert d.send(ev.RankDigest(1, 0, 1)) == []
    assert d.core.rank_digests == {1: {0: 1}}


def test_rank_zero_runs_at_most_one_step_ahead_of_the_digest_check():
    """A slow rank's digests hold back the plan two steps after the last agreed one, so a
    disagreement cannot surface after its requests finished; its digest releases the plan."""

    def plans(decisions):
        return [x.step for x in decisions if isinstance(x, ev.StepPlan)]

    d = Driver(tensor_parallel_size=2)
    d.arrive("a", 3, max_tokens=8)  # plans step 1
    assert plans(d.complete()) == [2]  # no digest is due before step 2
    assert d.send(ev.RankDigest(1, 0, 11)) == []
    assert plans(d.complete()) == []  # step 3 waits for rank 1's digest of step 1
    assert plans(d.send(ev.RankDigest(1, 1, 11))) == [3]
    assert d.send(ev.RankDigest(2, 0, 22)) == []
    assert plans(d.complete()) == []  # step 4 waits for step 2
    mismatch, failed = d.send(ev.RankDigest(2, 1, 99))
    assert mismatch.step == 2 and isinstance(failed, ev.EngineFailed)
    assert d.core.step == 3  # nothing planned past the disagreement


def test_one_rank_never_waits_on_digests():
    d = Driver()
    d.arrive("a", 3, max_tokens=5)
    d.run()
    assert d.core.step == 5 and d.core.last_agreed_step == 0
