"""Per-adapter and adapter-movement series of `/metrics`, every figure as the scheduler
folded it from its event log (scheduler_proc.views.adapter_stats), so /metrics and
`ledgerserve replay --show adapters` agree.

- `AdapterRowsCollector` reads, at each scrape, the latest row of every registered adapter
  (EngineStats sends a row when it changes) and the engine-level gauges: an adapter's
  series exist exactly while it has a row, which is while it is registered.
- `LoadMetrics` counts each AdapterLoadObserved (a slot load done on every rank) by source
  tier and observes its seconds, only for registered adapters; an unload removes its series.
- `vllm:lora_requests_info` is vLLM's gauge: one series whose labels name the adapters with
  running and waiting requests; its value is the time that label set was first seen.

Both keep series for at most `max_series` adapters (adapter_labels.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ledgerserve.shared.events import AdapterLoadObserved, AdapterRow, EngineStats
from ledgerserve.tokenizer_proc.adapter_labels import RecentAdapters, most_active

if TYPE_CHECKING:
    from ledgerserve.tokenizer_proc.engine_client import EngineClientBase

TIERS = ("gpu", "cpu", "disk")
LOAD_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LoadMetrics:
    def __init__(self, registry: CollectorRegistry, max_series: int = 32) -> None:
        self.loads = Counter(
            "ledgerserve_lora_loads",
            "adapter slot loads done on every rank, by where the bytes came from",
            ["adapter", "source_tier"],
            registry=registry,
        )
        self.load_seconds = Histogram(
            "ledgerserve_lora_load_seconds",
            "adapter slot load time (the slowest rank)",
            ["adapter"],
            buckets=LOAD_SECONDS_BUCKETS,
            registry=registry,
        )
        self._tiers: dict[str, list[str]] = {}  # adapter -> source tiers it has a series for
        self._recent = RecentAdapters(max_series)

    def on_load(self, load: AdapterLoadObserved, registered: set[str]) -> None:
        if load.name not in registered:
            return
        if (evicted := self._recent.touch(load.name)) is not None:
            self._remove(evicted)
        tiers = self._tiers.setdefault(load.name, [])
        if load.source_tier not in tiers:
            tiers.append(load.source_tier)
        self.loads.labels(load.name, load.source_tier).inc()
        self.load_seconds.labels(load.name).observe(load.duration_ms / 1000.0)

    def prune(self, registered: set[str]) -> None:
        """Remove the series of adapters no longer registered."""
        for name in sorted(set(self._tiers) - registered):
            self._recent.discard(name)
            self._remove(name)

    def _remove(self, name: str) -> None:
        for tier in self._tiers.pop(name):
            self.loads.remove(name, tier)
        self.load_seconds.remove(name)


class AdapterRowsCollector:
    """A prometheus collector over the engine's adapter rows and stats, read at each scrape."""

    def __init__(self, engine: EngineClientBase, max_loras: int, max_series: int = 32) -> None:
        self.engine = engine
        self.max_loras = max_loras
        self.max_series = max_series
        self._info_labels: tuple[str, str] | None = None
        self._info_time_s = 0.0

    def collect(self) -> Iterator[Metric]:
        rows = [self.engine.adapter_rows[name] for name in sorted(self.engine.adapter_rows)]
        yield from _row_families(most_active(rows, self.max_series))
        yield self._requests_info(rows)
        stats = self.engine.stats
        if stats is not None:
            yield from _engine_families(stats)

    def _requests_info(self, rows: list[AdapterRow]) -> Metric:
        labels = (",".join(r.name for r in rows if r.num_running), ",".join(r.name for r in rows if r.num_waiting))
        if labels != self._info_labels:
            self._info_labels, self._info_time_s = labels, time.time()
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "running and waiting LoRA adapters (the value: when this set was first seen)",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        family.add_metric([labels[0], labels[1], str(self.max_loras)], self._info_time_s)
        return family


def _row_families(rows: list[AdapterRow]) -> Iterator[Metric]:
    location = GaugeMetricFamily(
        "ledgerserve_lora_location", "1 for the tier an adapter's current version is in", labels=["adapter", "tier"]
    )
    gauges = {
        "pinned": GaugeMetricFamily("ledgerserve_lora_pinned", "1 if the adapter is pinned", labels=["adapter"]),
        "num_running": GaugeMetricFamily(
            "ledgerserve_lora_requests_running", "the adapter's running requests", labels=["adapter"]
        ),
        "num_waiting": GaugeMetricFamily(
            "ledgerserve_lora_requests_waiting", "the adapter's waiting requests", labels=["adapter"]
        ),
    }
    counters = {
        "num_prompt_tokens": CounterMetricFamily(
            "ledgerserve_lora_prompt_tokens", "prompt tokens of the adapter's finished requests", labels=["adapter"]
        ),
        "num_generated_tokens": CounterMetricFamily(
            "ledgerserve_lora_generation_tokens",
            "tokens generated for the adapter's finished requests",
            labels=["adapter"],
        ),
        "num_cached_tokens": CounterMetricFamily(
            "ledgerserve_lora_prefix_cache_hit_tokens",
            "the adapter's prompt tokens served from the prefix cache",
            labels=["adapter"],
        ),
    }
    for row in rows:
        for tier in TIERS:
            location.add_metric([row.name, tier], 1.0 if row.tier == tier else 0.0)
        for field, family in {**gauges, **counters}.items():
            family.add_metric([row.name], float(getattr(row, field)))
    yield location
    yield from gauges.values()
    yield from counters.values()


def _engine_families(stats: EngineStats) -> Iterator[Metric]:
    gauges = (
        (
            "ledgerserve_lora_slots_used",
            "adapter slots holding a version (loading, loaded or pinned)",
            stats.num_used_slots,
        ),
        ("ledgerserve_lora_loads_in_flight", "adapter slot loads not yet done on every rank", stats.num_loading_slots),
        ("ledgerserve_lora_cpu_tier_versions", "adapter versions in the CPU tier", stats.num_cpu_tier_versions),
        ("ledgerserve_lora_cpu_tier_bytes", "bytes of the adapter versions in the CPU tier", stats.cpu_tier_bytes),
    )
    for name, doc, value in gauges:
        yield GaugeMetricFamily(name, doc, value=float(value))
    yield CounterMetricFamily(
        "ledgerserve_lora_wait_steps",
        "steps that left a request waiting only on its adapter's load",
        value=float(stats.num_lora_wait_steps),
    )
    yield CounterMetricFamily(
        "ledgerserve_lora_wait_seconds",
        "adapter requests' waits for their adapter's load, summed (where the event log times them)",
        value=stats.lora_wait_ms / 1000.0,
    )
