"""Per-adapter /metrics through the real process group: four adapters through two GPU slots
and a CPU tier of three, so loads come from disk and from the CPU tier. Every per-adapter
series equals what the event log says (loads by tier, load seconds, prompt and generated
tokens, also equal to the clients' usage), `ledgerserve replay --show adapters` prints the
same figures, `vllm:lora_requests_info` names the adapters with running requests (none when
idle), /v1/models gives each adapter's location, and an unload removes its series."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ledgerserve.scheduler_proc.replay import main as replay_main
from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import EventLogReader, newest_log
from tests.e2e.server import Server
from tests.peft_util import make_tiny_peft_adapter

pytestmark = pytest.mark.slow

ADAPTERS = ("a0", "a1", "a2", "a3")
NUM_ROUNDS = 2
PER_ADAPTER = (
    "ledgerserve_lora_location",
    "ledgerserve_lora_pinned",
    "ledgerserve_lora_requests_running",
    "ledgerserve_lora_requests_waiting",
    "ledgerserve_lora_prompt_tokens",
    "ledgerserve_lora_generation_tokens",
    "ledgerserve_lora_prefix_cache_hit_tokens",
    "ledgerserve_lora_loads",
    "ledgerserve_lora_load_seconds",
)


@pytest.fixture(scope="module")
def server(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("metrics-adapters")
    modules = [
        f"{name}={make_tiny_peft_adapter(demo_model_dir, root / name, seed=i + 1)}" for i, name in enumerate(ADAPTERS)
    ]
    args = [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "3",
        "--max-model-len",
        "1024",
        "--num-kv-blocks",
        "256",
        "--lora-allowed-dir",
        str(root),
        "--lora-modules",
        *modules,
    ]
    started = Server(demo_model_dir, str(tmp_path_factory.mktemp("metrics-events")), args).start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def usage(server: Server) -> dict[str, Counter]:
    """Rounds of one request per adapter at once, prompts of different lengths; the usage
    the clients were told, summed per adapter."""
    return asyncio.run(_workload(server))


async def _workload(server: Server) -> dict[str, Counter]:
    totals: dict[str, Counter] = {name: Counter() for name in ADAPTERS}
    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        for round_index in range(NUM_ROUNDS):
            calls = [
                client.completions.create(
                    model=name,
                    prompt="The river ran " * (1 + i + round_index),
                    max_tokens=4 + i,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                for i, name in enumerate(ADAPTERS)
            ]
            for name, out in zip(ADAPTERS, await asyncio.gather(*calls)):
                totals[name].update(prompt=out.usage.prompt_tokens, generated=out.usage.completion_tokens, requests=1)
    return totals


def _families(server: Server) -> dict[str, list]:
    """name -> samples, as prometheus_client's parser reads /metrics."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _by_adapter(samples: list, suffix: str = "") -> dict[str, float]:
    return {s.labels["adapter"]: s.value for s in samples if s.name.endswith(suffix) and "adapter" in s.labels}


def _wait_quiet(server: Server) -> dict[str, list]:
    """Idle, and no slot load in flight."""
    server.wait_idle()
    deadline = time.monotonic() + 20
    while (families := _families(server))["ledgerserve_lora_loads_in_flight"][0].value:
        assert time.monotonic() < deadline, "adapter loads still in flight"
        time.sleep(0.05)
    return families


def _log_figures(log_dir: str) -> dict[str, Counter]:
    """Straight from the event log (one rank, nothing fails, so every slot load reported is one load)."""
    names: dict[int, str] = {}
    arrived: dict[str, tuple[str, int]] = {}
    out: dict[str, Counter] = {name: Counter() for name in ADAPTERS}
    for _, event in EventLogReader(newest_log(log_dir)):
        if isinstance(event, ev.AdapterRegistered):
            names[event.version_id] = event.name
        elif isinstance(event, ev.AdapterLoadCompleted) and event.slot >= 0:
            out[names[event.version_id]].update({f"loads_{event.source_tier}": 1, "load_ms": event.duration_ms})
        elif isinstance(event, ev.RequestArrived) and event.lora_name is not None:
            arrived[event.req_id] = (event.lora_name, len(event.prompt_token_ids))
        elif isinstance(event, ev.RequestFinished) and event.req_id in arrived:
            name, num_prompt_tokens = arrived[event.req_id]
            out[name].update(prompt=num_prompt_tokens, generated=event.num_output_tokens, requests=1)
    return out


def test_per_adapter_series_equal_the_event_log(server: Server, usage: dict[str, Counter]) -> None:
    families = _wait_quiet(server)
    logged = _log_figures(server.log_dir)
    loads = Counter(
        {
            (s.labels["adapter"], s.labels["source_tier"]): s.value
            for s in families["ledgerserve_lora_loads"]
            if s.name.endswith("_total")
        }
    )
    load_seconds = _by_adapter(families["ledgerserve_lora_load_seconds"], "_sum")
    num_load_seconds = _by_adapter(families["ledgerserve_lora_load_seconds"], "_count")
    prompt = _by_adapter(families["ledgerserve_lora_prompt_tokens"])
    generated = _by_adapter(families["ledgerserve_lora_generation_tokens"])
    assert sum(loads.values()) >= len(ADAPTERS) and {tier for _, tier in loads} <= {"disk", "cpu"}
    for name in ADAPTERS:
        assert (loads[(name, "disk")], loads[(name, "cpu")]) == (logged[name]["loads_disk"], logged[name]["loads_cpu"])
        assert num_load_seconds.get(name, 0) == logged[name]["loads_disk"] + logged[name]["loads_cpu"]
        assert load_seconds.get(name, 0) * 1000 == pytest.approx(logged[name]["load_ms"])
        assert (prompt[name], generated[name]) == (logged[name]["prompt"], logged[name]["generated"])
        assert (prompt[name], generated[name]) == (usage[name]["prompt"], usage[name]["generated"])
    running = _by_adapter(families["ledgerserve_lora_requests_running"])
    waiting = _by_adapter(families["ledgerserve_lora_requests_waiting"])
    assert set(running.values()) == set(waiting.values()) == {0}
    located = {s.labels["adapter"]: s.labels["tier"] for s in families["ledgerserve_lora_location"] if s.value == 1}
    assert sorted(located) == list(ADAPTERS) and sum(tier == "gpu" for tier in located.values()) <= 2
    cards = {m["id"]: m for m in httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]}
    assert {name: cards[name]["location"] for name in ADAPTERS} == located


