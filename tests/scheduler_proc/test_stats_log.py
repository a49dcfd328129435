"""The scheduler's periodic stats line (scheduler_proc/stats_log.py), on a fake clock: a line every
interval while busy, one last line when the engine goes idle, nothing while idle; its figures
checked against hand-made stats, and against the real core driven through a workload."""

from __future__ import annotations

from typing import Any

from ledgerserve.scheduler_proc.stats_log import StatsLog
from ledgerserve.scheduler_proc.views.engine_stats import engine_stats
from ledgerserve.shared import events as ev
from tests.scheduler_proc.driver import Driver


def _stats(num_running: int, num_waiting: int = 0, **kw: Any) -> ev.EngineStats:
    kw.setdefault("num_total_blocks", 0)
    return ev.EngineStats(step=0, num_running=num_running, num_waiting=num_waiting, num_free_blocks=0, **kw)


def _tokens(req_id: str, num_new: int, num_prompt: int = 0, num_cached: int = 0, finish: str | None = None):
    return ev.TokensEmitted(req_id, list(range(num_new)), finish, None, num_prompt, num_cached)


def test_a_line_every_interval_while_busy_the_last_after_idle_then_none() -> None:
    lines: list[str] = []
    stats_log = StatsLog(max_loras=0, interval_s=10.0, emit=lines.append)
    stats_log.record([], _stats(0, num_total_blocks=100), now_s=0.0)  # idle: nothing opens
    stats_log.record([], _stats(0, 1, num_total_blocks=100), now_s=1.0)  # a request waits: the interval opens
    stats_log.record([_tokens("a", 1, num_prompt=40, num_cached=10)], _stats(1, num_total_blocks=100), now_s=4.0)
    stats_log.record([_tokens("a", 1)], _stats(1, num_total_blocks=100), now_s=9.0)
    stats_log.tick(10.9)
    assert lines == []
    busy = _stats(1, 2, num_total_blocks=100, num_available_blocks=75)
    stats_log.record([_tokens("a", 2), _tokens("b", 1, num_prompt=20)], busy, now_s=11.0)
    assert lines == [
        "engine: prompt throughput: 6.0 tokens/s, generation throughput: 0.5 tokens/s, running: 1 reqs, "
        "waiting: 2 reqs, KV cache usage: 25.0%, prefix cache hit rate: 16.7%"
    ]
    stats_log.record([_tokens("a", 3)], _stats(1, 1, num_total_blocks=100), now_s=15.0)  # mid-interval: quiet
    idle = _stats(0, num_total_blocks=100, num_available_blocks=100)
    stats_log.record([_tokens("b", 3, finish="stop")], idle, now_s=16.0)  # idle: its line comes when due
    stats_log.tick(20.9)
    assert len(lines) == 1
    stats_log.tick(21.0)
    assert len(lines) == 2
    assert lines[1].startswith("engine: prompt throughput: 0.0 tokens/s, generation throughput: 0.6 tokens/s, ")
    assert "running: 0 reqs, waiting: 0 reqs, KV cache usage: 0.0%, prefix cache hit rate: 0.0%" in lines[1]
    for now_s in (30.0, 100.0, 1000.0):  # idle inputs (a /metrics scrape, an adapter load) and ticks: nothing
        stats_log.record([], idle, now_s=now_s)
        stats_log.tick(now_s + 50.0)
    assert len(lines) == 2


def test_a_light_load_gets_a_line_per_interval_not_per_request() -> None:
    lines: list[str] = []
    stats_log = StatsLog(max_loras=0, interval_s=10.0, emit=lines.append)
    idle = _stats(0, num_total_blocks=100)
    for i in range(20):  # a request every second, each done well before the next arrives
        start = float(i)
        stats_log.record([], _stats(0, 1, num_total_blocks=100), now_s=start)
        stats_log.record([_tokens(f"r{i}", 4, num_prompt=8, finish="length")], idle, now_s=start + 0.2)
        stats_log.tick(start + 0.5)
    assert len(lines) == 1  # at 10.0: the interval opened at 0.0
    assert lines[0].startswith("engine: prompt throughput: 8.0 tokens/s, generation throughput: 4.0 tokens/s")
    stats_log.tick(25.0)  # the second interval (opened at 10.0) ends idle
    assert len(lines) == 2


