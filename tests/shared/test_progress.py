"""Load progress (shared/progress.py): the pure line formatters, and when `Progress` shows them:
a bar redrawn in place on a terminal (rank 0), log lines at most every LOG_INTERVAL_S elsewhere
(rank 0), nothing on other ranks; one bar on the terminal line at a time."""

from __future__ import annotations

import io
import logging

import pytest

from ledgerserve.shared import progress
from ledgerserve.shared.progress import GIB, KIB, MIB, Progress

LOGGER = "test.progress"


def test_status_line_in_the_totals_unit_with_percent_time_and_rate() -> None:
    line = progress.format_status(int(1.2 * GIB), int(16.1 * GIB), 3.1)
    assert line == "1.2 / 16.1 GiB (7%) in 3.1 s, 396 MiB/s"
    assert progress.format_status(3 * MIB, 12 * MIB, 0.5) == "3.0 / 12.0 MiB (25%) in 0.50 s, 6.0 MiB/s"
    assert progress.format_status(300, 900, 2.0) == "300 / 900 B (33%) in 2.0 s, 0.0 MiB/s"


def test_status_line_of_a_zero_or_unknown_total() -> None:
    assert progress.format_status(0, 0, 0.0) == "0 / 0 B (100%) in 0.00 s, ? MiB/s"
    assert progress.format_status(5 * MIB, None, 2.0) == "5.0 MiB in 2.0 s, 2.5 MiB/s"
    assert progress.percent(7, 0) == 100 and progress.percent(11, 10) == 100 and progress.percent(1, 3) == 33


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (KIB, "1.0 KiB"),
        (3 * MIB // 2, "1.5 MiB"),
        (GIB - 1, "1024.0 MiB"),
        (GIB, "1.0 GiB"),
    ],
)
def test_bytes_take_the_largest_unit_reached(num_bytes: int, text: str) -> None:
    assert progress.format_bytes(num_bytes) == text


def test_rates_and_clocks() -> None:
    assert progress.format_rate(3 * GIB, 2.0) == "1.5 GiB/s"
    assert progress.format_rate(410 * MIB, 1.0) == "410 MiB/s"
    assert progress.format_rate(MIB, 0.0) == "? MiB/s"
    assert progress.format_clock(None) == "?"
    assert progress.format_clock(3.9) == "0:03"
    assert progress.format_clock(3723) == "1:02:03"


def test_eta_is_the_rest_at_the_rate_so_far() -> None:
    assert progress.eta_s(GIB, 4 * GIB, 10.0) == pytest.approx(30.0)
    assert progress.eta_s(4 * GIB, 4 * GIB, 10.0) == 0.0
    assert progress.eta_s(0, 4 * GIB, 10.0) is None  # no bytes yet: no rate
    assert progress.eta_s(GIB, None, 10.0) is None
    assert progress.eta_s(GIB, 4 * GIB, 0.0) is None


def test_bar_with_eta_and_without_a_total() -> None:
    bar = progress.format_bar("worker-0 loading weights", GIB, 4 * GIB, 10.0, width=8)
    assert bar == "worker-0 loading weights  25%|##      | 1.0 / 4.0 GiB [0:10<0:30, 102 MiB/s]"
    done = progress.format_bar("w", 4 * GIB, 4 * GIB, 10.0, width=4)
    assert done == "w 100%|####| 4.0 / 4.0 GiB [0:10<0:00, 410 MiB/s]"
    assert progress.format_bar("w", 2 * MIB, None, 1.0) == "w 2.0 MiB [0:01, 2.0 MiB/s]"


def test_end_lines() -> None:
    assert progress.weights_end_line(int(16.1 * GIB), 39.2) == "loaded weights: 16.1 GiB in 39.2 s, 421 MiB/s"
    assert progress.adapter_end_line("sql", 12 * MIB, 0.42) == "loaded adapter sql (12.0 MiB) in 0.42 s"


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _progress(stream: io.StringIO, clock: FakeClock, rank: int = 0, total: int | None = 100 * MIB) -> Progress:
    return Progress("weights", total, rank, logging.getLogger(LOGGER), stream=stream, clock=clock)


def test_modes_by_rank_and_terminal() -> None:
    assert progress.progress_mode(0, True) == progress.BAR
    assert progress.progress_mode(0, False) == progress.LOG
    assert progress.progress_mode(1, True) == progress.QUIET
    assert progress.progress_mode(3, False) == progress.QUIET


