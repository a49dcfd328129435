"""bench_adapter_churn's one-at-a-time probe: TTFT of single requests, nothing else in flight,
with the adapter in a known tier.

Per repetition, with a fresh adapter F (never registered before) and `others` registered
first (as many as the server's CPU tier holds):
- base: a base-model request;
- disk_at_registration: F is registered, then requested at once (its bytes are still on disk,
  or on their way into the CPU tier);
- warm: F again (resident in a GPU slot);
- cpu_tier: after one request to each of `num_slots` others (the LRU slot, F's, was reused),
  F again: evicted from its slot, still in the CPU tier;
- disk_after_cpu_eviction: after one request to each of `num_cpu_loras` others (the CPU tier
  now holds only them), F again: read from disk.
F is unloaded after its repetition. Every request has a fresh random prompt (no prefix-cache
hit) and one output token; the requests that only move adapters use short prompts. The
event log's load records (churn_report.load_stats) show which tier each load came from.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import httpx

from scripts.adapters.churn_plan import PROBE_CASES
from scripts.serving.bench_serving import load_adapters, send_request, unload_adapters
from scripts.serving.serving_workload import AdapterSpec, PlannedRequest, random_prompt, request_body


class Prompts:
    """Fresh random prompts of the tokenizer's vocabulary, from a seed."""

    def __init__(self, seed: int, vocab_size: int, avoid: set[int]) -> None:
        self.rng = random.Random(f"{seed}-probe")
        self.vocab_size = vocab_size
        self.avoid = avoid

    def next(self, num_tokens: int) -> list[int]:
        return random_prompt(self.rng, num_tokens, self.vocab_size, self.avoid)


async def ttft_ms(client: httpx.AsyncClient, model: str, prompt: list[int]) -> float:
    """TTFT of one streamed request for one token; RuntimeError if it does not succeed."""
    result = await send_request(client, PlannedRequest(0, 0.0, None, prompt), request_body(model, prompt, 1))
    if result.status != 200 or result.ttft_ms is None:
        raise RuntimeError(f"probe request to {model} failed: status {result.status}: {result.detail}")
    return result.ttft_ms


async def touch(client: httpx.AsyncClient, names: Sequence[str], prompts: Prompts, num_tokens: int) -> None:
    """One request to each adapter in turn: each becomes the most recently used."""
    for name in names:
        await ttft_ms(client, name, prompts.next(num_tokens))


async def one_repetition(
    client: httpx.AsyncClient,
    base_model: str,
    fresh: AdapterSpec,
    others: Sequence[str],
    num_slots: int,
    prompts: Prompts,
    input_len: int,
    touch_len: int,
) -> dict[str, float]:
    sample = {"base": await ttft_ms(client, base_model, prompts.next(input_len))}
    loaded: list[str] = []
    start_s = time.perf_counter()
    await load_adapters(client, [fresh], loaded)
    sample["register_ms"] = (time.perf_counter() - start_s) * 1e3
    try:
        sample["disk_at_registration"] = await ttft_ms(client, fresh.name, prompts.next(input_len))
        sample["warm"] = await ttft_ms(client, fresh.name, prompts.next(input_len))
        await touch(client, others[:num_slots], prompts, touch_len)
        sample["cpu_tier"] = await ttft_ms(client, fresh.name, prompts.next(input_len))
        await touch(client, others, prompts, touch_len)
        sample["disk_after_cpu_eviction"] = await ttft_ms(client, fresh.name, prompts.next(input_len))
    finally:
        failures = await unload_adapters(client, loaded)
    if failures:
        raise RuntimeError(f"probe: unloading {fresh.name} failed: {failures}")
    return sample


async def run_probe(
    client: httpx.AsyncClient,
    base_model: str,
    fresh: Sequence[AdapterSpec],
    others: Sequence[AdapterSpec],
    num_slots: int,
    prompts: Prompts,
    input_len: int,
    touch_len: int,
) -> dict[str, Any]:
    """`len(fresh)` repetitions; `others` (registered here, unloaded at the end) must be at
    least as many as the server's CPU tier holds."""
    loaded: list[str] = []
    samples = []
    try:
        await load_adapters(client, others, loaded)
        names = [o.name for o in others]
        await touch(client, names, prompts, touch_len)  # every other adapter has been used once
        for spec in fresh:
            samples.append(
                await one_repetition(client, base_model, spec, names, num_slots, prompts, input_len, touch_len)
            )
    finally:
        await unload_adapters(client, loaded)
    return summarize_probe(samples)


def summarize_probe(samples: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Median and every value (ms) of each case, and of the registration call."""
    keys = (*PROBE_CASES, "register_ms")
    return {
        "num_repetitions": len(samples),
        "median_ms": {key: round(statistics.median(s[key] for s in samples), 3) if samples else None for key in keys},
        "values_ms": {key: [round(s[key], 3) for s in samples] for key in keys},
    }
