"""vLLM's `/metrics` names over the in-process app (the real core, a fake runner) with the real
`openai` client: a scripted workload (completions and chats, streaming and not, one ended by a
stop string, the rest by length, one on an adapter, one aborted by its client), then every `vllm:`
figure is checked against what the requests did (their `usage`, their finish reasons), and the
gauges against the core's own state."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ledgerserve.scheduler_proc.views.engine_stats import engine_stats
from tests.peft_util import make_tiny_peft_adapter
from tests.tokenizer_proc.app_client import MODEL, app_client
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio

# every name vLLM's published Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries
DASHBOARD_NAMES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_swapped",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
NEWER_NAMES = (
    "vllm:kv_cache_usage_perc",
    "vllm:inter_token_latency_seconds_count",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_inference_time_seconds_count",
    "vllm:lora_requests_info",
)
PER_REQUEST = (  # histograms observed once per finished request
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
)
LONG_PROMPT = [7 + i % 50 for i in range(40)]  # over two 16-token blocks: its repeat reads the prefix cache
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def adapter_dir(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vllm-metrics-loras")
    make_tiny_peft_adapter(demo_model_dir, root / "sql", seed=1)
    return root


@pytest.fixture
async def http(engine, tokenizer, demo_model_dir: str, adapter_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(
        engine, tokenizer, demo_model_dir, enable_lora=True, lora_allowed_dirs=(str(adapter_dir),)
    ) as c:
        yield c


@pytest.fixture
async def oai(http: httpx.AsyncClient) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0) as client:
        yield client


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, for every sample of /metrics."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


async def _scrape(http: httpx.AsyncClient) -> dict:
    response = await http.get("/metrics")
    assert response.status_code == 200
    return _samples(response.text)


async def _workload(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, engine: FakeEngine, tokenizer, adapter_dir: Path
) -> list:
    """The requests that end; returns (usage, finish_reason) of each."""
    done = []
    plain = await client.completions.create(model=MODEL, prompt="The river", max_tokens=3)
    done.append((plain.usage, plain.choices[0].finish_reason))
    for _ in range(2):  # the same long prompt twice: the second's prefix comes from the cache
        cached = await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
        done.append((cached.usage, cached.choices[0].finish_reason))
    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    done.append((chat.usage, chat.choices[0].finish_reason))
    done.append(await _streamed(client.completions.create, prompt="a b c", max_tokens=5))
    done.append(await _streamed(client.chat.completions.create, messages=MESSAGES, max_tokens=3))
    engine.script = tokenizer.encode("alpha beta gamma delta epsilon")
    stopped = await client.completions.create(model=MODEL, prompt="x", max_tokens=20, stop=["gamma"])
    done.append((stopped.usage, stopped.choices[0].finish_reason))
    engine.script = None
    loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter_dir / "sql")})
    assert loaded.status_code == 200, loaded.text
    on_adapter = await client.completions.create(model="sql", prompt="select", max_tokens=4)
    done.append((on_adapter.usage, on_adapter.choices[0].finish_reason))
    return done


async def _streamed(create, **kwargs) -> tuple:
    stream = await create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs)
    reasons, usage = [], None
    async for chunk in stream:
        reasons += [c.finish_reason for c in chunk.choices if c.finish_reason is not None]
        usage = chunk.usage or usage
    return usage, reasons[-1]


async def _abort_held(client: openai.AsyncOpenAI, http: httpx.AsyncClient, engine: FakeEngine) -> tuple[int, dict]:
    """A request the engine holds (admitted, no token yet) whose client goes away: returns its
    prompt length and the scrape taken while it was in the engine, with the core's gauges."""
    engine.hold = asyncio.Event()
    task = asyncio.ensure_future(client.completions.create(model=MODEL, prompt=LONG_PROMPT[:9], max_tokens=5))
    core = engine.engine.core
    while not (core.scheduler.running or core.scheduler.waiting):
        await asyncio.sleep(0.001)
    stats = engine_stats(core)
    engine._dispatch(stats)  # what the scheduler's shell publishes after each input
    held = await _scrape(http)
    blocks = core.scheduler.block_manager
    assert _value(held, "vllm:num_requests_running") == len(core.scheduler.running) == stats.num_running
    assert _value(held, "vllm:num_requests_waiting") == len(core.scheduler.waiting) == stats.num_waiting
    usage = 1.0 - blocks.num_available_blocks / blocks.num_total_blocks
    assert 0.0 < usage < 1.0
    assert _value(held, "vllm:kv_cache_usage_perc") == pytest.approx(usage)
    assert _value(held, "vllm:gpu_cache_usage_perc") == pytest.approx(usage)
    assert _value(held, "vllm:cpu_cache_usage_perc") == _value(held, "vllm:num_requests_swapped") == 0.0
    task.cancel()  # the client goes away
    with pytest.raises(asyncio.CancelledError):
        await task
    engine.hold.set()
    return len(engine.arrivals[-1].prompt_token_ids), held


