"""The GEMM tuner's choice rule (kernels/gemm_tuning.fastest): pure, so it runs anywhere."""

from __future__ import annotations

from ledgerserve.kernels.gemm_tuning import fastest


def test_keeps_linear_when_no_candidate_beats_it_by_the_margin() -> None:
    assert fastest(10.0, [10.0, 12.5]) is None
    assert fastest(10.0, [9.95]) is None  # within MIN_GAIN: a tie
    assert fastest(10.0, []) is None


def test_picks_the_fastest_candidate_that_beats_linear() -> None:
    assert fastest(10.0, [9.5, 8.0, 8.5]) == 1


def test_skips_failed_or_wrong_candidates() -> None:
    assert fastest(10.0, [None, 9.0, None]) == 1
    assert fastest(10.0, [None, None]) is None
