"""Start-up load progress (model weights, adapters), as a single-line bar on a terminal or as
log lines elsewhere.

The lines are built by pure functions of (done, total, elapsed); `Progress` only decides when
to show them. Rank 0 with a terminal on stderr redraws a bar in place (carriage returns, at
most every BAR_INTERVAL_S, and one newline at the end; a load done before the first redraw
draws nothing); rank 0 without one logs a line at most every LOG_INTERVAL_S; other ranks show
nothing while loading. Every rank
logs the end line its caller formats (`weights_end_line`, `adapter_end_line`). Nothing goes to
stdout. One bar owns the terminal line at a time: a load that starts while another draws logs
its end line only.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from ledgerserve.shared.events import WorkerReady

BAR_INTERVAL_S = 0.1  # at most ten redraws a second
LOG_INTERVAL_S = 2.0
BAR_WIDTH = 20
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
_UNITS = ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB"))

BAR, LOG, QUIET = "bar", "log", "quiet"
_terminal_line = threading.Lock()  # held by the bar drawing on the terminal now


def unit_of(num_bytes: int) -> tuple[int, str]:
    """The largest unit that `num_bytes` reaches: (its size, its name); bytes below 1 KiB."""
    for size, name in _UNITS:
        if num_bytes >= size:
            return size, name
    return 1, "B"


def format_bytes(num_bytes: int) -> str:
    size, name = unit_of(num_bytes)
    return f"{num_bytes} B" if size == 1 else f"{num_bytes / size:.1f} {name}"


def format_pair(done: int, total: int) -> str:
    """'1.2 / 16.1 GiB': both in the total's unit."""
    size, name = unit_of(max(total, done))
    if size == 1:
        return f"{done} / {total} B"
    return f"{done / size:.1f} / {total / size:.1f} {name}"


def format_rate(num_bytes: int, elapsed_s: float) -> str:
    """'410 MiB/s', '2.1 GiB/s', '0.5 MiB/s'; '? MiB/s' before any time has passed."""
    if elapsed_s <= 0:
        return "? MiB/s"
    rate = num_bytes / elapsed_s
    if rate >= GIB:
        return f"{rate / GIB:.1f} GiB/s"
    return f"{rate / MIB:.1f} MiB/s" if rate < 10 * MIB else f"{rate / MIB:.0f} MiB/s"


def format_seconds(elapsed_s: float) -> str:
    """'3.1 s'; two decimals below 1 s."""
    return f"{elapsed_s:.2f} s" if elapsed_s < 1 else f"{elapsed_s:.1f} s"