async def test_vllm_series_equal_what_the_requests_did(oai, http, engine, tokenizer, adapter_dir: Path) -> None:
    done = await _workload(oai, http, engine, tokenizer, adapter_dir)
    num_aborted_prompt_tokens, held = await _abort_held(oai, http, engine)
    samples = await _scrape(http)
    names = {name for name, _ in samples}
    assert [name for name in DASHBOARD_NAMES + NEWER_NAMES if name not in names] == []
    for (name, labels), _ in samples.items():  # every vllm: series is labelled by the served model (vLLM's
        if name.startswith("vllm:") and name != "vllm:lora_requests_info":  # LoRA info has its own labels)
            assert dict(labels)["model_name"] == MODEL, (name, labels)

    reasons = [reason for _, reason in done]
    assert reasons.count("stop") == 1 and reasons.count("length") == len(done) - 1
    prompt_tokens = sum(usage.prompt_tokens for usage, _ in done)
    generation_tokens = sum(usage.completion_tokens for usage, _ in done)
    cached_tokens = sum(usage.prompt_tokens_details.cached_tokens for usage, _ in done)
    assert cached_tokens > 0
    assert _value(samples, "vllm:prompt_tokens_total") == prompt_tokens  # the aborted one never got a token
    assert _value(samples, "vllm:generation_tokens_total") == generation_tokens
    assert _value(samples, "vllm:prefix_cache_queries_total") == prompt_tokens
    assert _value(samples, "vllm:prefix_cache_hits_total") == cached_tokens
    for reason, num in (("stop", 1), ("length", len(done) - 1), ("abort", 1), ("error", 0)):
        assert _value(samples, "vllm:request_success_total", finished_reason=reason) == num, reason

    num_requests = len(done) + 1
    for name in PER_REQUEST:
        assert _value(samples, f"{name}_count") == num_requests, name
        assert _value(samples, f"{name}_bucket", le="+Inf") == num_requests, name
    assert _value(samples, "vllm:request_prompt_tokens_sum") == prompt_tokens + num_aborted_prompt_tokens
    assert _value(samples, "vllm:request_generation_tokens_sum") == generation_tokens
    assert _value(samples, "vllm:request_max_num_generation_tokens_sum") == generation_tokens
    assert _value(samples, "vllm:time_to_first_token_seconds_count") == len(done)
    num_gaps = generation_tokens - len(done)  # the fake engine emits one token a step
    assert _value(samples, "vllm:inter_token_latency_seconds_count") == num_gaps
    assert _value(samples, "vllm:time_per_output_token_seconds_count") == num_gaps
    phases = sum(_value(samples, f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert phases <= _value(samples, "vllm:e2e_request_latency_seconds_sum") + 1e-6
    assert _value(held, "vllm:request_success_total", finished_reason="abort") == 0.0


async def test_counts_start_at_zero_and_buckets_follow_vllm(http) -> None:
    samples = await _scrape(http)
    for reason in ("stop", "length", "abort", "error"):
        assert _value(samples, "vllm:request_success_total", finished_reason=reason) == 0.0
    ttft = sorted(
        float(dict(labels)["le"]) for name, labels in samples if name == "vllm:time_to_first_token_seconds_bucket"
    )
    assert ttft[:3] == [0.001, 0.005, 0.01] and ttft[-1] == float("inf")
    prompt = sorted(
        float(dict(labels)["le"]) for name, labels in samples if name == "vllm:request_prompt_tokens_bucket"
    )
    assert prompt == [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, float("inf")]  # vLLM's 1-2-5 up to max_model_len (64)


async def test_a_refused_request_is_not_counted_and_a_failed_one_is_an_error(oai, http, engine, adapter_dir) -> None:
    loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter_dir / "sql")})
    assert loaded.status_code == 200, loaded.text
    engine.unload_unheard("sql")  # the core refuses the next request for it (404): it never runs
    with pytest.raises(openai.NotFoundError):
        await oai.completions.create(model="sql", prompt="select", max_tokens=2)
    engine.hold = asyncio.Event()
    task = asyncio.ensure_future(oai.completions.create(model=MODEL, prompt="a b", max_tokens=4))
    while not engine.arrivals or engine.arrivals[-1].lora_name is not None:
        await asyncio.sleep(0.001)
    engine.fail("rank 0 failed")  # the engine fails while the request is in it: 503
    with pytest.raises(openai.APIStatusError) as failed:
        await task
    assert failed.value.status_code == 503
    samples = await _scrape(http)
    for reason, num in (("stop", 0), ("length", 0), ("abort", 0), ("error", 1)):
        assert _value(samples, "vllm:request_success_total", finished_reason=reason) == num, reason
    assert _value(samples, "vllm:e2e_request_latency_seconds_count") == 1
    assert _value(samples, "vllm:prompt_tokens_total") == _value(samples, "vllm:generation_tokens_total") == 0