def test_terminal_bar_redraws_in_place_at_most_ten_times_a_second_and_ends_with_one_newline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    stream, clock = FakeTerminal(), FakeClock()
    p = _progress(stream, clock)
    for _ in range(100):  # 100 MiB over 2 s: 100 updates, 20 redraw slots
        clock.now_s += 0.02
        p.advance(MIB)
    assert p.close() == pytest.approx(2.0)
    out = stream.getvalue()
    assert out.endswith("\n") and out.count("\n") == 1
    draws = out[:-1].split("\r")[1:]
    assert out.startswith("\r") and 15 <= len(draws) <= 21  # each 0.1 s at most, plus the final state
    assert draws[-1].startswith("worker-0 loading weights 100%|") and "100.0 / 100.0 MiB" in draws[-1]
    assert all(len(d) >= len(prev.rstrip()) for prev, d in zip(draws, draws[1:]))  # a shorter line blanks the rest


def test_a_quick_load_draws_nothing_and_a_second_bar_waits_its_turn() -> None:
    stream, clock = FakeTerminal(), FakeClock()
    quick = _progress(stream, clock)
    quick.advance(MIB)
    quick.close()
    assert stream.getvalue() == ""  # done within one redraw interval: its end line says it all
    first, second = _progress(stream, clock), _progress(stream, clock)
    clock.now_s += 1.0
    first.advance(MIB)
    second.advance(MIB)  # the line is taken: this one shows its end line only
    assert second.mode == progress.QUIET
    first.close()
    second.close()
    assert stream.getvalue().count("\n") == 1
    third = _progress(stream, clock)  # the line is free again
    clock.now_s += 1.0
    third.advance(MIB)
    third.close()
    assert stream.getvalue().count("\n") == 2


def test_without_a_terminal_rank_0_logs_every_two_seconds(caplog: pytest.LogCaptureFixture) -> None:
    stream, clock = io.StringIO(), FakeClock()
    caplog.set_level(logging.INFO, logger=LOGGER)
    p = _progress(stream, clock)
    p.announce("100.0 MiB in 1 file")
    for _ in range(40):  # 5 s, in steps exact in binary
        clock.now_s += 0.125
        p.advance(MIB)
    p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "loading weights: 100.0 MiB in 1 file",
        "loaded weights: 16.0 / 100.0 MiB (16%) in 2.0 s, 8.0 MiB/s",
        "loaded weights: 32.0 / 100.0 MiB (32%) in 4.0 s, 8.0 MiB/s",
    ]
    assert stream.getvalue() == ""  # never the bar, never stdout


def test_other_ranks_show_nothing_while_loading(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    for stream in (io.StringIO(), FakeTerminal()):
        clock = FakeClock()
        p = _progress(stream, clock, rank=1)
        p.announce("100.0 MiB in 1 file")
        for _ in range(50):
            clock.now_s += 0.1
            p.advance(MIB)
        assert p.close() == pytest.approx(5.0) and p.done == 50 * MIB
        assert stream.getvalue() == ""
    assert caplog.records == []


def test_a_total_learned_later_shows_in_the_bar() -> None:
    stream, clock = FakeTerminal(), FakeClock()
    p = _progress(stream, clock, total=None)
    p.set_total(4 * MIB)
    clock.now_s += 0.5
    p.advance(MIB)
    p.close()
    assert "25%|" in stream.getvalue()


class ClosedTerminal(FakeTerminal):
    def write(self, text: str) -> int:
        raise OSError("the terminal hung up")


def test_a_terminal_gone_ends_the_bar_never_the_load() -> None:
    clock = FakeClock()
    p = _progress(ClosedTerminal(), clock)
    clock.now_s += 1.0
    p.advance(MIB)
    assert p.mode == progress.QUIET and not p.owns_line
    p.advance(MIB)
    assert p.close() == pytest.approx(1.0) and p.done == 2 * MIB
    other = _progress(FakeTerminal(), clock)  # the line was given back
    clock.now_s += 1.0
    other.advance(MIB)
    assert other.owns_line
    other.close()


def test_the_bar_is_cut_to_the_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    stream, clock = FakeTerminal(), FakeClock()
    p = Progress("adapter " + "n" * 300, None, 0, logging.getLogger(LOGGER), stream=stream, clock=clock)
    clock.now_s += 0.5
    p.advance(MIB)
    p.close()
    assert all(len(draw) <= 39 for draw in stream.getvalue().rstrip("\n").split("\r"))
