"""vLLM's `/metrics` series (`vllm:*`), so vLLM's Grafana dashboard and adapter-aware routers read
ledgerserve as they read vLLM. Every series carries `model_name`: the first served model name,
for base and adapter requests alike (vLLM labels by the engine's model, never by an adapter).

- Request series come from `RequestTrace`s (tokenizer_proc.request_trace): counted per engine
  request, so a request with `n` choices counts n requests, each with its prompt, as vLLM's
  child requests do. Prompt tokens and prefix-cache queries and hits count when a request's
  first token arrives (its prompt was processed), generation tokens as they arrive.
- Gauges are read at each scrape from the scheduler's latest EngineStats.

Bucket boundaries are vLLM's (v1)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from ledgerserve.shared.events import EngineStats
from ledgerserve.tokenizer_proc.request_trace import RequestTrace

if TYPE_CHECKING:
    from ledgerserve.tokenizer_proc.engine_client import EngineClientBase

FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TTFT_BUCKETS_S += (20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TOKEN_GAP_BUCKETS_S += (20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
REQUEST_BUCKETS_S += (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_HELP = "time from arrival to the hand-off to the scheduler (queued in the HTTP process)"
PREFILL_HELP = (
    "time from the hand-off to the scheduler to the first token: the scheduler's queue and the prefill "
    "(the HTTP process does not see a request's first scheduling)"
)


def served_model_label(served_model_name: str | Sequence[str]) -> str:
    """The `model_name` label: the first served model name."""
    return served_model_name if isinstance(served_model_name, str) else served_model_name[0]


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return out
            out.append(mantissa * scale)
        scale *= 10


class VllmRequestMetrics:
    """The request counters and histograms; a RequestObserver of every engine request."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=registry).labels(model_name)

        token_buckets = buckets_1_2_5(max_model_len)
        self.prompt_tokens = counter("vllm:prompt_tokens", "prompt tokens processed")
        self.generation_tokens = counter("vllm:generation_tokens", "tokens generated")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "prompt tokens served from the prefix cache")
        self.model_name = model_name
        self.success = Counter(
            "vllm:request_success", "finished requests", ["model_name", "finished_reason"], registry=registry
        )
        for reason in FINISH_REASONS:  # every series from the start, as vLLM has them
            self.success.labels(model_name, reason)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "time to first token", TTFT_BUCKETS_S)
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds", "time between a request's outputs", TOKEN_GAP_BUCKETS_S
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "time between a request's outputs", TOKEN_GAP_BUCKETS_S
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "arrival to end", REQUEST_BUCKETS_S)
        self.queue = histogram("vllm:request_queue_time_seconds", QUEUE_HELP, REQUEST_BUCKETS_S)
        self.prefill = histogram("vllm:request_prefill_time_seconds", PREFILL_HELP, REQUEST_BUCKETS_S)
        self.decode = histogram("vllm:request_decode_time_seconds", "first token to last token", REQUEST_BUCKETS_S)
        self.inference = histogram(
            "vllm:request_inference_time_seconds", "prefill time plus decode time", REQUEST_BUCKETS_S
        )
        self.request_prompt = histogram("vllm:request_prompt_tokens", "prompt tokens per request", token_buckets)
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "generated tokens per request", token_buckets
        )
        self.max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "generated tokens per engine request (one choice; a request of n choices counts n)",
            token_buckets,
        )

    def on_first_token(self, trace: RequestTrace) -> None:
        self.prompt_tokens.inc(trace.num_prompt_tokens)
        self.ttft.observe(trace.ttft_s())
        if trace.arrived.sampling.prompt_logprobs is None:  # such a request never reads the cache (as in vLLM)
            self.prefix_queries.inc(trace.num_prompt_tokens)
            self.prefix_hits.inc(trace.num_cached_tokens)

    def on_tokens(self, trace: RequestTrace, num_tokens: int, gap_s: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if gap_s is not None:
            self.tpot.observe(gap_s)
            self.itl.observe(gap_s)

    def on_finished(self, trace: RequestTrace) -> None:
        self.success.labels(self.model_name, trace.finish_reason or "abort").inc()
        self.e2e.observe(trace.e2e_s())
        self.queue.observe(trace.queue_s())
        self.prefill.observe(trace.prefill_s())
        self.decode.observe(trace.decode_s())
        self.inference.observe(trace.prefill_s() + trace.decode_s())
        self.request_prompt.observe(trace.num_prompt_tokens)
        self.request_generation.observe(trace.num_generation_tokens)
        self.max_generation.observe(trace.num_generation_tokens)


class VllmGaugesCollector:
    """vLLM's scheduler gauges, read from the engine's latest EngineStats at each scrape (0 before
    the first). Nothing is swapped to the CPU here, so the swapped and CPU-cache gauges are 0."""

    def __init__(self, engine: EngineClientBase, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        usage = kv_cache_usage(stats) if stats is not None else 0.0
        gauges = (
            ("vllm:num_requests_running", "requests running", stats.num_running if stats is not None else 0),
            ("vllm:num_requests_waiting", "requests waiting", stats.num_waiting if stats is not None else 0),
            ("vllm:num_requests_swapped", "requests swapped to the CPU (none: preempted requests recompute)", 0),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1 (1: every block held by a request)", usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage, 0..1 (as vllm:kv_cache_usage_perc)", usage),
            ("vllm:cpu_cache_usage_perc", "CPU KV-cache usage (no CPU KV cache here)", 0),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family


def kv_cache_usage(stats: EngineStats) -> float:
    """The share of KV blocks requests hold; cached blocks no request holds count as free (as in vLLM)."""
    if stats.num_total_blocks <= 0:
        return 0.0
    num_available = max(stats.num_free_blocks, stats.num_available_blocks)
    return 1.0 - num_available / stats.num_total_blocks
