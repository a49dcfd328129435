"""bench_decode's GPU-idle share, read from the steps' (start, end) event times."""

from __future__ import annotations

import pytest

from scripts.bench_decode import idle_share


def test_idle_share_counts_the_gaps_between_steps() -> None:
    # three steps: the second queued 2 ms after the first ended, the third right behind the second
    assert idle_share([(0.0, 10.0), (12.0, 20.0), (20.0, 30.0)]) == pytest.approx(2.0 / 30.0)


def test_a_step_queued_ahead_starts_when_the_one_before_ends() -> None:
    # with a step in flight, every start event fires as the step before it ends: no idle time
    assert idle_share([(0.0, 5.0), (5.0, 10.0), (10.0, 15.0)]) == 0.0


def test_one_step_has_no_gap_to_measure() -> None:
    assert idle_share([(3.0, 9.0)]) == 0.0
    assert idle_share([]) == 0.0
