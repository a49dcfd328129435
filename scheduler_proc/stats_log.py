"""The scheduler's periodic stats line, as vLLM logs one every 10 s:

    engine: prompt throughput: 182.4 tokens/s, generation throughput: 96.0 tokens/s, running: 3 reqs,
    waiting: 12 reqs, KV cache usage: 41.2%, prefix cache hit rate: 35.0%, adapters: 2/8 GPU slots,
    5 in CPU tier, 1 loading

An interval opens at the first input that finds the engine busy (requests running or waiting) and
gets its line `interval_s` later, busy or idle by then; the next opens when the engine is next busy.
So a steady load gets a line every `interval_s`, a light one with idle gaps between its requests
no more (not a line per request), and the last activity's line comes at most `interval_s` after it
(or at shutdown); nothing while idle. Throughputs and the hit rate are over the line's interval: a request's prompt
tokens count when its first token comes out (the whole prompt, cached tokens included, as vLLM
counts them), its generated tokens as they come out. The shell feeds it after each input with the
core's decisions, the EngineStats it published and the time on its clock, and `tick`s it while it
waits for input; nothing here reads a clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ledgerserve.shared import events as ev

log = logging.getLogger("scheduler")

INTERVAL_S = 10.0


@dataclass
class Interval:
    """What came out since the last line."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0


class StatsLog:
    def __init__(self, max_loras: int, interval_s: float = INTERVAL_S, emit: Callable[[str], None] = log.info) -> None:
        self.max_loras = max_loras  # 0: LoRA off, no adapter figures
        self.interval_s = interval_s
        self.emit = emit
        self.started_s: float | None = None  # the open interval's start; None: none open
        self.stats: ev.EngineStats | None = None  # the latest the core published
        self.interval = Interval()
        self.emitting: set[str] = set()  # requests whose first token came out and that have not finished

    def record(self, decisions: Iterable[ev.Event], stats: ev.EngineStats | None, now_s: float) -> None:
        """After one input: count its emitted tokens; open an interval if the engine is busy, and
        log the open one's line if it is over."""
        for decision in decisions:
            if isinstance(decision, ev.TokensEmitted):
                self._count(decision)
        if stats is None:
            return
        self.stats = stats
        if self.started_s is None and stats.num_running + stats.num_waiting > 0:
            self.started_s = now_s
        self.tick(now_s)

    def tick(self, now_s: float) -> None:
        """Log the open interval's line if `interval_s` have passed since it opened."""
        if self.started_s is not None and now_s - self.started_s >= self.interval_s:
            self.flush(now_s)

    def flush(self, now_s: float) -> None:
        """Log the open interval's line now, if one is open (the tick that found it due, or shutdown)."""
        if self.started_s is None or self.stats is None:
            return
        self.emit(stats_line(self.stats, self.interval, now_s - self.started_s, self.max_loras))
        self.interval = Interval()
        busy = self.stats.num_running + self.stats.num_waiting > 0
        self.started_s = now_s if busy else None

    def _count(self, emitted: ev.TokensEmitted) -> None:
        self.interval.num_generation_tokens += len(emitted.new_token_ids)
        if emitted.new_token_ids and emitted.req_id not in self.emitting:
            self.interval.num_prompt_tokens += emitted.num_prompt_tokens
            self.interval.num_cached_tokens += emitted.num_cached_tokens
            self.emitting.add(emitted.req_id)
        if emitted.finish_reason is not None:
            self.emitting.discard(emitted.req_id)


def stats_line(stats: ev.EngineStats, interval: Interval, elapsed_s: float, max_loras: int) -> str:
    per_s = 1.0 / elapsed_s if elapsed_s > 0 else 0.0
    used_blocks = stats.num_total_blocks - stats.num_available_blocks
    kv_usage = 100.0 * used_blocks / stats.num_total_blocks if stats.num_total_blocks else 0.0
    hit_rate = 100.0 * interval.num_cached_tokens / interval.num_prompt_tokens if interval.num_prompt_tokens else 0.0
    parts = [
        f"prompt throughput: {interval.num_prompt_tokens * per_s:.1f} tokens/s",
        f"generation throughput: {interval.num_generation_tokens * per_s:.1f} tokens/s",
        f"running: {stats.num_running} reqs",
        f"waiting: {stats.num_waiting} reqs",
        f"KV cache usage: {kv_usage:.1f}%",
        f"prefix cache hit rate: {hit_rate:.1f}%",
    ]
    if max_loras:
        parts.append(
            f"adapters: {stats.num_used_slots}/{max_loras} GPU slots, {stats.num_cpu_tier_versions} in CPU tier, "
            f"{stats.num_loading_slots} loading"
        )
    return "engine: " + ", ".join(parts)