def test_prompt_tokens_count_once_per_request_at_its_first_token() -> None:
    lines: list[str] = []
    stats_log = StatsLog(max_loras=0, interval_s=10.0, emit=lines.append)
    stats_log.record([], _stats(0, 2), now_s=0.0)
    stats_log.record([_tokens("a", 0, num_prompt=50, finish="abort")], _stats(0, 1), now_s=1.0)  # never ran
    stats_log.record([_tokens("b", 1, num_prompt=30)], _stats(1), now_s=2.0)
    stats_log.record([_tokens("b", 1, num_prompt=30)], _stats(1), now_s=3.0)  # after a preemption: still b
    stats_log.record([_tokens("b", 1, num_prompt=30, finish="length")], _stats(0), now_s=5.0)
    stats_log.tick(10.0)
    assert lines == [
        "engine: prompt throughput: 3.0 tokens/s, generation throughput: 0.3 tokens/s, running: 0 reqs, "
        "waiting: 0 reqs, KV cache usage: 0.0%, prefix cache hit rate: 0.0%"
    ]


def test_adapter_figures_when_lora_is_on() -> None:
    lines: list[str] = []
    stats_log = StatsLog(max_loras=8, interval_s=10.0, emit=lines.append)
    stats_log.record([], _stats(1), now_s=0.0)
    stats_log.record([], _stats(0, num_used_slots=3, num_cpu_tier_versions=5, num_loading_slots=1), now_s=2.0)
    stats_log.tick(10.0)
    assert lines[0].endswith(", adapters: 3/8 GPU slots, 5 in CPU tier, 1 loading")


def test_figures_from_the_real_core() -> None:
    """Two requests through the core, one input a second: the line counts their prompts once and
    every token they generated, over its interval (from the first arrival)."""
    lines: list[str] = []
    stats_log = StatsLog(max_loras=0, interval_s=100.0, emit=lines.append)
    d = Driver(num_kv_blocks=32)
    times: list[float] = []
    send = d.send

    def send_and_log(event: Any) -> list[Any]:
        decisions = send(event)
        times.append(float(len(times)))  # one second an input
        stats_log.record(decisions, engine_stats(d.core), times[-1])
        return decisions

    d.send = send_and_log  # type: ignore[method-assign]
    d.arrive("a", 9, max_tokens=3)
    d.arrive("b", list(range(300, 305)), max_tokens=4)
    d.run()
    assert not lines and len(times) > 4
    stats_log.tick(times[0] + 100.0)
    assert len(lines) == 1
    elapsed_s = 100.0  # the interval, from the first arrival
    prompt, generated = (9 + 5) / elapsed_s, (3 + 4) / elapsed_s
    assert lines[0].startswith(
        f"engine: prompt throughput: {prompt:.1f} tokens/s, generation throughput: {generated:.1f} tokens/s, "
        "running: 0 reqs, waiting: 0 reqs, KV cache usage: "
    )


def test_the_shell_feeds_it_after_each_input(tmp_path, monkeypatch) -> None:
    """SchedulerShell.handle: the decisions, the stats it published and its clock's time."""
    from ledgerserve.scheduler_proc import loop
    from tests.scheduler_proc.test_log_writes import drive, make_shell

    lines: list[str] = []
    shell = make_shell(tmp_path)
    shell.stats_log = StatsLog(max_loras=0, emit=lines.append)
    seconds = iter(range(10_000))
    monkeypatch.setattr(loop.time, "monotonic", lambda: float(next(seconds)))
    drive(shell, num_reqs=3)
    shell.log.close()
    shell.stats_log.tick(10_000.0)  # the loop ticks it between inputs
    assert lines and all(line.startswith("engine: prompt throughput: ") for line in lines)
    assert lines[-1].endswith("running: 0 reqs, waiting: 0 reqs, KV cache usage: 0.0%, prefix cache hit rate: 0.0%")


def test_shutdown_flushes_the_open_interval() -> None:
    lines: list[str] = []
    stats_log = StatsLog(max_loras=0, interval_s=10.0, emit=lines.append)
    stats_log.record([], _stats(0, 1), now_s=1.0)
    stats_log.record([_tokens("a", 6, num_prompt=12, finish="length")], _stats(0), now_s=2.0)
    stats_log.flush(4.0)
    assert lines == [
        "engine: prompt throughput: 4.0 tokens/s, generation throughput: 2.0 tokens/s, running: 0 reqs, "
        "waiting: 0 reqs, KV cache usage: 0.0%, prefix cache hit rate: 0.0%"
    ]
    stats_log.flush(5.0)  # nothing open any more
    assert len(lines) == 1
