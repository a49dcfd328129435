"""`/metrics` in the Prometheus text format: the scheduler's gauges as last reported in
EngineStats, plus this process's own counters.

Counters labelled by an adapter's name exist only while that adapter is registered: the
registry's changes come in AdapterRegistryChanged, and an adapter that left it loses its series.
A request that ends after its adapter was unloaded is not counted, so a name that is no
longer registered never gets a series again; and at most `max_adapter_series` adapters have
series at once (adapter_labels.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from ledgerserve.shared.events import AdapterInfo, AdapterLoadObserved, RequestArrived, TokensEmitted
from ledgerserve.tokenizer_proc.adapter_labels import RecentAdapters
from ledgerserve.tokenizer_proc.adapter_metrics import AdapterRowsCollector, LoadMetrics
from ledgerserve.tokenizer_proc.vllm_metrics import VllmGaugesCollector, VllmRequestMetrics

if TYPE_CHECKING:
    from ledgerserve.tokenizer_proc.engine_client import EngineClientBase

__all__ = ["BASE_LABEL", "CONTENT_TYPE_LATEST", "Metrics"]

BASE_LABEL = "base"  # the `namespace` label of base-model requests


class Metrics:
    def __init__(
        self,
        engine: EngineClientBase | None = None,
        max_loras: int = 0,
        model_name: str = "",
        max_model_len: int = 1,
        max_adapter_series: int = 32,
    ) -> None:
        """`engine`: whose adapter rows and stats the adapter and vLLM gauges read at each scrape;
        `model_name`: the `model_name` label of the `vllm:` series (the first served model name);
        `max_adapter_series`: the most adapters with series of their own in each family."""
        self.registry = CollectorRegistry()
        self.vllm = VllmRequestMetrics(self.registry, model_name, max_model_len)  # observes every engine request
        gauge = lambda name, doc: Gauge(name, doc, registry=self.registry)  # noqa: E731
        self.running = gauge("ledgerserve_num_requests_running", "requests the scheduler is running")
        self.waiting = gauge("ledgerserve_num_requests_waiting", "requests waiting in the scheduler")
        self.blocks_free = gauge("ledgerserve_kv_blocks_free", "free KV blocks")
        self.blocks_cached = gauge("ledgerserve_kv_blocks_cached", "KV blocks held by the prefix cache")
        self.blocks_total = gauge("ledgerserve_kv_blocks_total", "KV blocks in the pool")
        self.pinned_slots = gauge("ledgerserve_lora_pinned_slots", "adapter slots pinned by running requests")
        self.deferred = gauge("ledgerserve_lora_deferred_evictions", "adapter evictions waiting for requests to end")
        self.step = gauge("ledgerserve_engine_step", "last step the scheduler reported")
        self.in_flight = gauge("ledgerserve_http_requests_in_flight", "requests this HTTP process is serving")
        self.bad_frames = gauge("ledgerserve_ipc_frames_dropped", "undecodable IPC frames dropped")
        self.healthy = gauge("ledgerserve_engine_healthy", "1 when the engine is up and ready")
        counter = lambda name, doc: Counter(name, doc, ["namespace"], registry=self.registry)  # noqa: E731
        self.prompt_tokens = counter("ledgerserve_prompt_tokens", "prompt tokens of finished requests")
        self.prefix_hit_tokens = counter(
            "ledgerserve_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache"
        )
        self._by_namespace = (self.prompt_tokens, self.prefix_hit_tokens)
        self._registered: set[str] = set()  # adapter names, as the core last reported them
        self._labelled = RecentAdapters(max_adapter_series)  # adapter names that have series
        self.adapter_loads = LoadMetrics(self.registry, max_adapter_series)
        if engine is not None:
            self.registry.register(AdapterRowsCollector(engine, max_loras, max_adapter_series))
            self.registry.register(VllmGaugesCollector(engine, model_name))

    def on_adapters(self, adapters: list[AdapterInfo]) -> None:
        """The core's registry after an adapter op: drop the series of adapters not in it."""
        self._registered = {adapter.name for adapter in adapters}
        for name in sorted(self._labelled.names() - self._registered):
            self._labelled.discard(name)
            self._remove_series(name)
        self.adapter_loads.prune(self._registered)

    def _remove_series(self, name: str) -> None:
        for counter in self._by_namespace:
            counter.remove(name)

    def on_load(self, load: AdapterLoadObserved) -> None:
        self.adapter_loads.on_load(load, self._registered)

    def on_finished(self, arrived: RequestArrived, last: TokensEmitted) -> None:
        """Count a finished request under its namespace: `base`, or the adapter's name while
        that adapter is registered (not at all once it was unloaded)."""
        namespace = arrived.lora_name or BASE_LABEL
        if arrived.lora_name is not None and namespace != BASE_LABEL:
            if namespace not in self._registered:
                return
            if (evicted := self._labelled.touch(namespace)) is not None:
                self._remove_series(evicted)
        self.prompt_tokens.labels(namespace).inc(len(arrived.prompt_token_ids))
        self.prefix_hit_tokens.labels(namespace).inc(last.num_cached_tokens)

    def render(self, engine) -> bytes:
        stats = engine.stats
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.blocks_free.set(stats.num_free_blocks)
            self.blocks_total.set(stats.num_total_blocks)
            self.blocks_cached.set(stats.num_cached_blocks)
            self.step.set(stats.step)
            self.pinned_slots.set(stats.num_pinned_slots)
            self.deferred.set(stats.num_deferred_evictions)
        self.in_flight.set(engine.num_in_flight)
        self.bad_frames.set(engine.num_bad_frames)
        self.healthy.set(1 if engine.is_healthy and engine.is_ready else 0)
        return generate_latest(self.registry)