def format_clock(seconds: float | None) -> str:
    """'0:03', '1:02:03'; '?' when unknown."""
    if seconds is None:
        return "?"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def percent(done: int, total: int) -> int:
    """Whole percent done, 100 for an empty load, never past 100."""
    return 100 if total <= 0 else min(100, done * 100 // total)


def eta_s(done: int, total: int | None, elapsed_s: float) -> float | None:
    """Seconds left at the rate so far; None while unknown (no total, no bytes or no time yet)."""
    if total is None or done <= 0 or elapsed_s <= 0:
        return None
    return max(0, total - done) * elapsed_s / done


def format_status(done: int, total: int | None, elapsed_s: float) -> str:
    """'1.2 / 16.1 GiB (7%) in 3.1 s, 410 MiB/s'; without a total '1.2 GiB in 3.1 s, 410 MiB/s'."""
    amount = format_bytes(done) if total is None else f"{format_pair(done, total)} ({percent(done, total)}%)"
    return f"{amount} in {format_seconds(elapsed_s)}, {format_rate(done, elapsed_s)}"


def format_bar(label: str, done: int, total: int | None, elapsed_s: float, width: int = BAR_WIDTH) -> str:
    """'worker-0 loading weights  7%|#   ...| 1.2 / 16.1 GiB [0:03<0:36, 410 MiB/s]'; without
    a total, no bar and no ETA."""
    rate = format_rate(done, elapsed_s)
    if total is None:
        return f"{label} {format_bytes(done)} [{format_clock(elapsed_s)}, {rate}]"
    pct = percent(done, total)
    filled = width * pct // 100
    bar = "#" * filled + " " * (width - filled)
    timing = f"{format_clock(elapsed_s)}<{format_clock(eta_s(done, total, elapsed_s))}, {rate}"
    return f"{label} {pct:3d}%|{bar}| {format_pair(done, total)} [{timing}]"


def weights_end_line(num_bytes: int, elapsed_s: float) -> str:
    return (
        f"loaded weights: {format_bytes(num_bytes)} in {format_seconds(elapsed_s)}, {format_rate(num_bytes, elapsed_s)}"
    )


def ready_line(ready: WorkerReady) -> str:
    """A worker rank's start-up facts, as the worker, the scheduler and replay show them; 0 weight
    bytes: not reported (a log written before ranks reported them)."""
    weights = f", {format_bytes(ready.num_weight_bytes)} of weights" if ready.num_weight_bytes else ""
    return f"{ready.num_kv_blocks} KV blocks{weights} on {ready.device} ({ready.dtype})"


def adapter_end_line(name: str, num_bytes: int, elapsed_s: float) -> str:
    return f"loaded adapter {name} ({format_bytes(num_bytes)}) in {format_seconds(elapsed_s)}"


def progress_mode(rank: int, is_tty: bool) -> str:
    """BAR on rank 0 with a terminal, LOG on rank 0 without one, QUIET on the other ranks."""
    if rank != 0:
        return QUIET
    return BAR if is_tty else LOG


def is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class Progress:
    """One load's progress: `advance` as bytes arrive, `close` once done (or failed)."""

    def __init__(
        self,
        what: str,
        total_bytes: int | None,
        rank: int,
        log: logging.Logger,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`what`: 'weights', 'adapter NAME'; `stream`: stderr unless given."""
        self.what, self.total, self.log, self.clock = what, total_bytes, log, clock
        self.stream = sys.stderr if stream is None else stream
        self.label = f"worker-{rank} loading {what}"
        self.mode = progress_mode(rank, is_tty(self.stream))
        self.done = 0
        self.start_s = self.last_s = clock()
        self.owns_line = False  # the bar holds the terminal line (it has drawn)
        self.width = 0  # of the last bar drawn

    def announce(self, detail: str) -> None:
        """Log the load's start ('loading weights: 16.1 GiB in 4 files') where no bar shows it (LOG mode)."""
        if self.mode == LOG:
            self.log.info("loading %s: %s", self.what, detail)

    def set_total(self, total_bytes: int) -> None:
        self.total = total_bytes

    def advance(self, num_bytes: int) -> None:
        self.done += num_bytes
        now = self.clock()
        if self.mode == BAR and now - self.last_s >= BAR_INTERVAL_S:
            self._draw(now)
        elif self.mode == LOG and now - self.last_s >= LOG_INTERVAL_S:
            self.last_s = now
            self.log.info("loaded %s: %s", self.what, format_status(self.done, self.total, now - self.start_s))

    def close(self) -> float:
        """End the bar (its final state, then one newline) if it drew; the seconds since the start."""
        now = self.clock()
        if self.owns_line:
            self._draw(now)
            self._write("\n")
            self._release()
        return now - self.start_s

    def _draw(self, now: float) -> None:
        self.last_s = now
        if not self.owns_line:
            if not _terminal_line.acquire(blocking=False):
                self.mode = QUIET  # another bar holds the line: this load shows its end line only
                return
            self.owns_line = True
        columns = shutil.get_terminal_size((100, 24)).columns - 1
        line = format_bar(self.label, self.done, self.total, now - self.start_s)[:columns]
        self._write("\r" + line.ljust(self.width))
        self.width = len(line)

    def _write(self, text: str) -> None:
        """A terminal gone (closed, hung up) ends the bar, never the load."""
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self.mode = QUIET
            self._release()

    def _release(self) -> None:
        if self.owns_line:
            self.owns_line = False
            _terminal_line.release()