def test_replay_shows_the_same_figures(server: Server, usage: dict[str, Counter], capsys) -> None:
    families = _wait_quiet(server)
    assert replay_main([newest_log(server.log_dir), "--show", "adapters", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["figures"]["adapter_figures"]
    shown = {row["adapter"]: row for row in figures["adapters"]}
    loads = {
        (s.labels["adapter"], s.labels["source_tier"]): s.value
        for s in families["ledgerserve_lora_loads"]
        if s.name.endswith("_total")
    }
    located = {s.labels["adapter"]: s.labels["tier"] for s in families["ledgerserve_lora_location"] if s.value == 1}
    for name in ADAPTERS:
        row = shown[name]
        assert row["loads"] == {tier: loads.get((name, tier), 0) for tier in ("cpu", "disk")}
        assert row["load_ms"]["count"] == _by_adapter(families["ledgerserve_lora_load_seconds"], "_count").get(name, 0)
        assert row["load_ms"]["total"] == pytest.approx(
            _by_adapter(families["ledgerserve_lora_load_seconds"], "_sum").get(name, 0) * 1000, abs=0.01
        )
        assert row["num_prompt_tokens"] == _by_adapter(families["ledgerserve_lora_prompt_tokens"])[name]
        assert row["num_generated_tokens"] == _by_adapter(families["ledgerserve_lora_generation_tokens"])[name]
        assert row["num_cached_tokens"] == _by_adapter(families["ledgerserve_lora_prefix_cache_hit_tokens"])[name]
        assert row["tier"] == located[name]
        assert row["slot_hits"] + row["slot_misses"] == usage[name]["requests"] and row["slot_misses"] >= 1
    assert families["ledgerserve_lora_wait_steps"][0].value == figures["engine"]["num_lora_wait_steps"]
    assert families["ledgerserve_lora_wait_seconds"][0].value * 1000 == pytest.approx(
        figures["engine"]["lora_wait_ms"], abs=0.01
    )
    assert figures["engine"]["lora_wait_ms"] > 0  # the log times the misses' waits


def test_vllm_series_equal_the_clients_usage(server: Server, usage: dict[str, Counter]) -> None:
    """vLLM's names through the process group: every series labelled by the served model (adapter
    requests included), the counters equal to the usage the clients got, an idle engine's gauges at 0."""
    families = _wait_quiet(server)
    model_name = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    totals = sum(usage.values(), Counter())

    def value(name: str, **labels: str) -> float:
        (found,) = [s.value for s in families[name] if s.labels == {"model_name": model_name, **labels}]
        return found

    assert value("vllm:prompt_tokens") == totals["prompt"]
    assert value("vllm:generation_tokens") == totals["generated"]
    assert value("vllm:request_success", finished_reason="length") == totals["requests"]
    assert value("vllm:e2e_request_latency_seconds", le="+Inf") == totals["requests"]
    assert value("vllm:request_generation_tokens", le="+Inf") == totals["requests"]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert value(name) == 0.0, name  # idle: cached blocks no request holds count as free


def _requests_info(server: Server) -> tuple[str, str, str]:
    """vLLM's gauge (one series), checked against the per-adapter gauges of the same scrape."""
    families = _families(server)
    (sample,) = families["vllm:lora_requests_info"]
    labels = sample.labels["running_lora_adapters"], sample.labels["waiting_lora_adapters"], sample.labels["max_lora"]
    for label, gauge in zip(labels, ("ledgerserve_lora_requests_running", "ledgerserve_lora_requests_waiting")):
        assert label == ",".join(sorted(name for name, value in _by_adapter(families[gauge]).items() if value))
    return labels


def test_lora_requests_info_names_running_adapters(server: Server, usage: dict[str, Counter]) -> None:
    _wait_quiet(server)
    assert _requests_info(server) == ("", "", "2")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(
        model="a1", prompt="Hold on", max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    try:
        next(iter(stream))
        deadline = time.monotonic() + 10
        while _requests_info(server)[0] != "a1":
            assert time.monotonic() < deadline, _requests_info(server)
            time.sleep(0.02)
    finally:
        stream.close()
    _wait_quiet(server)
    assert _requests_info(server) == ("", "", "2")


def test_unload_removes_an_adapters_series(server: Server, usage: dict[str, Counter]) -> None:
    _wait_quiet(server)
    assert "a3" in _by_adapter(_families(server)["ledgerserve_lora_prompt_tokens"])
    r = httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": "a3"}, timeout=30)
    assert r.status_code == 200, r.text
    families = _families(server)
    for name in PER_ADAPTER:
        assert all(s.labels.get("adapter") != "a3" for s in families.get(name, [])), name
        assert name == "ledgerserve_lora_loads" or any(s.labels.get("adapter") == "a0" for s in families[name]), name
    assert "a3" not in {m["id"] for m in httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]}
